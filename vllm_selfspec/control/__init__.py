# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""How much to draft, from measured costs and acceptance: pure arithmetic, no vLLM.

Four parts, each unit-tested in tests/test_controller.py:
- `step_costs`: what a target step, a self-draft step and a probe cost (fitted online);
- `acceptance`: how likely a draft token is to be accepted (per source, request, lookup bin);
- `planner`: from both, how many tokens each row drafts this step, and from which source,
  keeping each row's time against plain's in its `row_ledger`;
- `lookup_gate`: whether looking up, paid every step before any plan, saves what it costs.

`DraftController` holds the four for the proposer, which tells it what happened
(`observe_*`) and asks it, each step, for a `DraftPlan` of the step's `offers` (what each row
can draft, as arrays over the rows). Beside them, what feeds them and when:
- `learning`: what a step taught once it ran (its time, each row's accepted draft tokens);
- `first_tokens`: the worker's first-token rule (no drafts while a prompt waits for the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_selfspec.control.acceptance import AcceptanceModel, AcceptanceRate, Calibration, DraftSource, StepGains
from vllm_selfspec.control.lookup_gate import LookupGate
from vllm_selfspec.control.offers import RowOffer, StepOffers
from vllm_selfspec.control.planner import DraftPlan, DraftPlanner
from vllm_selfspec.control.step_costs import StepCostModel

__all__ = [
    "AcceptanceRate",
    "Calibration",
    "DraftController",
    "DraftPlan",
    "DraftSource",
    "RowOffer",
    "StepGains",
    "StepOffers",
]


@dataclass
class DraftController:
    costs: StepCostModel = field(default_factory=StepCostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    lookup_gate: LookupGate = field(default_factory=LookupGate)
    planner: DraftPlanner = field(init=False)

    def __post_init__(self):
        self.planner = DraftPlanner(self.costs, self.acceptance)

    # What happened.
    def observe_step(self, *args, **kwargs) -> None:
        """What a target step computed, and its seconds (`StepCostModel.observe_step`)."""
        self.costs.observe_step(*args, **kwargs)

    def observe_self_step(self, rows: int, seconds: float) -> None:
        self.costs.observe_self_step(rows, seconds)

    def observe_probe(self, rows: int, seconds: float, *, provisional: bool = False) -> None:
        self.costs.observe_probe(rows, seconds, provisional=provisional)

    def observe_draft(self, req_id: str, source: str, drafted: int, accepted: int, *learned) -> None:
        """`AcceptanceModel.observe_draft`; `learned`: its calibration and estimate, if any."""
        self.acceptance.observe_draft(req_id, source, drafted, accepted, *learned)

    def learn_drafts(self, made, order, scheduled, sampled):
        """What verification made of a step's drafts (`AcceptanceModel.learn`)."""
        return self.acceptance.learn(made, order, scheduled, sampled)

    def observe_lookup(self, rows: int, seconds: float) -> None:
        self.lookup_gate.observe_lookup(rows, seconds)

    def observe_lookup_accepted(self, tokens: int) -> None:
        self.lookup_gate.observe_accepted(tokens)

    def observe_rows(self, accepted: dict[str, int] | None) -> None:
        """Every row of the step that ran and the draft tokens it accepted (None: not the step
        last planned), for the per-row rule's ledger (`row_ledger`)."""
        self.planner.ledger.settle(accepted)

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
        self.planner.ledger.forget(req_id)

    # What to do.
    def plan(self, offers: StepOffers | list[RowOffer], self_budget: int, **when) -> DraftPlan:
        """`DraftPlanner.plan` (of a step's offers, or of each row's); `when`: `draining`,
        `prompts_waiting` and `gains`, by name."""
        offers = offers if isinstance(offers, StepOffers) else StepOffers.of(offers)
        return self.planner.plan(offers, self_budget, **when)

    def look_up_next(self, rows: int) -> bool:
        """Whether to look up next step, for a batch of `rows` (`lookup_gate`)."""
        if not self.costs.ready or rows == 0:
            return self.lookup_gate.open(None)
        step = self.costs.target()
        return self.lookup_gate.open(step.t0 / rows + step.t_row)

    def calibration(self, offer: RowOffer, length: int | None = None) -> Calibration:
        return self.acceptance.calibration(offer, length)
