# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""How many tokens each row drafts this step, and from which source: draft only what pays.

Each draft token at depth j of a source accepted with probability a adds a**j expected tokens
for its row's price per logit row; the greedy plan takes the best gain per second while it
beats the step's rate by DRAFT_MARGIN, then is held to the per-row rule (`RowProtection`,
`keep_every_row_due`) unless the objective is the batch's throughput. Draining batches plan to
a common finish line (`draining_choice`); self-drafting is retried on a back-off. The whole
argument, with its arithmetic, is in docs/design.md ("Cost controller", "The planner's
arithmetic").
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllm_selfspec.control.acceptance import AcceptanceModel, StepGains
from vllm_selfspec.control.backoff import FIRST_RETRY_AFTER, Backoff
from vllm_selfspec.control.draining_plan import finish_lines
from vllm_selfspec.control.lookup_plan import NO_DUE, greedy_lookup_plan, steady_lookup_plan
from vllm_selfspec.control.offers import RowOffer, StepOffers
from vllm_selfspec.control.row_ledger import PlannedStep, RowLedger
from vllm_selfspec.control.step_costs import StepCostModel

DRAFT_MARGIN = 0.2  # a draft token's gain per second must beat the step's rate by this share
FIRST_TOKEN_SLACK = 0.05  # how much longer than plain's a step a new prompt waits for may be
ROW_SLACK = 0.02  # how much below plain decoding's rate the plan may leave any row
__all__ = ["FIRST_RETRY_AFTER", "DraftPlan", "DraftPlanner", "RowOffer", "StepOffers"]


@dataclass
class DraftPlan:
    lookup_lengths: list[int]  # per offer (0 for rows that do not take a lookup draft)
    self_length: int  # draft steps for the self-draft rows
    explored: bool = False  # a retry of self-drafting
    self_rows: list[bool] = field(default_factory=list)  # per offer: drafts with the model if any

    @staticmethod
    def everything(offers: StepOffers, self_budget: int) -> DraftPlan:
        """Every lookup draft whole, self-drafts of the full budget where lookup has none."""
        self_rows = offers.can_self_draft & (offers.lookup_tokens == 0)
        return DraftPlan(offers.lookup_tokens.tolist(), self_budget, False, self_rows.tolist())

    @staticmethod
    def nothing(rows: int) -> DraftPlan:
        return DraftPlan([0] * rows, 0, False, [False] * rows)

    def as_ints(self) -> list[int]:
        """Flat, for sending between ranks (`from_ints`)."""
        return [self.self_length, int(self.explored), *self.lookup_lengths, *map(int, self.self_rows)]

    @staticmethod
    def from_ints(values: list[int], rows: int) -> DraftPlan:
        return DraftPlan(list(values[2 : 2 + rows]), values[0], bool(values[1]), [bool(x) for x in values[2 + rows :]])


@dataclass
class Choice:
    """A plan under construction: its drafts, the tokens a step with them is expected to yield,
    its expected seconds, and the seconds self-drafting could save at best."""

    lookup_lengths: list[int]
    self_length: int = 0
    self_rows: set[int] = field(default_factory=set)
    tokens: float = 0.0
    seconds: float = 1.0
    best_self_saving: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def beats(self, plain: Choice) -> bool:
        """Whether the tokens this plan adds to plain decoding's come faster than plain
        decoding's own, by the margin."""
        added_seconds = self.seconds - plain.seconds
        return self.tokens > plain.tokens and (
            added_seconds <= 0 or beats_by_margin((self.tokens - plain.tokens) / added_seconds, plain.rate)
        )


@dataclass(frozen=True)
class RowDue:
    """What the per-row rule needs beyond the plan: plain's step and verification's seconds,
    and per row whether its estimate is trusted and the seconds it is ahead of its pace."""

    t_plain: float
    t_verify: float
    trusted: np.ndarray  # bool
    ahead: np.ndarray  # float64


class StepLayout(NamedTuple):
    """What a plan starts from (`DraftPlanner.lay_out`): each row's seconds per draft token and
    plain decoding's step; the rows that would rather self-draft, their prices and tokens left
    summed; whether any row offers a lookup draft; and the steady plan of lookup drafts alone,
    if made (`lookup_plan`: NOT_MADE, MADE, or EVERY_TOKEN_BINDS, which is plain's)."""

    cost: np.ndarray
    plain_seconds: float
    self_rows: np.ndarray  # bool
    self_cost: float
    self_left: float
    offered: bool
    lookup_plan: int
    lookup_lengths: np.ndarray  # int64
    lookup_tokens: float
    lookup_seconds: float


NOT_MADE, MADE, EVERY_TOKEN_BINDS = 0, 1, 2
# The per-row rule's inputs where it does not apply (the kernel's one signature).
NO_RULE = (
    False, np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int64),
    np.zeros(0, dtype=np.int64), 0, 0, np.zeros(0),
)  # fmt: skip


class RowProtection:
    """The per-row rule (module docstring, "Every row protected") over a plan: each row's own
    draft seconds and credited gain, and which rows the plan's step would leave below
    (1 - ROW_SLACK) of plain's rate. It is applied to the whole greedy plan
    (`keep_every_row_due`), not token by token as the plan grows: then the first token would
    be refused for the rows whose drafts come later."""

    def __init__(self, due: RowDue):
        self.t_plain, self.t_verify = due.t_plain, due.t_verify
        self.trusted, self.ahead = due.trusted.tolist(), due.ahead.tolist()  # (read per token)
        self.drafted = [0] * len(due.trusted)  # tokens: exact, where seconds given back leave rounding
        self.own = [0.0] * len(due.trusted)
        self.credited = [0.0] * len(due.trusted)
        # Each row's allowance, kept up to date by take(): the give-back asks for them often.
        self.allowances = [self._allowance(i) for i in range(len(due.trusted))]

    def _allowance(self, i: int) -> float:
        """How much longer than plain's the step may be for row i."""
        extra = allowed_without_drafts(self.t_plain, self.credited[i], self.ahead[i])
        return extra + (self.own[i] + self.t_verify if self.drafted[i] else 0.0)

    def allowance(self, i: int) -> float:
        return self.allowances[i]

    def binding(self, added: float) -> set[int]:
        """The rows a step `added` seconds longer than plain's would not leave their due."""
        return {i for i, allowed in enumerate(self.allowances) if added > allowed}

    def binds(self, rows: list[int], added: float) -> bool:
        """Whether a step `added` seconds longer than plain's would leave any of `rows` short."""
        return any(added > self.allowances[i] for i in rows)

    def a_binding_row(self, added: float, hint: int | None) -> int | None:
        """A row a step `added` seconds longer than plain's would not leave its due, `hint`
        first (the last found: it mostly still binds); None if there is none. Asked once a
        token given back, so it stops at the first it finds."""
        if hint is not None and added > self.allowances[hint]:
            return hint
        if added <= min(self.allowances, default=math.inf):
            return None
        return next((i for i, allowed in enumerate(self.allowances) if added > allowed), None)

    def allowance_without(self, i: int, gain: float) -> float:
        """How much longer than plain's the step may be for row i once it gives back its
        deepest draft token (worth `gain`), before the step sheds that token's seconds."""
        return (
            self.allowances[i]
            - self.t_plain * gain * self.trusted[i] / (1 - ROW_SLACK)
            - self.t_verify * (self.drafted[i] == 1)
        )

    def due_without(self, rows: list[int], gains: list[float], added: float) -> bool:
        """Whether these rows, each giving back a draft token (and the step its seconds), would
        still be left their due by a step `added` seconds longer than plain's, before it."""
        return all(self.allowance_without(i, gain) >= added for i, gain in zip(rows, gains))

    def take(self, rows: list[int], seconds_each: float, gains: list[float], sign: int = 1) -> None:
        """Rows take one more draft token each (`sign` -1: give it back)."""
        for i, gain in zip(rows, gains):
            self.drafted[i] += sign
            self.own[i] += sign * seconds_each
            self.credited[i] += sign * gain * self.trusted[i]
            self.allowances[i] = self._allowance(i)


@dataclass
class DraftPlanner:
    costs: StepCostModel
    acceptance: AcceptanceModel
    retries: Backoff = field(default_factory=Backoff)  # of self-drafts, while none is made
    protect_rows: bool = True  # the per-row rule; False: the batch's throughput (objective)
    ledger: RowLedger = field(default_factory=lambda: RowLedger(ROW_SLACK))
    # Plans of lookup drafts alone by the compiled kernel (`lookup_plan`); False: token by token
    # in Python, as plans with self-drafts are made (the kernel's reference, in the tests).
    compiled_lookup_plan: bool = True

    def plan(
        self,
        offers: StepOffers,
        self_budget: int,
        draining: bool = False,
        prompts_waiting: bool = False,
        gains: StepGains | None = None,
    ) -> DraftPlan:
        """Draft lengths for one step over these rows (every row that sampled a token);
        `draining`: no request admitted lately, so only the batch's end counts;
        `prompts_waiting`: a new prompt will wait for this step, which may then be at most
        FIRST_TOKEN_SLACK longer than plain decoding's (and retries wait); `gains`: the
        offers' lookup gains (`AcceptanceModel.step_gains`), if made already."""
        self.ledger.plan_made(None)
        if not self.costs.ready:  # learn the step cost first, with the drafts that cost nothing
            return DraftPlan(offers.lookup_tokens.tolist(), 0, False, [False] * len(offers))
        step = self.costs.target()
        step_gains = self.acceptance.step_gains(offers) if gains is None else gains
        gains = step_gains.planned
        steady = not draining or len(offers) == 1  # (one row's end is the batch's: the steady plan is that)
        laid = self.lay_out(offers, step_gains, step, prompts_waiting, steady)
        plain_seconds = laid.plain_seconds
        self_rows = laid.self_rows.nonzero()[0].tolist()  # (np.flatnonzero: a Python wrapper round this)
        if not steady:
            choice = draining_choice(offers, gains, laid.cost, step, self_budget, self.acceptance.self_rate, self.costs)
            # At best (every token accepted) a self-draft over these rows saves a step per draft
            # step, on up to K/(K+1) of the steps left to the batch's end.
            self_step = self.costs.self_step_seconds(len(self_rows))
            choice.best_self_saving = (step.t0 - self_step - step.t_verify) * float(offers.remaining.max(initial=0.0))
        else:
            choice = self._steady(offers, step_gains, laid, step.t_verify, self_rows, self_budget, prompts_waiting)
        explored = False
        if self_rows and choice.self_length == 0 and self_budget and not prompts_waiting:
            # (a retry credits no row: its acceptance is what it measures)
            protected = self.protect_rows and len(offers) > 1 and not draining
            room = lambda: self.ledger.room(offers.req_ids, plain_seconds, choice.seconds)  # noqa: E731
            explored = self.retries.due() and make_retry(
                self.costs, offers, self_rows, choice, self_budget, laid.cost, step, room=room if protected else None
            )
            if explored:
                self.retries.retried()
        elif choice.self_length > 0:
            self.retries.in_use()
        if not draining or len(offers) == 1:
            self.ledger.plan_made(PlannedStep(tuple(offers.req_ids), plain_seconds, choice.seconds))
        chosen = choice.self_rows
        self_rows = [i in chosen for i in range(len(offers))] if chosen else [False] * len(offers)
        return DraftPlan(choice.lookup_lengths, choice.self_length, explored, self_rows)

    def _steady(self, offers, step_gains, laid: StepLayout, t_verify, self_rows, self_budget, prompts_waiting):
        """The plan with the most tokens per second (a `Choice`): lookup only (`laid`), or
        self-drafts for `self_rows` with lookup for the rest (so a row that self-drafting does
        not pay for keeps its lookup draft); no longer than plain's by more than
        FIRST_TOKEN_SLACK if `prompts_waiting`."""
        plain = Choice([0] * len(offers), tokens=float(len(offers)), seconds=laid.plain_seconds)
        if not self_rows and not laid.offered:
            return plain  # (nothing offered: the plan below would come to plain's, at a cost per row)
        max_seconds = plain.seconds * (1 + FIRST_TOKEN_SLACK) if prompts_waiting else math.inf
        self_token_cost = laid.self_cost + self.costs.self_step_seconds(len(self_rows))
        # Any draft pays t_verify once: take the best tokens at the rate that leaves, then keep
        # the plan only if it beats plain decoding.
        verifying = (plain.tokens, plain.seconds + t_verify)
        self_may_pay = bool(
            self_rows
            and self.costs.self_step_measured
            and self_budget
            and self_draft_may_pay(len(self_rows) * self.acceptance.self_rate, self_token_cost, verifying)
        )
        best, gains = plain, step_gains.planned
        if laid.lookup_plan == MADE:
            best = Choice(laid.lookup_lengths.tolist(), tokens=laid.lookup_tokens, seconds=laid.lookup_seconds)
        if self_may_pay:  # (a row by row path: self-draft tokens span rows)
            cost, protected = laid.cost.tolist(), None
            if self.protect_rows and len(offers) > 1:
                trusted = self.acceptance.trusted_rows(offers, step_gains)
                protected = row_due(self.ledger, trusted, offers, plain.seconds, t_verify)
            if laid.lookup_plan == NOT_MADE and not (protected and every_lookup_token_binds(protected, offers, cost)):
                best = self._greedy(offers, gains, cost, verifying, max_seconds=max_seconds, protected=protected)
            with_self = self._greedy(
                offers, gains, cost, verifying, self_rows, self_budget, self_token_cost, max_seconds, protected
            )
            without_self = max(best, plain, key=lambda c: c.rate)
            unpaid = unpaid_probes(self.costs, offers, self_rows, without_self, with_self)
            if unpaid:  # plan again without them (they may still take their lookup drafts)
                kept = [i for i in self_rows if i not in unpaid]
                kept_cost = self_token_seconds(self.costs, cost, kept)
                with_self = (
                    self._greedy(offers, gains, cost, verifying, kept, self_budget, kept_cost, max_seconds, protected)
                    if kept
                    else best
                )
            if with_self.self_length and with_self.rate > best.rate:
                best = with_self
        if not best.beats(plain):
            best = plain
        # The retries' best case stays over every row that would rather self-draft: a retry
        # prices its own probe (retry_pays).
        # At best each self-draft token costs self_token_cost / m, not the plan's seconds per token.
        per_token = best.seconds / best.tokens - self_token_cost / max(len(self_rows), 1)
        best.best_self_saving = per_token * laid.self_left
        return best

    def lay_out(self, offers: StepOffers, step_gains: StepGains, step, prompts_waiting: bool, plan: bool) -> StepLayout:
        """What a plan starts from (`StepLayout`), in one compiled call; with the steady plan of
        lookup drafts alone if `plan`. (In Python, token by token, if not `compiled_lookup_plan`.)"""
        lay_out_by = lay_out_compiled if self.compiled_lookup_plan else lay_out_in_python
        return lay_out_by(self, offers, step_gains, step, prompts_waiting, plan)

    def _greedy(
        self,
        offers,
        gains,
        cost,
        start,
        self_rows=(),
        self_budget=0,
        self_token_cost=0.0,
        max_seconds=math.inf,
        protected=None,
    ) -> Choice:
        """Add draft tokens, best gain per second first, while each beats the step's rate so far
        by the margin, the step stays within `max_seconds`, and (`protected`) every row keeps its
        due (`RowProtection`). A token that does not fit is left, with the deeper tokens of its
        row."""
        if not self_rows and self.compiled_lookup_plan:
            return compiled_lookup_choice(offers, gains, cost, start, max_seconds, protected)
        offers = offers.rows  # (token by token, row by row)
        tokens, seconds = start
        protection = RowProtection(protected) if protected else None
        choice = Choice([0] * len(offers), self_rows=set(self_rows))
        taken = []  # (gain per second, kind, rows, seconds each, gain each) per token taken
        # Candidates: (-ratio, kind, row, depth). Within a source the ratio falls with depth,
        # so a row's next token is queued only once its last is taken.
        candidates = [
            (-gains[i][0] / cost[i], "lookup", i, 1)
            for i, offer in enumerate(offers)
            if offer.lookup_tokens and i not in self_rows
        ]
        a_self, m = self.acceptance.self_rate, len(self_rows)
        if self_rows and self_budget:
            candidates.append((-m * a_self / self_token_cost, "self", -1, 1))
        heapq.heapify(candidates)
        while candidates and beats_by_margin(-candidates[0][0], tokens / seconds):
            ratio, kind, i, depth = heapq.heappop(candidates)
            if seconds + (cost[i] if kind == "lookup" else self_token_cost) > max_seconds:
                continue
            if kind == "lookup":
                choice.lookup_lengths[i] = depth
                taken.append((-ratio, "lookup", [i], cost[i], [gains[i][depth - 1]]))
                if depth < offers[i].lookup_tokens:
                    heapq.heappush(candidates, (-gains[i][depth] / cost[i], "lookup", i, depth + 1))
            else:
                choice.self_length = depth
                taken.append((-ratio, "self", sorted(self_rows), self_token_cost / m, [a_self**depth] * m))
                if depth < self_budget:
                    heapq.heappush(candidates, (-m * a_self ** (depth + 1) / self_token_cost, "self", -1, depth + 1))
            _, _, rows, each, gained = taken[-1]
            tokens, seconds = tokens + sum(gained), seconds + each * len(rows)
        if protection is not None:
            tokens, seconds = keep_every_row_due(
                protection,
                choice,
                taken,
                totals=(tokens, seconds),
                priced=(offers, gains, cost),
                plain_rate=start[0] / start[1],
                max_seconds=max_seconds,
            )
        if not choice.self_length:
            choice.self_rows = set()
        choice.tokens, choice.seconds = tokens, seconds
        return choice


def lay_out_compiled(planner: DraftPlanner, offers, step_gains, step, prompts_waiting: bool, plan: bool) -> StepLayout:
    """`DraftPlanner.lay_out` by one call of the compiled kernel (`lookup_plan.steady_lookup_plan`)."""
    # (the rule's inputs are read only where some row offers a draft: the kernel plans only then)
    protect = plan and planner.protect_rows and len(offers) > 1 and np.count_nonzero(offers.lookup_tokens) > 0
    if protect:
        ahead = np.array(planner.ledger.ahead(offers.req_ids), dtype=np.float64)
        rule = (True, *planner.acceptance.trust_rule(offers, step_gains), ahead)
    else:
        rule = NO_RULE
    laid = steady_lookup_plan(
        (
            offers.lookup_tokens, offers.sampled, offers.context, offers.can_self_draft, offers.has_mask,
            offers.remaining, offers.sources,
        ),
        step_gains.planned,
        (step.t0, step.t_row, step.t_sampled, step.t_context, step.t_verify),
        (planner.acceptance.self_rate, planner.costs.self_step_measured, prompts_waiting, plan),
        (DRAFT_MARGIN, ROW_SLACK, FIRST_TOKEN_SLACK),
        rule,
    )  # fmt: skip
    return StepLayout(*laid)


def lay_out_in_python(planner: DraftPlanner, offers, step_gains, step, prompts_waiting: bool, plan: bool) -> StepLayout:
    """`DraftPlanner.lay_out` row by row and token by token: the compiled kernel's reference."""
    cost = np.maximum(step.t_row + step.t_sampled * offers.sampled + step.t_context * offers.context / 1000, 1e-9)
    prices, gains = cost.tolist(), step_gains.planned
    plain_seconds = step.t0 + in_order(prices)
    # Rows that would rather self-draft: no lookup draft, or a first lookup token less likely
    # than a self-draft's.
    rather_self = offers.lookup_tokens == 0
    if planner.costs.self_step_measured:
        rather_self |= gains[:, 0] < planner.acceptance.self_rate
    if prompts_waiting:  # a probe costs a few target steps, past any slack: measured rows only
        rather_self &= offers.has_mask
    self_mask = offers.can_self_draft & rather_self
    self_rows = np.flatnonzero(self_mask).tolist()
    self_cost, self_left = in_order(prices[i] for i in self_rows), in_order(offers.remaining[self_rows].tolist())
    offered = bool(offers.lookup_tokens.any())
    nothing = np.zeros(0, dtype=np.int64)
    laid = StepLayout(cost, plain_seconds, self_mask, self_cost, self_left, offered, NOT_MADE, nothing, 0.0, 0.0)
    if not (plan and offered):
        return laid
    max_seconds = plain_seconds * (1 + FIRST_TOKEN_SLACK) if prompts_waiting else math.inf
    protected = None
    if planner.protect_rows and len(offers) > 1:
        trusted = planner.acceptance.trusted_rows(offers, step_gains)
        protected = row_due(planner.ledger, trusted, offers, plain_seconds, step.t_verify)
        if every_lookup_token_binds(protected, offers, prices):
            return laid._replace(lookup_plan=EVERY_TOKEN_BINDS)
    verifying = (float(len(offers)), plain_seconds + step.t_verify)
    choice = planner._greedy(offers, gains, prices, verifying, max_seconds=max_seconds, protected=protected)
    lengths = np.array(choice.lookup_lengths, dtype=np.int64)
    return laid._replace(
        lookup_plan=MADE, lookup_lengths=lengths, lookup_tokens=choice.tokens, lookup_seconds=choice.seconds
    )


def row_due(ledger: RowLedger, trusted: np.ndarray, offers: StepOffers, t_plain: float, t_verify: float) -> RowDue:
    """What the per-row rule holds a step's rows to: each row's pace (`ledger`), and whether
    its estimate is `trusted`."""
    ahead = np.array(ledger.ahead(offers.req_ids), dtype=np.float64)
    # A row behind its pace is credited nothing: its estimates have fallen short.
    return RowDue(t_plain, t_verify, trusted & (ahead >= 0), ahead)


def compiled_lookup_choice(offers: StepOffers, gains, cost, start, max_seconds, protected: RowDue | None) -> Choice:
    """`DraftPlanner._greedy` without self-drafts, by the compiled kernel over the batch's arrays."""
    offered = offers.lookup_tokens
    depth = int(offered.max(initial=0))
    gain_table = np.ascontiguousarray(gains[:, : max(depth, 1)], dtype=float)
    due = (
        (
            float(protected.t_plain),
            float(protected.t_verify),
            ROW_SLACK,
            protected.trusted.astype(np.float64),
            protected.ahead,
        )
        if protected
        else NO_DUE
    )
    # (floats throughout: the one signature compiled at the engine's start, `lookup_plan.warm_up`)
    lengths, tokens, seconds = greedy_lookup_plan(
        gain_table,
        offered,
        np.array(cost, float),
        float(start[0]),
        float(start[1]),
        float(max_seconds),
        DRAFT_MARGIN,
        protected is not None,
        due,
    )
    return Choice(lengths.tolist(), tokens=float(tokens), seconds=float(seconds))


def self_token_seconds(costs: StepCostModel, cost, self_rows) -> float:
    """Seconds one self-draft token in each of `self_rows` adds: their verification, and a
    draft step over them."""
    return in_order(cost[i] for i in self_rows) + costs.self_step_seconds(len(self_rows))


def unpaid_probes(costs: StepCostModel, offers: StepOffers, self_rows, without_self: Choice, with_self: Choice):
    """The rows without a mask whose probe costs more than self-drafting would save them: the
    seconds per token that self-drafting saves this step (over the whole batch, an
    approximation of a row's own share), times each row's tokens left. In a server every
    request is new once; a probe costs a few target steps, more than a short request can win
    back. Until one is timed, probes are free (to time one); the warm-up times one."""
    probe = costs.probe_seconds
    new = {i for i in self_rows if not offers.has_mask[i]}
    saving = without_self.seconds / without_self.tokens - with_self.seconds / with_self.tokens
    if probe is None or not new or not with_self.self_length or saving <= 0:
        return set()  # (with no saving, self-drafting is not chosen anyway)
    return {i for i in new if saving * offers.remaining[i].item() < probe}


def make_retry(
    costs: StepCostModel, offers: StepOffers, self_rows, choice: Choice, self_budget: int, cost, step, *, room
):
    """Turn `choice` into a one-step self-draft retry (one is due) if it could pay; whether it
    did: with the rows that have a mask, or else one new row (one probe); if it costs no more
    than every row allows (`room()`: what the per-row rule leaves; None: no rule). `cost`: each
    row's seconds a verified token. Whether it could pay is asked first: once a retry is due it
    is asked every step until one is made, and where self-drafting does not pay it never is."""
    retry_rows = {i for i in self_rows if offers.has_mask[i]} or {self_rows[0]}
    if not retry_pays(costs, offers, retry_rows, choice.best_self_saving * self_budget / (self_budget + 1)):
        return False
    seconds = retry_step_seconds(costs, offers, cost, step, retry_rows)
    if room is not None and seconds > room():
        return False
    choice.self_length, choice.self_rows = 1, retry_rows
    choice.seconds += seconds
    choice.lookup_lengths = [0 if i in self_rows else n for i, n in enumerate(choice.lookup_lengths)]
    return True


def retry_step_seconds(costs: StepCostModel, offers: StepOffers, cost, step, rows) -> float:
    """What a one-token self-draft retry over `rows` adds to a step: the draft step, its probe
    if the rows have no mask yet, and their verification."""
    draft_step = costs.self_step_seconds(len(rows))
    return draft_step + probe_seconds(costs, offers, rows) + in_order(float(cost[i]) for i in rows) + step.t_verify


def probe_seconds(costs: StepCostModel, offers: StepOffers, rows) -> float:
    """The probe a self-draft over `rows` needs first: none once they have a mask."""
    return 0.0 if offers.has_mask[next(iter(rows))] else costs.probe_seconds or 0.0


def retry_pays(costs: StepCostModel, offers: StepOffers, retry_rows, best_saving: float) -> bool:
    """Whether a retry could pay back what it costs, one draft step over `retry_rows` and a
    probe if they have no mask yet: probes cost a few target steps, and retries whose best
    case saves less only slow a batch down. A source never measured is always worth a try."""
    if not costs.self_step_measured:
        return True
    return best_saving > costs.self_step_seconds(len(retry_rows)) + probe_seconds(costs, offers, retry_rows)


def keep_every_row_due(protection: RowProtection, choice: Choice, taken, *, totals, priced, plain_rate, max_seconds):
    """The greedy plan (`taken`, its tokens and seconds `totals`) made to leave every row its due
    (`RowProtection`); the plan's tokens and seconds. First, each row the step would not leave
    its due lengthens its own lookup draft while its tokens pay at plain decoding's rate: a
    token credits its row far more than it costs it, and a row the margin left without a draft
    allows only the slack. Then the least paying tokens are given back, first of the rows the
    step does leave their due (a token of a row that binds would lower what it allows), until
    every row has it. `priced`: the rows' offers, lookup gains and seconds per token."""
    (tokens, seconds), (offers, gains, cost) = totals, priced
    for _, _, rows, each, gained in taken:
        protection.take(rows, each, gained)
    lifting = True
    while lifting:
        lifting = False
        for i in sorted(protection.binding(seconds - protection.t_plain) - choice.self_rows):
            if not protection.trusted[i]:  # (its own tokens would credit it nothing)
                continue
            depth = choice.lookup_lengths[i]
            fits = depth < offers[i].lookup_tokens and seconds + cost[i] <= max_seconds
            if fits and gains[i][depth] / cost[i] > plain_rate:
                choice.lookup_lengths[i] += 1
                taken.append((gains[i][depth] / cost[i], "lookup", [i], cost[i], [gains[i][depth]]))
                protection.take([i], cost[i], [gains[i][depth]])
                tokens, seconds, lifting = tokens + gains[i][depth], seconds + cost[i], True
    taken.sort(key=lambda token: -token[0])  # (stable: a row's deeper tokens stay after its others)
    give_back = GiveBack(protection, taken)
    row = None
    while give_back.left and (row := protection.a_binding_row(seconds - protection.t_plain, hint=row)) is not None:
        _, kind, rows, each, gained = give_back.pop(seconds - protection.t_plain)
        tokens, seconds = tokens - sum(gained), seconds - each * len(rows)
        if kind == "self":
            choice.self_length -= 1
        else:
            choice.lookup_lengths[rows[0]] -= 1
    return tokens, seconds


def allowed_without_drafts(t_plain: float, credited, ahead):
    """How much longer than plain's a step may be for a row (`RowProtection`) before its own
    draft's seconds: its slack, what it is credited and what it is ahead (floats, or arrays of
    them, alike to the last bit)."""
    return t_plain * ((1 + credited) / (1 - ROW_SLACK) - 1) + ahead


def in_order(values) -> float:
    """Floats summed left to right, as the compiled plan sums them, on every Python (the builtin
    `sum` compensates its rounding from Python 3.12 on)."""
    total = 0.0
    for value in values:
        total += value
    return total


def beats_by_margin(tokens_per_second: float, rate: float) -> bool:
    """Whether draft tokens that add `tokens_per_second` beat a step's `rate` by DRAFT_MARGIN."""
    return tokens_per_second > (1 + DRAFT_MARGIN) * rate


def self_draft_may_pay(gain: float, seconds: float, start: tuple[float, float]) -> bool:
    """Whether a first self-draft token (`gain` tokens over the rows for `seconds`) beats, by
    the margin, the rate a greedy plan starts from (`start`: tokens, seconds). While the greedy
    takes tokens its rate only rises, so a token that cannot beat the rate it starts from is
    never taken, nor any deeper one: planning with it would make the same plan, slower."""
    return beats_by_margin(gain / seconds, start[0] / start[1])


def every_lookup_token_binds(due: RowDue, offers: StepOffers, cost) -> bool:
    """A sufficient sign that every lookup token would leave some row short of its due, so that
    the lookup plan is plain decoding's, known before any greedy plan is made (at capacity on
    chat, most steps). A row credited nothing allows the step to grow by its slack and what it
    is ahead, and by its own draft's seconds if it drafts: one without a lookup draft that cannot
    allow the batch's cheapest token with verification's fixed cost, or two with drafts that
    cannot allow the batch's cheapest token, leave no token any row may take. (It looks at
    untrusted rows only: a check, not the rule.)"""
    offered = offers.lookup_tokens > 0
    if not offered.any():
        return True
    cheapest = np.asarray(cost)[offered].min()
    # A row's allowance before any token is taken (credited and drafting nothing): its slack
    # and what it is ahead.
    allowed = allowed_without_drafts(due.t_plain, 0.0, due.ahead)
    blocking = ~due.trusted & (allowed < cheapest + np.where(offered, 0.0, due.t_verify))
    return bool(blocking.sum() >= 2 or (blocking & ~offered).any())


class GiveBack:
    """Which token to give back, one at a time, while some row is not left its due: the least
    paying token of a row that would still be left its due without it; else of a row that does
    not bind; else the least paying. Only a row's deepest token is given back (its last in
    `taken`, which is sorted by gain per second, best first); the self-draft tokens share their
    rows, so their deepest stands for all of them. Each row's (or the self-draft rows') two
    thresholds, the step's excess over plain's that leaves it its due without its deepest token
    and the excess it allows at all, change only when its own token goes; the excess only falls
    as tokens go. So a row, once past a threshold, stays past it until its token goes: heaps
    give each answer in O(log rows), where a scan of `taken` cost O(tokens), so O(tokens x rows)
    a plan (tests/test_controller.py checks the two agree)."""

    def __init__(self, protection: RowProtection, taken: list):
        self.protection, self.taken = protection, taken
        self.positions: dict[tuple, list[int]] = {}  # a token's rows -> its tokens' places in `taken`
        for position, token in enumerate(taken):
            self.positions.setdefault(tuple(token[2]), []).append(position)
        self.version = dict.fromkeys(self.positions, 0)
        self.given = bytearray(len(taken))
        self.last = len(taken) - 1  # the last token not given back
        self.left = len(taken)
        # (-threshold, version, rows): not yet past; (-place, version, rows): past it.
        self.waiting: tuple[list, list] = ([], [])
        self.past: tuple[list, list] = ([], [])
        for rows in self.positions:
            self._push(rows)

    def _push(self, rows: tuple) -> None:
        p = self.protection
        gained = self.taken[self.positions[rows][-1]][4]
        allowed = min(p.allowances[i] for i in rows)
        due = min(p.allowance_without(i, gain) for i, gain in zip(rows, gained))
        for waiting, threshold in zip(self.waiting, (due, allowed)):
            heapq.heappush(waiting, (-threshold, self.version[rows], rows))

    def _current(self, entry) -> bool:
        return self.version[entry[2]] == entry[1] and bool(self.positions[entry[2]])

    def _choose(self, added: float) -> int:
        for waiting, past in zip(self.waiting, self.past):
            while waiting and -waiting[0][0] >= added:
                _, version, rows = heapq.heappop(waiting)
                if self.version[rows] == version and self.positions[rows]:
                    heapq.heappush(past, (-self.positions[rows][-1], version, rows))
            while past and not self._current(past[0]):
                heapq.heappop(past)
            if past:
                return -past[0][0]
        return self.last

    def pop(self, added: float):
        """Give back the token to give back while the step is `added` seconds longer than
        plain's: its (gain per second, kind, rows, seconds each, gains)."""
        position = self._choose(added)
        token = self.taken[position]
        rows = tuple(token[2])
        self.positions[rows].pop()
        self.version[rows] += 1
        self.given[position] = 1
        self.left -= 1
        while self.last >= 0 and self.given[self.last]:
            self.last -= 1
        self.protection.take(token[2], token[3], token[4], sign=-1)
        if self.positions[rows]:
            self._push(rows)
        return token


def draining_choice(offers: StepOffers, gains, cost, step, self_budget, a_self: float, costs: StepCostModel) -> Choice:
    """The plan that brings a draining batch's end nearest, net of what it costs
    (`draining_plan`): every row drafts to a common finish line r steps nearer, lookup where its
    draft is long enough, else self-draft; the best r, or no draft. A row not probed yet pays its
    whole probe (a few target steps) in the plan that first self-drafts it: a draining batch has
    few steps left to spread it over, and a retry, on its back-off, still probes one."""
    left = offers.remaining
    # Tokens ahead of the last rows (rows without a limit are level with each other).
    last = left.max(initial=0.0)
    lead = np.subtract(last, left, out=np.zeros(len(left)), where=left != last)
    may_self_draft = offers.can_self_draft & costs.self_step_measured
    self_gains = np.array([a_self**j for j in range(1, self_budget + 1)], dtype=np.float64)
    saved, lookup_spent, self_length, self_rows, probes = (
        line.tolist()
        for line in finish_lines(
            lead, offers.lookup_tokens, may_self_draft, offers.has_mask, np.asarray(cost, dtype=np.float64),
            gains, self_gains, self_budget, step.t0, step.t_verify,
        )
    )  # fmt: skip
    best_net, best_line = 0.0, 0
    for r in range(len(saved)):
        spent = lookup_spent[r] + self_length[r] * costs.self_step_seconds(self_rows[r])
        if probes[r]:  # (a few target steps each)
            spent += probes[r] * (costs.probe_seconds or 0.0)
        if saved[r] - spent > best_net:
            best_net, best_line = saved[r] - spent, r + 1
    if not best_line:
        return Choice([0] * len(offers))
    need = np.maximum(best_line - lead, 0).astype(np.int64)
    by_lookup = offers.lookup_tokens >= need
    chosen = set(np.flatnonzero(~by_lookup).tolist())
    return Choice(np.where(by_lookup, need, 0).tolist(), self_length[best_line - 1], chosen)
