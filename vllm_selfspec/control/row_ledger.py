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
    _ahead: dict[str, float] = field(default_factory=dict)  # seconds ahead of the slackened pace

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
            self._ahead = {req_id: self._ahead[req_id] for req_id in accepted if req_id in self._ahead}
            return
        due = step.plain_seconds / (1 - self.slack)
        bounds = (-MOST_BEHIND * step.plain_seconds, MOST_AHEAD * step.plain_seconds)
        settle_rows = settled_by_arrays if len(step.req_ids) > FEW_ROWS else settled_by_rows
        self._ahead = settle_rows(self._ahead, step, accepted, due, bounds)

    def ahead(self, req_ids: list[str]) -> list[float]:
        """Per row, the seconds it is ahead of the slackened pace (negative: behind)."""
        return [self._ahead.get(req_id, 0.0) for req_id in req_ids]

    def room(self, req_ids: list[str], plain_seconds: float, planned_seconds: float) -> float:
        """How much longer than planned a step may grow for every one of these rows, crediting
        none of them a gain: the least any is ahead, plus the slack, less what the plan adds."""
        slack = plain_seconds * self.slack / (1 - self.slack)
        return min(self.ahead(req_ids)) + slack - (planned_seconds - plain_seconds)

    def forget(self, req_id: str) -> None:
        self._ahead.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._ahead)


# Up to this many rows a step's rows are settled one by one; past it, as arrays (whose NumPy calls
# cost more than a few rows' Python, and far less than hundreds of rows').
FEW_ROWS = 48


def settled_by_rows(ahead: dict, step: PlannedStep, accepted: dict, due: float, bounds: tuple) -> dict[str, float]:
    """Each row of `step` still in the batch (in `accepted`), credited what plain decoding would
    have spent on its tokens and charged the planned step, within `bounds`: the new ledger."""
    (low, high), planned, before = bounds, step.planned_seconds, ahead.get
    return {
        req_id: min(max(before(req_id, 0.0) + (1 + accepted[req_id]) * due - planned, low), high)
        for req_id in step.req_ids
        if req_id in accepted
    }


def settled_by_arrays(ahead: dict, step: PlannedStep, accepted: dict, due: float, bounds: tuple) -> dict[str, float]:
    """`settled_by_rows` as arrays, a row each, to the last bit."""
    rows = len(step.req_ids)
    tokens = np.fromiter(map(accepted.get, step.req_ids, repeat(-1)), dtype=np.int64, count=rows)
    before = np.fromiter(map(ahead.get, step.req_ids, repeat(0.0)), dtype=np.float64, count=rows)
    settled = np.minimum(np.maximum(before + (1 + tokens) * due - step.planned_seconds, bounds[0]), bounds[1])
    kept = tokens >= 0  # (the rows of the step still in the batch: accepted counts are never negative)
    req_ids = step.req_ids if kept.all() else [r for r, k in zip(step.req_ids, kept.tolist()) if k]
    return dict(zip(req_ids, settled[kept].tolist()))
