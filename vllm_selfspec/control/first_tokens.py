# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""First tokens as early as plain decoding's.

A prompt's first token comes out of the step that prefills it, so drafts verified in that step
delay it by their verification. Two rules keep it on time in a server (offline batches keep
their drafts: there a first token is worth nothing before the batch's end):
- the scheduler withholds the running requests' drafts in a step about to prefill
  (`vllm_integration.scheduler_queue`, which reads vLLM's queue);
- the worker, which plans the next step's drafts before the scheduler has run it, plans none
  when a prompt waits that the scheduler can admit, and keeps the step close to plain's when a
  request has just ended and its client's next prompt is likely to arrive (`FirstTokenPolicy`,
  with `Refills`; the planner's cap is `control.planner`).

What the scheduler tells the workers comes as one `scheduler_note.SchedulerNote`. Pure: no vLLM.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from vllm_selfspec.scheduler_note import SchedulerNote


class FirstTokens(enum.Enum):
    """Whether a new prompt will wait for the next step."""

    NONE_WAIT = "none wait"
    QUEUED = "queued"  # the scheduler withholds the step's drafts: make none
    EXPECTED = "expected"  # the step may be at most the planner's first-token slack longer than plain's


# Steps without a request admitted after which a closed batch counts as draining: a row that
# finishes early frees a slot nobody takes (`control.planner`). In a server nobody waits for a
# batch's end, so every step is planned for tokens per second.
DRAIN_AFTER_STEPS = 4


@dataclass
class FirstTokenPolicy:
    """The worker's side: each step, whether a new prompt will wait for the next one."""

    refills: Refills = field(default_factory=lambda: Refills())
    requests_ended: int = 0  # in the step before the last one seen
    steps_since_admission: int = 0
    closed_batches: bool = False

    def next_step(
        self, *, step: int, note: SchedulerNote, ended: int, admitted: int, engine_was_busy: bool
    ) -> FirstTokens:
        """Step number `step` (counted by the steps the runner began, so that a step vLLM ran
        without asking for drafts still counts against an end's window) ended `ended` requests
        and admitted `admitted`. A prompt waits if the scheduler says one is admissible, or is
        expected if a request ended with this step or the one before and ends have lately been
        followed by prompts."""
        self.closed_batches = note.closed_batches
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
        ended_before, self.requests_ended = self.requests_ended, ended
        if note.closed_batches:
            return FirstTokens.NONE_WAIT
        self.refills.observe(step=step, ended=ended, admitted=admitted, engine_was_busy=engine_was_busy)
        if note.waiting_requests:
            return FirstTokens.QUEUED
        recent_end = ended_before or ended
        return FirstTokens.EXPECTED if recent_end and self.refills.expected else FirstTokens.NONE_WAIT

    @property
    def draining(self) -> bool:
        """A closed batch that has admitted nobody for a while: it is running down."""
        return self.closed_batches and self.steps_since_admission > DRAIN_AFTER_STEPS


# Whether a request's end is followed by a new prompt. A client that holds a number of requests
# in flight sends its next prompt the moment one ends, and that prompt waits for the step in
# progress; so after an end the planner keeps the next steps close to plain decoding's. Where
# nobody refills the slot (the last requests of a run, arrivals that do not follow departures)
# that cap only costs drafts, and the light-load case it then caps is the one drafting pays most
# in. So the cap applies only while most recent ends were refilled.
#
# An end in step t: its client's next prompt arrives during step t + 1 and is admitted by step
# t + 2's schedule, or by t + 3's if the scheduler could not take it at once. Later admissions
# are arrivals of their own.
REFILL_WINDOW_STEPS = 3
# The share moves this far towards each end's outcome, so that from a server whose ends were
# all refilled, two unrefilled ends in a row lift the cap (1 -> 0.7 -> 0.49) and, after those
# two, one refill restores it (0.49 -> 0.64).
REFILL_WEIGHT = 0.3
EXPECT_REFILL_ABOVE = 0.5


@dataclass
class Refills:
    """The running share of request ends followed by an admission within REFILL_WINDOW_STEPS.
    It starts at 1 (every end refilled): a server caps until it has seen otherwise."""

    share: float = 1.0
    # The last step each end still waiting for a new prompt can be refilled in, oldest first
    # (the ends of at most REFILL_WINDOW_STEPS + 1 steps, each no more than a step's rows).
    _pending: deque[int] = field(default_factory=deque)

    def observe(self, *, step: int, ended: int, admitted: int, engine_was_busy: bool) -> None:
        """Step number `step`: how many requests ended with it, how many it took in, and
        whether a request ran on from the step before."""
        while self._pending and self._pending[0] < step:
            self._outcome(refilled=False)
        if admitted and not engine_was_busy:
            # A prompt admitted into an idle engine waited for no step: the cap bought nothing.
            while self._pending:
                self._outcome(refilled=False)
        for _ in range(min(admitted, len(self._pending))):
            self._outcome(refilled=True)
        self._pending.extend([step + REFILL_WINDOW_STEPS] * ended)

    @property
    def expected(self) -> bool:
        """Whether a request's end is likely to bring a prompt that waits for the next steps."""
        return self.share > EXPECT_REFILL_ABOVE

    def _outcome(self, *, refilled: bool) -> None:
        """The oldest pending end was refilled, or its time ran out."""
        self._pending.popleft()
        self.share += REFILL_WEIGHT * (float(refilled) - self.share)
