# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The scheduler's side of first tokens (`vllm_selfspec.control.first_tokens`) in self-admg engines.

When a step is about to prefill (a request waits that the scheduler can admit now, or a prompt
is being prefilled in chunks), the requests running beside it verify no drafts in that step:
they lose one step's drafts, which is lossless, and the step costs what plain decoding's does.

Whether a waiting request will be admitted is a guess made before vLLM schedules: requests that
wait for a free slot, a compiled grammar, remote KV or a paused scheduler are not counted, and
if a step that withheld drafts admitted nobody all the same (the KV cache is full, say), drafts
are withheld again only once the numbers of running and waiting requests change. So drafting
never stops for a queue that cannot move; such requests wait for others to finish, which
drafts hasten.

Each step's `SchedulerNote` is written here, in one place: the admissible requests left
waiting, whether batches are closed, the prefix-cache resets (`reset_prefix_cache`, which sleep
mode calls too) and this process's hook faults so far, and the new requests' tenants.

A fault here must not reach vLLM's scheduler, which would take the engine down: it is logged
once, counted, and the step is scheduled as vLLM would; a note that could not be made is not
sent (the workers read the closed default), and tenants that could not be digested are left
out (those requests get no history).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

from vllm_selfspec.operations.fail_safe import fault_point
from vllm_selfspec.options import CLOSED_BATCHES_KEY
from vllm_selfspec.scheduler_note import SchedulerNote, attach_note, salt_digest
from vllm_selfspec.vllm_integration.patching import original, patch
from vllm_selfspec.vllm_integration.scheduler_lookahead import is_self_admg_config

logger = logging.getLogger("vllm.selfspec")


# Steps of withholding a server may bank while no prompt waits, and spend on a burst of
# arrivals before the share (`max_withheld_share`) binds.
MAX_BANKED_WITHHOLDINGS = 4.0


@dataclass
class SchedulerMemory:
    """What the hooks keep of one scheduler between steps (beside it, not on vLLM's object)."""

    prefix_cache_resets: int = 0
    withheld_in_vain: tuple | None = None  # (running, waiting) when withholding last admitted nobody
    # A token bucket: each step adds `max_withheld_share`, each withholding takes one, so that in
    # any run of steps at most that share (plus the bank) withheld the running requests' drafts.
    withholdings_banked: float = MAX_BANKED_WITHHOLDINGS
    max_withheld_share: float | None = None  # the option, read once


_memories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memory_of(scheduler) -> SchedulerMemory:
    return _memories.setdefault(scheduler, SchedulerMemory())


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
        _guarded(lambda: _count_reset(memory_of(self)), None)
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


def _count_reset(memory: SchedulerMemory) -> None:
    memory.prefix_cache_resets += 1


def schedule_for_first_tokens(scheduler, vllm_schedule, *args, **kwargs):
    """One step of a self-admg engine's scheduler: vLLM's `schedule`, with drafts withheld if
    the step is about to prefill in a server, and the step's note to the workers."""
    withheld_for = _guarded(lambda: withhold_drafts_beside_prefill(scheduler), "")
    output = vllm_schedule(*args, **kwargs)
    waiting = _guarded(lambda: _after_schedule(scheduler, output, withheld_for), 0)
    tenants = _guarded(lambda: new_tenants(scheduler, output), ())
    _guarded(lambda: attach_note(output, _note(scheduler, waiting, tenants)), None)
    return output


def _note(scheduler, waiting: int, tenants: tuple) -> SchedulerNote:
    return SchedulerNote(
        waiting_requests=waiting,
        closed_batches=closed_batches(scheduler),
        prefix_cache_resets=memory_of(scheduler).prefix_cache_resets,
        scheduler_faults=faults,
        tenants=tenants,
    )


def closed_batches(scheduler) -> bool:
    config = scheduler.vllm_config.additional_config
    return isinstance(config, dict) and bool(config.get(CLOSED_BATCHES_KEY))


def new_tenants(scheduler, output) -> tuple[tuple[str, bytes | None], ...]:
    """Each request admitted new in this step, with its tenant: the digest of its cache_salt.
    A request without the attribute (another vLLM) is left out: unknown, so no history."""
    fault_point("tenants")
    tenants = []
    for data in output.scheduled_new_reqs:
        request = scheduler.requests.get(data.req_id)
        if request is not None and hasattr(request, "cache_salt"):
            tenants.append((data.req_id, salt_digest(request.cache_salt)))
    return tuple(tenants)


def withhold_drafts_beside_prefill(scheduler) -> str:
    """Clear the running requests' drafts if this step is about to prefill, in a server. Why
    it did: "chunk" (a prompt is being prefilled in chunks) or "admission"; "" if it did not."""
    fault_point("schedule")
    if closed_batches(scheduler):
        return ""
    memory = memory_of(scheduler)
    if memory.max_withheld_share is None:
        memory.max_withheld_share = _max_withheld_share(scheduler)
    if any(request.is_prefill_chunk for request in scheduler.running):
        why = "chunk"
    elif admissible_waiting(scheduler) and not _queue_stuck(scheduler):
        why = "admission"
    else:
        why = ""
    if not may_withhold(memory, wanted=bool(why)):
        return ""
    for request in scheduler.running:
        request.spec_token_ids = []  # (vLLM clears them too once they are scheduled)
    return why


def may_withhold(memory: SchedulerMemory, wanted: bool) -> bool:
    """One step of the token bucket: whether this step may withhold drafts (`wanted`: a prompt
    waits or is prefilled), within `max_withheld_share` of the steps."""
    memory.withholdings_banked = min(MAX_BANKED_WITHHOLDINGS, memory.withholdings_banked + memory.max_withheld_share)
    if not wanted or memory.withholdings_banked < 1.0:
        return False
    memory.withholdings_banked -= 1.0
    return True


def _max_withheld_share(scheduler) -> float:
    from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, make_options

    config = scheduler.vllm_config.additional_config or {}
    return make_options(config.get(ADDITIONAL_CONFIG_KEY, {})).max_withheld_share


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
    stuck, or while the next step may not withhold: the workers would plan no drafts for it)."""
    memory = memory_of(scheduler)
    admitted = bool(output.scheduled_new_reqs or output.scheduled_cached_reqs.resumed_req_ids)
    if withheld_for == "admission" and not admitted:
        memory.withheld_in_vain = scheduler.get_request_counts()
    elif admitted:
        memory.withheld_in_vain = None
    may_withhold_next = memory.withholdings_banked + (memory.max_withheld_share or 0.0) >= 1.0
    return admissible_waiting(scheduler) if may_withhold_next and not _queue_stuck(scheduler) else 0


def _queue_stuck(scheduler) -> bool:
    """Whether the counts are those of a withholding that admitted nobody."""
    return scheduler.get_request_counts() == memory_of(scheduler).withheld_in_vain


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
