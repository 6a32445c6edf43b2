"""Carry each request's tenant key, its `cache_salt`, from the scheduler to the worker.

vLLM keeps tenants apart in the prefix cache by `cache_salt`, but the worker never learns it:
`NewRequestData` (vLLM 0.32) has no such field. Lookup drafts from earlier outputs must stay
within a tenant (whether several tokens arrive at once would otherwise tell one user what
another was recently sent), so the scheduler's `NewRequestData.from_request` attaches the salt
as one extra attribute, which pickling carries to the workers.
"""

from vllm_selfspec.vllm_compat.patching import original, patch

ATTRIBUTE = "self_admg_tenant"


def apply() -> None:
    from vllm.v1.core.sched.output import NewRequestData

    def from_request(cls, request, *args, **kwargs):
        data = original(NewRequestData, "from_request").__func__(cls, request, *args, **kwargs)
        setattr(data, ATTRIBUTE, getattr(request, "cache_salt", None))
        return data

    patch(NewRequestData, "from_request", classmethod(from_request),
          "carry cache_salt to the worker, so lookup history stays within a tenant")


def tenant_of(new_request_data) -> str | None:
    """The tenant of a scheduled new request (None: no salt, the shared pool)."""
    return getattr(new_request_data, ATTRIBUTE, None)
