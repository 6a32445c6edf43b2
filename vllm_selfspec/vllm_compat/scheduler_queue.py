"""The scheduler's part in keeping first tokens as early as plain decoding's (self-admg servers).

A prompt's first token comes out of the step that prefills it, so drafts verified in that step
delay it by their verification. When a step is about to prefill (a request waits that the
scheduler can admit now, or a prompt is being prefilled in chunks), the requests running beside
it verify no drafts in that step: they lose one step's drafts, which is lossless, and the step
costs what plain decoding's does. Offline batches (`self_admg_closed_batches`) keep their
drafts: there a first token is worth nothing before the batch's end.

Whether a waiting request will be admitted is a guess made before vLLM schedules: requests that
wait for a free slot, a compiled grammar, remote KV or a paused scheduler are not counted, and
if a step that withheld drafts admitted nobody all the same (the KV cache is full, say), drafts
are withheld again only once the numbers of running and waiting requests change. So drafting
never stops for a queue that cannot move; such requests wait for others to finish, which
drafts hasten.

The worker plans the next step's drafts and needs to know when a prompt will wait for that
step too (`control.planner`), but vLLM 0.32's `SchedulerOutput` says nothing of the queue:
`schedule` attaches the number of admissible requests left waiting after this step's
admissions as one extra attribute, which pickling carries to the workers.

The scheduler also counts its prefix-cache resets (`reset_prefix_cache`, which sleep mode
calls too) and tells the workers the count each step: a worker that sees it change forgets
every earlier output it keeps for lookup drafts, as vLLM forgets its cached prefixes.

A fault here must not reach vLLM's scheduler, which would take the engine down: it is logged
once, counted, and the step is scheduled as vLLM would.
"""

from __future__ import annotations

import functools
import logging

from vllm_selfspec.fail_safe import fault_point
from vllm_selfspec.options import CLOSED_BATCHES_KEY
from vllm_selfspec.vllm_compat import request_tenant
from vllm_selfspec.vllm_compat.patching import original, patch
from vllm_selfspec.vllm_compat.scheduler_lookahead import is_self_admg_config

logger = logging.getLogger(__name__)

ATTRIBUTE = "self_admg_waiting"
IN_VAIN = "_self_admg_withheld_in_vain"  # (running, waiting) when withholding last admitted nobody
RESETS = "self_admg_prefix_cache_resets"  # on the scheduler and on each step's output
FAULTS = "self_admg_scheduler_faults"  # on each step's output: the scheduler's hooks' faults so far


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self, *args, **kwargs):
        vllm_schedule = functools.partial(original(Scheduler, "schedule"), self)
        if not _guarded(lambda: is_self_admg_config(self.vllm_config.speculative_config), False):
            return vllm_schedule(*args, **kwargs)
        return schedule_for_first_tokens(self, vllm_schedule, *args, **kwargs)

    def reset_prefix_cache(self, *args, **kwargs):
        reset = original(Scheduler, "reset_prefix_cache")(self, *args, **kwargs)
        # Counted whether or not vLLM could reset (running requests hold blocks): forgetting
        # lookup history more often than needed is always safe.
        _guarded(lambda: setattr(self, RESETS, getattr(self, RESETS, 0) + 1), None)
        return reset

    patch(
        Scheduler,
        "schedule",
        schedule,
        "no drafts verified beside a prefill in self-admg servers; tell the workers how many requests wait",
    )
    patch(
        Scheduler,
        "reset_prefix_cache",
        reset_prefix_cache,
        "count prefix-cache resets, so that self-admg's workers forget their lookup history with them",
    )


def schedule_for_first_tokens(scheduler, vllm_schedule, *args, **kwargs):
    """One step of a self-admg engine's scheduler: vLLM's `schedule`, with drafts withheld if
    the step is about to prefill in a server, and the count of admissible requests left waiting."""
    withheld_for = _guarded(lambda: withhold_drafts_beside_prefill(scheduler), "")
    output = vllm_schedule(*args, **kwargs)
    setattr(output, ATTRIBUTE, _guarded(lambda: _after_schedule(scheduler, output, withheld_for), 0))
    setattr(output, RESETS, getattr(scheduler, RESETS, 0))
    setattr(output, FAULTS, faults + request_tenant.faults)  # the workers publish them on /metrics
    return output


def withhold_drafts_beside_prefill(scheduler) -> str:
    """Clear the running requests' drafts if this step is about to prefill, in a server. Why
    it did: "chunk" (a prompt is being prefilled in chunks) or "admission"; "" if it did not."""
    fault_point("schedule")
    config = scheduler.vllm_config.additional_config
    if isinstance(config, dict) and config.get(CLOSED_BATCHES_KEY):
        return ""
    if any(request.is_prefill_chunk for request in scheduler.running):
        why = "chunk"
    elif admissible_waiting(scheduler) and not _queue_stuck(scheduler):
        why = "admission"
    else:
        return ""
    for request in scheduler.running:
        request.spec_token_ids = []  # (vLLM clears them too once they are scheduled)
    return why


def admissible_waiting(scheduler) -> int:
    """Waiting requests the scheduler may admit now: not blocked (vLLM's `deferred_waiting`:
    a grammar, remote KV), with a free slot, and new requests not paused."""
    from vllm.v1.core.sched.interface import PauseState

    if scheduler._pause_state != PauseState.UNPAUSED:
        return 0
    if len(scheduler.running) + scheduler.num_waiting_for_streaming_input >= scheduler.max_num_active_reqs:
        return 0
    _, waiting = scheduler.get_request_counts()
    return max(0, waiting - len(scheduler.deferred_waiting))


def _after_schedule(scheduler, output, withheld_for: str) -> int:
    """Remember a withholding for an admission that admitted nobody, until the counts change
    or someone is admitted; the admissible requests left waiting (none while the queue is
    stuck: the workers would plan no drafts for it)."""
    admitted = bool(output.scheduled_new_reqs or output.scheduled_cached_reqs.resumed_req_ids)
    if withheld_for == "admission" and not admitted:
        setattr(scheduler, IN_VAIN, scheduler.get_request_counts())
    elif admitted:
        setattr(scheduler, IN_VAIN, None)
    return 0 if _queue_stuck(scheduler) else admissible_waiting(scheduler)


def _queue_stuck(scheduler) -> bool:
    """Whether the counts are those of a withholding that admitted nobody."""
    return scheduler.get_request_counts() == getattr(scheduler, IN_VAIN, None)


faults = 0  # in this scheduler's process


def _guarded(work, default):
    global faults
    try:
        return work()
    except Exception:  # never into vLLM's scheduler: the step goes on as vLLM schedules it
        faults += 1
        if faults == 1:
            logger.exception("self-admg's scheduler rules failed; scheduling as vLLM does (logged once)")
        return default


def scheduler_faults(scheduler_output) -> int:
    """The scheduler's hooks' faults so far (0 if it did not say)."""
    return getattr(scheduler_output, FAULTS, 0)


def prefix_cache_resets(scheduler_output) -> int:
    """How many times the scheduler has reset its prefix cache (0 if it did not say)."""
    return getattr(scheduler_output, RESETS, 0)


def waiting_requests(scheduler_output) -> int:
    """Admissible requests left waiting after the step's admissions (0 if the scheduler did
    not say)."""
    return getattr(scheduler_output, ATTRIBUTE, 0)
