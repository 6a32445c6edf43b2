# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Each row's time against plain decoding's over its life so far: the per-row rule's memory.

The per-row rule (`planner`) holds each step to what it expects, but a request is timed over
its whole life. After each planned step the ledger credits every row what plain decoding would
have spent on the tokens it got, (1 + accepted) plain steps over 1 - slack, and charges it the
planned step. A row ahead of that pace may then let the step grow for its neighbours' drafts
in a step where it has none of its own (an edit that departs from the text it follows, after
many steps of following it); a row behind it, whose drafts fared worse than estimated or whose
estimate was a batch-wide one, allows that much less until it has caught up. What a row may
carry either way is bounded, so that one long request cannot stretch a step without limit and
one bad step cannot stop every neighbour's drafts for long. Kept only for the rows of the last
planned step: bounded by the batch, and nothing outlives its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

import numpy as np

MOST_AHEAD = 8.0  # plain steps a row may carry ahead of plain decoding's pace
MOST_BEHIND = 0.25  # ... and behind it (it makes that up at the slack a step, blocking drafts)


class PlannedStep(NamedTuple):
    """What the planner expected of a step: its rows, and plain's and the plan's seconds."""

    req_ids: tuple[str, ...]
    plain_seconds: float
    planned_seconds: float


@dataclass
class RowLedger:
    slack: float  # the share of plain's rate a row may lose (`planner.ROW_SLACK`)
    planned: PlannedStep | None = None
    # The rows of the last settled step and the seconds each is ahead of the slackened pace
    # (negative: behind), in order: a step's rows are mostly the last step's, in the same order,
    # and then it reads and settles them with no lookup per row (as arrays, past a few rows).
    _req_ids: tuple[str, ...] = ()
    _ahead: list[float] = field(default_factory=list)
    _position: dict[str, int] | None = None  # req_id -> its place in `_req_ids`, made when asked

    def plan_made(self, step: PlannedStep | None) -> None:
        """The step about to run (None: one the per-row rule does not cover)."""
        self.planned = step

    def settle(self, accepted: dict[str, int] | None) -> None:
        """The step ran and was verified: tokens accepted per row of it, every row (None: what
        ran was not what was planned, so nothing is settled). A step the rule did not plan (one
        that drafted nothing while prompts wait) leaves the rows as they were."""
        step, self.planned = self.planned, None
        if accepted is None:
            return
        if step is None:
            kept = tuple(r for r in accepted if r in self._places())
            self._keep(kept, self.ahead(kept))
            return
        due = step.plain_seconds / (1 - self.slack)
        low, high = -MOST_BEHIND * step.plain_seconds, MOST_AHEAD * step.plain_seconds
        req_ids, rows, planned = step.req_ids, len(step.req_ids), step.planned_seconds
        if rows <= FEW_ROWS:  # (a few rows cost less one by one than in NumPy's calls)
            tokens_of, kept, settled = accepted.get, [], []
            for req_id, before in zip(req_ids, self.ahead(req_ids)):
                tokens = tokens_of(req_id, -1)  # (-1: gone from the batch; accepted counts are never negative)
                if tokens >= 0:
                    kept.append(req_id)
                    settled.append(min(max(before + (1 + tokens) * due - planned, low), high))
            self._keep(req_ids if len(kept) == rows else tuple(kept), settled)
            return
        if tuple(accepted) == req_ids:  # (every row still in the batch, in order: most steps)
            tokens = np.fromiter(accepted.values(), dtype=np.int64, count=rows)
        else:
            tokens = np.fromiter(map(accepted.get, req_ids, repeat(-1)), dtype=np.int64, count=rows)
        # (in the order the rows' Python above computes each: the same bits)
        before = np.array(self.ahead(req_ids), dtype=np.float64)
        settled = np.minimum(np.maximum(before + (1 + tokens) * due - planned, low), high)
        kept = tokens >= 0
        if np.count_nonzero(kept) == rows:
            self._keep(req_ids, settled.tolist())
        else:
            self._keep(tuple(r for r, k in zip(req_ids, kept.tolist()) if k), settled[kept].tolist())

    def ahead(self, req_ids) -> list[float]:
        """Per row, the seconds it is ahead of the slackened pace (negative: behind; 0 for a
        row the ledger does not hold)."""
        if req_ids == self._req_ids or tuple(req_ids) == self._req_ids:
            return self._ahead[:]  # (the ledger's own stays its own)
        places, ahead = self._places(), self._ahead
        return [ahead[places[r]] if r in places else 0.0 for r in req_ids]

    def ahead_of(self, req_ids) -> np.ndarray:
        """`ahead`, as an array."""
        return np.array(self.ahead(req_ids), dtype=np.float64)

    def room(self, req_ids: list[str], plain_seconds: float, planned_seconds: float) -> float:
        """How much longer than planned a step may grow for every one of these rows, crediting
        none of them a gain: the least any is ahead, plus the slack, less what the plan adds."""
        slack = plain_seconds * self.slack / (1 - self.slack)
        return min(self.ahead(req_ids)) + slack - (planned_seconds - plain_seconds)

    def forget(self, req_id: str) -> None:
        place = self._places().get(req_id)
        if place is not None:
            self._keep(
                self._req_ids[:place] + self._req_ids[place + 1 :], self._ahead[:place] + self._ahead[place + 1 :]
            )

    def entries(self) -> dict[str, float]:
        """Each row held and the seconds it is ahead."""
        return dict(zip(self._req_ids, self._ahead))

    def _keep(self, req_ids: tuple[str, ...], ahead: list[float]) -> None:
        self._req_ids, self._ahead, self._position = req_ids, ahead, None

    def _places(self) -> dict[str, int]:
        if self._position is None:
            self._position = {r: i for i, r in enumerate(self._req_ids)}
        return self._position

    def __len__(self) -> int:
        return len(self._req_ids)


# Up to this many rows a step's rows are settled one by one; past it, as arrays (whose NumPy calls
# cost more than a few rows' Python, and far less than hundreds of rows').
FEW_ROWS = 48
