"""A fault in drafting costs that step's drafts, on every rank alike, never a request.

Drafting is an optimisation: `FailSafe.call` runs one proposer step and, if anything in it
raises, returns no drafts for that step instead, so the step's tokens are exactly plain
decoding's (draft KV written before the fault lies past the verified range, and the next
verification rewrites those slots before any attention reads them). Each fault is counted and
logged (the first of each kind with its traceback); after `MAX_CONSECUTIVE_FAULTS` faults in a
row, or `MAX_FAULTS` in all, self-admg switches itself off for the engine with one ERROR line
and the engine serves on as plain decoding.

Tensor-parallel ranks meet in collectives inside a step (broadcasts, the model's all-reduces),
and a rank that skips them stalls the others. So a step is split where the ranks first meet:
everything before is rank-local (learning, lookup, planning), and `agree` then takes one small
all-reduce of (this rank failed, this rank wants drafting off). If any rank failed, every rank
skips drafting that step; if any rank wants drafting off, every rank switches it off in that
same step. After the agreement every rank runs the same forwards on the same broadcast inputs.

Tests inject faults through `VLLM_SELFSPEC_INJECT_FAULT`: comma-separated `STAGE@N` (raise at
the N-th call of that stage) or `STAGE@every`, for the stages in `STAGES`; `STAGE@N@rankR`
raises on tensor-parallel rank R only (rank-local stages only, `LOCAL_STAGES`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.selfspec")

MAX_CONSECUTIVE_FAULTS = 3
MAX_FAULTS = 20
MAX_KINDS_REMEMBERED = 64  # distinct fault messages kept (for the first-of-kind traceback)
INJECT_ENV = "VLLM_SELFSPEC_INJECT_FAULT"
STAGES = ("lookup", "plan", "probe", "draft")
LOCAL_STAGES = ("lookup", "plan")  # before the ranks' agreement


class InjectedFault(RuntimeError):
    """Raised at a fault point on a test's request."""


def _alone(flags: list[int]) -> list[int]:
    return flags


@dataclass
class FailSafe:
    faults: int = 0
    consecutive: int = 0
    disabled: bool = False
    switch_off_wanted: bool = False  # this rank's faults reached a limit; `agree` makes it so everywhere
    steps_skipped: int = 0  # steps every rank ran without drafts because some rank failed
    kinds_seen: set = field(default_factory=set)
    # The element-wise maximum of each rank's flags (one all-reduce); alone, the flags themselves.
    max_over_ranks: Callable[[list[int]], list[int]] = _alone

    def attempt(self, step):
        """`step()`, or None if it raises (the fault recorded): the rank-local part of a step."""
        try:
            return step()
        except Exception as err:  # any fault in an optimisation: serve the step without it
            self.record(err)
            return None

    def agree(self, ok: bool, votes: tuple[int, ...] = ()) -> tuple[bool, list[int]]:
        """Whether every rank may draft this step (this rank did its part, `ok`, no rank failed
        and none wants drafting off), and the maximum over ranks of each of `votes` (other
        per-step decisions the ranks must share). Every rank must call it in every step until
        drafting is off, since it is a collective."""
        if self.disabled:
            return False, list(votes)
        failed, off, *agreed = self.max_over_ranks([int(not ok), int(self.switch_off_wanted), *votes])
        if off:
            self.disabled = True
            logger.error(
                "self-admg switched off after drafting faults (%d on this rank, %d in a row): "
                "serving on as plain decoding",
                self.faults,
                self.consecutive,
            )
            return False, agreed
        if failed:
            self.steps_skipped += 1
            return False, agreed
        return True, agreed

    def call(self, step, fallback):
        """`step()`, or `fallback()` if it raises or drafting is switched off."""
        if self.disabled:
            return fallback()
        result = self.attempt(step)
        if result is None:
            return fallback()
        self.consecutive = 0
        return result

    def record(self, err: Exception) -> None:
        self.faults += 1
        self.consecutive += 1
        kind = f"{type(err).__name__}: {err}"
        first_of_kind = kind not in self.kinds_seen and len(self.kinds_seen) < MAX_KINDS_REMEMBERED
        if first_of_kind:
            self.kinds_seen.add(kind)
        if self.disabled:  # already serving as plain decoding: a clean-up fault needs no alarm
            logger.debug("self-admg fault after switch-off: %s", kind)
            return
        logger.warning(
            "self-admg drafting fault (%d so far), this step runs without drafts: %s",
            self.faults,
            kind,
            exc_info=err if first_of_kind else None,
        )
        if self.consecutive >= MAX_CONSECUTIVE_FAULTS or self.faults >= MAX_FAULTS:
            self.switch_off_wanted = True


def _parse(spec: str) -> dict[str, tuple[int | None, int | None]]:
    """stage -> (call number or None for every call, rank or None for every rank)."""
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, _, rest = item.partition("@")
        when, _, rank = rest.partition("@")
        if stage not in STAGES:
            raise ValueError(f"{INJECT_ENV}: unknown stage {stage!r}; stages are {list(STAGES)}")
        if rank and (not rank.startswith("rank") or stage not in LOCAL_STAGES):
            raise ValueError(
                f"{INJECT_ENV}: {item!r}: a fault on one rank is written STAGE@N@rankR, for the "
                f"stages before the ranks' agreement {list(LOCAL_STAGES)}"
            )
        points[stage] = (None if when in ("", "every") else int(when), int(rank[4:]) if rank else None)
    return points


_injected: dict[str, tuple[int | None, int | None]] | None = None  # read from the environment at the first call
_calls: dict[str, int] = {}


def fault_point(stage: str) -> None:
    """Raise `InjectedFault` here if a test asked for one at this stage, call and rank."""
    global _injected
    if _injected is None:
        _injected = _parse(os.environ.get(INJECT_ENV, ""))
    if not _injected or stage not in _injected:
        return
    _calls[stage] = _calls.get(stage, 0) + 1
    when, rank = _injected[stage]
    if (when is None or when == _calls[stage]) and (rank is None or rank == _rank()):
        raise InjectedFault(f"injected fault at {stage} (call {_calls[stage]})")


def _rank() -> int:
    from vllm_selfspec.vllm_compat.draft_forward import tensor_parallel_rank

    return tensor_parallel_rank()
