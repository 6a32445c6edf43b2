"""Whether a request's end is followed by a new prompt, in a server: pure bookkeeping, no vLLM.

A client that holds a number of requests in flight sends its next prompt the moment one ends,
and that prompt waits for the step in progress; so after an end the planner keeps the next steps
close to plain decoding's. Where nobody refills the slot (the last requests of a run, arrivals
that do not follow departures) that cap only costs drafts, and the light-load case it then caps
is the one drafting pays most in. So the cap applies only while most recent ends were refilled.
"""

from __future__ import annotations

from dataclasses import dataclass

# An end in step t: its client's next prompt arrives during step t + 1 and is admitted by step
# t + 2's schedule, which the proposer sees after that step, or one step later if the scheduler
# could not take it at once.
REFILL_WINDOW_STEPS = 3
REFILL_WEIGHT = 0.3  # of the latest end in the running share of ends refilled
EXPECT_REFILL_ABOVE = 0.5


@dataclass
class Refills:
    """The running share of request ends followed by an admission within REFILL_WINDOW_STEPS.
    It starts at 1 (every end refilled), so a server caps until it has seen otherwise."""

    share: float = 1.0
    _window: int = 0  # steps left for the latest end to be refilled; 0: no end pending

    def observe(self, *, ended: bool, admitted: bool) -> None:
        """One step as the proposer saw it: did a request end with it, did it admit one?"""
        if self._window:
            if admitted:
                self._record(refilled=True)
            elif self._window == 1:
                self._record(refilled=False)
            else:
                self._window -= 1
        if ended:
            self._window = REFILL_WINDOW_STEPS

    @property
    def expected(self) -> bool:
        """Whether a request's end is likely to bring a prompt that waits for the next steps."""
        return self.share > EXPECT_REFILL_ABOVE

    def _record(self, *, refilled: bool) -> None:
        self.share += REFILL_WEIGHT * (float(refilled) - self.share)
        self._window = 0
