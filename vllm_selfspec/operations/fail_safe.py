# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A fault in drafting costs that step's drafts, on every rank alike, never a request.

Drafting is an optimisation: `FailSafe.call` runs one proposer step and, if anything in it
raises, returns no drafts for that step instead, so the step's tokens are exactly plain
decoding's (draft KV written before the fault lies past the verified range, and the next
verification rewrites those slots before any attention reads them). Each fault is counted and
logged (the first of each kind with its traceback).

The budget heals. Faults are counted over the last `WINDOW_STEPS` steps: after
`MAX_CONSECUTIVE_FAULTS` faulted steps in a row, or `MAX_FAULTS_IN_WINDOW` faults within the
window, self-admg switches drafting off with one ERROR line and the engine serves on as plain
decoding. After a cool-down of `COOL_DOWN_STEPS` steps it drafts again on probation; a switch-off
within the window after that doubles the next cool-down (up to `MAX_COOL_DOWN_STEPS`), a clean
window resets it. So rare transient faults never switch drafting off for good, and a persistent
one costs a probe step once in a long while.

A fault that one request causes costs that request's drafts before anyone else's
(`RequestQuarantine`): where a fault is the work of one row (its lookup), that request drafts no
more, and neither does a later request with the same prompt, so a client that resends what made
drafting fault costs one fault, not the engine's budget. Such a fault costs no other row's
drafts. Quarantine is rank-local: rank 0's plan, which every rank follows, leaves its rows out.

Tensor-parallel ranks meet in collectives inside a step (broadcasts, the model's all-reduces),
and a rank that skips them stalls the others. So a step is split where the ranks first meet:
everything before is rank-local (learning, lookup, planning), and `agree` then takes one small
all-reduce of (this rank failed, this rank wants drafting off, other votes). If any rank
failed, every rank skips drafting that step; if any rank wants drafting off, every rank
switches it off in that same step, and every rank then counts the same cool-down. After the
agreement every rank runs the same forwards on the same broadcast inputs, and each rank's
own part of them (a forward's metadata and inputs) ends at a checkpoint, one more small
all-reduce under tensor parallelism: a fault there on any rank stops every rank at that same
checkpoint (`RanksStopped` on the others), before any rank enters a collective the others
would never reach.

Every part of a step that may fault has a `fault_point`: the tests' fault injection
(tests/fault_injection.py, a vLLM plugin only the test suite installs) raises there on purpose;
in production no hook is set and a point costs one global read.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger("vllm.selfspec")

MAX_CONSECUTIVE_FAULTS = 3
MAX_FAULTS_IN_WINDOW = 20
WINDOW_STEPS = 1000
COOL_DOWN_STEPS = 2000
MAX_COOL_DOWN_STEPS = 128_000
MAX_KINDS_REMEMBERED = 64  # distinct fault messages kept (for the first-of-kind traceback)
MAX_PROMPTS_QUARANTINED = 1024


class RanksStopped(RuntimeError):
    """Another tensor-parallel rank failed its own part of a draft the ranks had agreed on, and
    every rank stopped at the same checkpoint (`draft_forward.meet_after`)."""


def _alone(flags: list[int]) -> list[int]:
    return flags


@dataclass
class FailSafe:
    faults: int = 0  # since the engine started (the metric)
    consecutive: int = 0
    disabled: bool = False
    switch_off_wanted: bool = False  # this rank's faults reached a limit; `agree` makes it so everywhere
    steps_skipped: int = 0  # steps every rank ran without drafts because some rank failed
    kinds_seen: set = field(default_factory=set)
    # The element-wise maximum of each rank's flags (one all-reduce); alone, the flags themselves.
    max_over_ranks: Callable[[list[int]], list[int]] = _alone
    step: int = 0  # steps seen (`tick`), alike on every rank
    recent: deque = field(default_factory=deque)  # the steps of the faults within the window
    cool_down: int = COOL_DOWN_STEPS
    resume_at: int = 0  # while disabled: the step drafting resumes at
    probation_until: int = 0  # a switch-off before this step doubles the next cool-down

    def tick(self) -> None:
        """A step began (every rank calls it once per step, drafting or not): the window moves
        on, and a cool-down that ended re-enables drafting, on probation."""
        self.step += 1
        while self.recent and self.recent[0] <= self.step - WINDOW_STEPS:
            self.recent.popleft()
        if self.disabled and self.step >= self.resume_at:
            self.disabled = self.switch_off_wanted = False
            self.consecutive = 0
            self.recent.clear()
            self.probation_until = self.step + WINDOW_STEPS
            logger.warning("self-admg drafts again after %d steps switched off, on probation", self.cool_down)
        elif not self.disabled and self.probation_until and self.step >= self.probation_until:
            self.probation_until = 0
            self.cool_down = COOL_DOWN_STEPS  # a clean window: the next switch-off starts afresh

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
        per-step decisions the ranks must share). Every rank must call it in every step while
        drafting is on, since it is a collective."""
        if self.disabled:
            return False, list(votes)
        failed, off, *agreed = self.max_over_ranks([int(not ok), int(self.switch_off_wanted), *votes])
        if off:
            self._switch_off()
            return False, agreed
        if failed:
            self.steps_skipped += 1
            return False, agreed
        return True, agreed

    def call(self, step, fallback):
        """`step()`, the part of a step every rank runs alike once they agreed to draft, or
        `fallback()` if it raises or drafting is switched off. A fault on any rank stops every
        rank at the same checkpoint: the rank that faulted counts the fault, every rank the
        skipped step, as the agreement does."""
        if self.disabled:
            return fallback()
        try:
            result = step()
        except RanksStopped:
            self.steps_skipped += 1
            return fallback()
        except Exception as err:  # any fault in an optimisation: serve the step without it
            self.record(err)
            self.steps_skipped += 1
            return fallback()
        self.consecutive = 0
        return result

    def record(self, err: Exception, one_request: bool = False) -> None:
        """Count a fault. `one_request`: the fault was one request's own and cost only its
        drafts (`RequestQuarantine`): it counts in the window, where many such faults still
        switch drafting off, but it is not a faulted step, and after the first of its kind it
        is logged at DEBUG, so that no client can fill the log."""
        self.faults += 1
        kind = _kind(err)
        first_of_kind = kind not in self.kinds_seen and len(self.kinds_seen) < MAX_KINDS_REMEMBERED
        if first_of_kind:
            self.kinds_seen.add(kind)
        if self.disabled:  # already serving as plain decoding: a clean-up fault needs no alarm
            logger.debug("self-admg fault while switched off: %s", kind)
            return
        self.recent.append(self.step)
        if one_request:
            logger.log(
                logging.WARNING if first_of_kind else logging.DEBUG,
                "self-admg drafting fault in one request (%d so far), that request drafts no more: %s",
                self.faults,
                kind,
                exc_info=err if first_of_kind else None,
            )
        else:
            self.consecutive += 1
            logger.warning(
                "self-admg drafting fault (%d so far), this step runs without drafts: %s",
                self.faults,
                kind,
                exc_info=err if first_of_kind else None,
            )
        if self.consecutive >= MAX_CONSECUTIVE_FAULTS or len(self.recent) >= MAX_FAULTS_IN_WINDOW:
            self.switch_off_wanted = True

    def _switch_off(self) -> None:
        if self.probation_until and self.step < self.probation_until:
            self.cool_down = min(2 * self.cool_down, MAX_COOL_DOWN_STEPS)
        self.disabled = True
        self.probation_until = 0
        self.resume_at = self.step + self.cool_down
        logger.error(
            "self-admg switched off after drafting faults (%d within %d steps on this rank, %d in a "
            "row): serving as plain decoding for the next %d steps",
            len(self.recent),
            WINDOW_STEPS,
            self.consecutive,
            self.cool_down,
        )


def _kind(err: Exception) -> str:
    try:
        return f"{type(err).__name__}: {err}"
    except Exception:  # an exception whose message itself raises
        return type(err).__name__


def _digest(tenant, prompt) -> bytes:
    """One digest of a request's tenant and prompt: a quarantine never crosses tenants."""
    digest = hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int64).tobytes(), digest_size=16)
    digest.update(b"\0" + (repr(tenant).encode() if isinstance(tenant, str | bytes | None) else b"?"))
    return digest.digest()


class RequestQuarantine:
    """Requests that draft no more: those whose own work faulted, and later requests of the
    same tenant with the same prompt (the last `MAX_PROMPTS_QUARANTINED`, as digests). Costs
    nothing until some request faulted; after that, one digest per new request."""

    def __init__(self, max_prompts: int = MAX_PROMPTS_QUARANTINED):
        self.max_prompts = max_prompts
        self.requests: set[str] = set()  # live requests only (`forget`)
        self.prompts: OrderedDict[bytes, None] = OrderedDict()
        self._digests: dict[str, bytes] = {}  # live requests' prompt digests, once any prompt is quarantined

    @property
    def empty(self) -> bool:
        """Whether no request and no prompt is quarantined (then every request is allowed)."""
        return not self.requests and not self.prompts

    def allows(self, req_id: str, tenant_and_prompt: Callable[[], tuple]) -> bool:
        if req_id in self.requests:
            return False
        if not self.prompts:
            return True
        digest = self._digests.get(req_id)
        if digest is None:
            digest = self._digests[req_id] = _digest(*tenant_and_prompt())
        if digest in self.prompts:
            self.requests.add(req_id)
            return False
        return True

    def blame(self, req_id: str, tenant, prompt: np.ndarray) -> None:
        """Quarantine this request, and its prompt within its tenant."""
        self.requests.add(req_id)
        digest = self._digests[req_id] = _digest(tenant, prompt)
        self.prompts[digest] = None
        self.prompts.move_to_end(digest)
        while len(self.prompts) > self.max_prompts:
            self.prompts.popitem(last=False)

    def forget(self, req_id: str) -> None:
        self.requests.discard(req_id)
        self._digests.pop(req_id, None)


# What a fault point calls, if anything: set by the tests' fault injection only.
fault_hook: Callable[[str, np.ndarray | None], None] | None = None


def fault_point(stage: str, tokens: np.ndarray | None = None) -> None:
    """A place where a step may fault (`stage`; `tokens`: a row's, where the fault would be that
    request's own): the tests' hook may raise here."""
    if fault_hook is not None:
        fault_hook(stage, tokens)
