"""A fault in drafting costs that step's drafts, never a request.

Drafting is an optimisation: `FailSafe.call` runs one proposer step and, if anything in it
raises, returns no drafts for that step instead, so the step's tokens are exactly plain
decoding's (draft KV written before the fault lies past the verified range, and the next
verification rewrites those slots before any attention reads them). Each fault is counted and
logged (the first of each kind with its traceback); after `MAX_CONSECUTIVE_FAULTS` faults in a
row, or `MAX_FAULTS` in all, self-admg switches itself off for the engine with one ERROR line
and the engine serves on as plain decoding.

Under tensor parallelism a fault must happen on every rank alike (as an injected one does):
ranks meet in collectives inside a step, and a rank that skips them stalls the others.

Tests inject faults through `VLLM_SELFSPEC_INJECT_FAULT`: comma-separated `STAGE@N` (raise at
the N-th call of that stage) or `STAGE@every`, for the stages in `STAGES`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.selfspec")

MAX_CONSECUTIVE_FAULTS = 3
MAX_FAULTS = 20
INJECT_ENV = "VLLM_SELFSPEC_INJECT_FAULT"
STAGES = ("lookup", "plan", "probe", "draft")


class InjectedFault(RuntimeError):
    """Raised at a fault point on a test's request."""


@dataclass
class FailSafe:
    faults: int = 0
    consecutive: int = 0
    disabled: bool = False
    kinds_seen: set = field(default_factory=set)

    def call(self, step, fallback):
        """`step()`, or `fallback()` if it raises or drafting is switched off."""
        if self.disabled:
            return fallback()
        try:
            result = step()
        except Exception as err:  # any fault in an optimisation: serve the step without it
            self.record(err)
            return fallback()
        self.consecutive = 0
        return result

    def record(self, err: Exception) -> None:
        self.faults += 1
        self.consecutive += 1
        kind = f"{type(err).__name__}: {err}"
        first_of_kind = kind not in self.kinds_seen
        self.kinds_seen.add(kind)
        logger.warning("self-admg drafting fault (%d so far), this step runs without drafts: %s",
                       self.faults, kind, exc_info=err if first_of_kind else None)
        if self.consecutive >= MAX_CONSECUTIVE_FAULTS or self.faults >= MAX_FAULTS:
            self.disabled = True
            logger.error("self-admg switched off after %d drafting faults (%d in a row): serving on as "
                         "plain decoding", self.faults, self.consecutive)


def _parse(spec: str) -> dict[str, int | None]:
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, _, when = item.partition("@")
        if stage not in STAGES:
            raise ValueError(f"{INJECT_ENV}: unknown stage {stage!r}; stages are {list(STAGES)}")
        points[stage] = None if when in ("", "every") else int(when)
    return points


_injected: dict[str, int | None] | None = None  # read from the environment at the first call
_calls: dict[str, int] = {}


def fault_point(stage: str) -> None:
    """Raise `InjectedFault` here if a test asked for one at this stage and call."""
    global _injected
    if _injected is None:
        _injected = _parse(os.environ.get(INJECT_ENV, ""))
    if not _injected or stage not in _injected:
        return
    _calls[stage] = _calls.get(stage, 0) + 1
    when = _injected[stage]
    if when is None or when == _calls[stage]:
        raise InjectedFault(f"injected fault at {stage} (call {_calls[stage]})")
