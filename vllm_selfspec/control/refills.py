"""Whether a request's end is followed by a new prompt, in a server: pure bookkeeping, no vLLM.

A client that holds a number of requests in flight sends its next prompt the moment one ends,
and that prompt waits for the step in progress; so after an end the planner keeps the next steps
close to plain decoding's. Where nobody refills the slot (the last requests of a run, arrivals
that do not follow departures) that cap only costs drafts, and the light-load case it then caps
is the one drafting pays most in. So the cap applies only while most recent ends were refilled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
        """Step number `step` as the proposer saw it: how many requests ended with it, how many
        it took in, and whether a request ran on from the step before."""
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
