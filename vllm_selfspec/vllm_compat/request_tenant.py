"""Carry each request's tenant key, its `cache_salt`, from the scheduler to the worker.

vLLM keeps tenants apart in the prefix cache by `cache_salt`, but the worker never learns it:
`NewRequestData` (vLLM 0.32) has no such field. Lookup drafts from earlier outputs must stay
within a tenant (whether several tokens arrive at once would otherwise tell one user what
another was recently sent), so the scheduler's `NewRequestData.from_request` attaches a digest
of the salt as one extra attribute, which pickling carries to the workers, and the runner hook
copies it onto the runner's own state of the request when the runner admits it
(`remember_tenants`).

That happens in every step that admits a request, whether or not the proposer runs in it (vLLM
skips the proposer in steps where a request is within K tokens of max_model_len), and the
tenant then lives and dies with vLLM's own state of the request. A request whose tenant was
never attached reads as UNKNOWN_TENANT, which neither reads nor writes any history: so a fault
in attaching it (logged once and counted, never raised into vLLM's scheduler) fails closed.
"""

import hashlib
import logging

from vllm_selfspec.fail_safe import fault_point
from vllm_selfspec.vllm_compat.patching import original, patch

logger = logging.getLogger("vllm.selfspec")

ATTRIBUTE = "self_admg_tenant"


def apply() -> None:
    from vllm.v1.core.sched.output import NewRequestData

    def from_request(cls, request, *args, **kwargs):
        data = original(NewRequestData, "from_request").__func__(cls, request, *args, **kwargs)
        try:
            fault_point("new_request")
            if hasattr(request, "cache_salt"):  # else the tenant stays unknown: no history at all
                setattr(data, ATTRIBUTE, salt_digest(request.cache_salt))
        except Exception:  # the tenant stays unknown: this request gets no history
            _count_fault()
        return data

    patch(
        NewRequestData,
        "from_request",
        classmethod(from_request),
        "carry cache_salt to the worker, so lookup history stays within a tenant",
    )


faults = 0  # in this scheduler's process


def salt_digest(salt: str | None) -> bytes | None:
    """The salt as 16 bytes (`lookup.salt_digest`, without loading the lookup here): hashed
    once per request, so that a salt of any length costs the workers nothing more."""
    return None if salt is None else hashlib.blake2b(str(salt).encode(), digest_size=16).digest()


def _count_fault() -> None:
    global faults
    faults += 1
    if faults == 1:
        logger.exception("self-admg could not attach a request's tenant; it gets no lookup history (logged once)")


def remember_tenants(runner, scheduler_output) -> None:
    """Attach each newly scheduled request's tenant to the runner's state of it (run right after
    the runner has added this step's new requests)."""
    for data in scheduler_output.scheduled_new_reqs:
        state = runner.requests.get(data.req_id)
        if state is not None:
            setattr(state, ATTRIBUTE, tenant_of(data))


def tenant_of(request) -> "str | None | object":
    """The tenant of a scheduled new request or of the runner's state of one: its cache_salt,
    None for the shared pool of requests without one, UNKNOWN_TENANT if it never arrived."""
    from vllm_selfspec.lookup import UNKNOWN_TENANT  # (in workers only: lookup loads numba)

    return getattr(request, ATTRIBUTE, UNKNOWN_TENANT)
