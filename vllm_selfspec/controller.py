"""How many tokens to draft, from measured costs and acceptance: draft only what pays.

Pure arithmetic, no vLLM (unit-tested in tests/test_controller.py). The proposer feeds it what
it observes and asks it, every step, how long each row's draft should be.

Model. A step's time is linear in what it computes (fitted online to every step, `LinearCost`):
    T = t0 + t_prompt * prompt tokens + t_row * logit rows + t_sampled * sampled logit rows
           + t_verify * (1 if the step verifies any draft) + t_new * (1 if its shape is new).
A logit row is a position whose logits are computed: one per request, plus one per draft token.
Prompt tokens need no logits and run as one big matrix product, so they are cheaper than a
verified draft token and get their own coefficient; rows that sample (temperature > 0) pay the
rejection sampler's softmax over the vocabulary on top; a step that verifies any draft at all
runs vLLM's rejection sampler and its metadata, a fixed t_verify (43 ms of a 560 ms step at
batch 32 on Qwen-1.5B here, `benchmarks/step_costs.py`). So a draft token in row i costs
c_i = t_row (+ t_sampled), and a plan with any draft pays t_verify once. The first step at each
shape (logit rows, sampled rows, draft tokens) pays one-off set-up (kernels for new sizes: about
12 ms on a 5 ms tiny-model step); t_new takes it, so it is not charged to verification, which
would then look too dear to ever be tried again. A self-draft step over
m rows takes e(m) seconds (`self_step`, measured). A draft token at depth j from a source
whose tokens are accepted with probability a (prompt lookup per request, self-draft overall,
each measured) is emitted with probability a**j.
A plain step yields B tokens; each added draft token adds a**j expected tokens at the price of
c_i (lookup) or c_i + e(m)/m per row (self-draft). A lookup draft says how sure each of its
tokens is (how many earlier occurrences agree, how long a match they share), so its tokens are
accepted with rates learned per such bin rather than one a per source (`token_bins`). Adding a
token raises tokens/second exactly when its gain/cost ratio beats the current tokens/second, so
the plan takes the best ratios while they do, and is kept only if it beats plain decoding with
t_verify paid. With nothing worth drafting the plan is plain decoding.

Draining batches. That model values a row's accepted token as the step time it frees for
someone else: t0/B + c_i. When no request has been admitted for a while (an offline batch
finishing), a freed slot stays empty and the batch lasts as long as its longest row: a step is
saved only when every row with the most tokens left advances, and a row that is d tokens ahead
of them must advance by r - d for the batch to end r steps sooner. So a draining plan drafts to
a common finish line r (each row takes r - d of its draft, lookup or self), and is worth
t0 * E[min over rows of (d + accepted)] + c_i per accepted token, against what its drafts cost
(`_drain_plan`, the best r or none). Row by row, with each row credited with its own tokens, a
closed batch of 8 sampled HumanEval rows drafted in 169 of 193 steps and took 47-49 steps for
48 tokens a row: every row found a draft now and then, and one row or another always did not,
so the tokens bought nothing (0.92x plain, `benchmarks/plan_calibration.py`).

A source that is not used is not measured, so self-drafting, once it stops paying, is retried
now and then (one draft step, on a back-off schedule), but only if its best case, every token
accepted over the rows' tokens left, would pay back the retry: the draft step, and the probe of
a new prompt when no row has a mask yet (0.6 s, 2-3 target steps, on Qwen-1.5B here).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize


@dataclass
class Decayed:
    """An exponentially weighted sum, so that old observations fade out."""

    decay: float
    value: float = 0.0

    def add(self, x: float) -> None:
        self.value = self.decay * self.value + x


@dataclass
class AcceptanceRate:
    """Per-token acceptance of one draft source, from (drafted, accepted) outcomes. Tokens are
    verified in order, so a draft of d with a accepted had a + (a < d) Bernoulli trials."""

    prior: float
    decay: float = 0.98
    accepted: Decayed = field(init=False)
    trials: Decayed = field(init=False)

    def __post_init__(self):
        # Two pseudo-trials at the prior, so that the first outcomes do not swing it to 0 or 1.
        self.accepted, self.trials = Decayed(self.decay, 2 * self.prior), Decayed(self.decay, 2.0)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.accepted.add(accepted)
            self.trials.add(accepted + (accepted < drafted))

    @property
    def rate(self) -> float:
        return min(self.accepted.value / self.trials.value, 0.999)


@dataclass
class LinearCost:
    """seconds = intercept + coefficients . features, by exponentially weighted least squares
    with non-negative coefficients. Directions the data does not determine (every step with the
    same number of rows, or every row sampling) are pulled towards a prior by a light ridge:
    a unit of feature k costs `prior_share[k]` of the mean step; `ridge[k]` is the pull's
    strength, relative to the feature's variance."""

    prior_share: tuple[float, ...]
    ridge: tuple[float, ...]
    decay: float = 0.98
    min_samples: int = 8
    samples: int = 0
    outliers_in_a_row: int = 0
    _sums: dict = field(default_factory=dict)

    def observe(self, features, seconds: float) -> None:
        x = np.asarray(features, dtype=np.float64)
        # A lone outlier is an idle gap between requests, not a step; a run of them means the
        # costs changed (say, a much bigger batch) and the fit must follow.
        if self.ready and seconds > 4 * self.predict(x):
            self.outliers_in_a_row += 1
            if self.outliers_in_a_row < 3:
                return
        self.outliers_in_a_row = 0
        s = self._sums or dict(w=0.0, x=np.zeros_like(x), xx=np.zeros((len(x), len(x))),
                               y=0.0, xy=np.zeros_like(x))
        for key in s:
            s[key] = s[key] * self.decay
        s["w"] += 1
        s["x"] = s["x"] + x
        s["xx"] = s["xx"] + np.outer(x, x)
        s["y"] += seconds
        s["xy"] = s["xy"] + x * seconds
        self._sums = s
        self.samples += 1

    def coefficients(self) -> tuple[float, np.ndarray]:
        if not self._sums:
            return 0.0, np.zeros(len(self.prior_share))
        s = self._sums
        mean_x, mean_y = s["x"] / s["w"], s["y"] / s["w"]
        cov = s["xx"] / s["w"] - np.outer(mean_x, mean_x)
        cross = s["xy"] / s["w"] - mean_x * mean_y
        share = np.asarray(self.prior_share)
        prior = share * mean_y / (1 + share @ mean_x)
        strength = np.asarray(self.ridge) * (np.diag(cov) + 1e-6 * (mean_x**2 + 1))
        # The ridge-regularised normal equations, solved with non-negative coefficients: as least
        # squares ||A c - b|| with A'A = cov + ridge and A'b = cross + ridge * prior. (Dropping
        # every negative coefficient of the free solution at once dropped the wrong ones: one
        # slow step could zero t_new and charge its set-up to verification.)
        lower = np.linalg.cholesky(cov + np.diag(strength))
        coef, _ = scipy.optimize.nnls(lower.T, np.linalg.solve(lower, cross + strength * prior))
        return max(mean_y - float(mean_x @ coef), 0.0), coef

    def predict(self, features) -> float:
        intercept, coef = self.coefficients()
        return intercept + float(np.asarray(features, dtype=np.float64) @ coef)

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples


def target_step_cost() -> LinearCost:
    """A target step: features (prompt tokens, logit rows, sampled logit rows, verifies any
    draft, first step at its shape). Sampling and verification are assumed free until seen to
    cost, and pulled hardest to that: a workload that always samples charges its cost to every
    row (the safe side), not to a greedy row it never saw, and one that always drafts charges
    verification to t0. The first verifications are all at new shapes: set-up is pulled less,
    so it takes their extra cost."""
    return LinearCost(prior_share=(0.1, 0.1, 0.0, 0.0, 0.0), ridge=(1e-4, 1e-4, 1e-2, 1e-2, 1e-3))


def self_step_cost() -> LinearCost:
    """A self-draft step: feature (rows drafting). Rare, so weighted to follow recent ones."""
    return LinearCost(prior_share=(0.1,), ridge=(1e-3,), decay=0.9, min_samples=1)


MATCH_EDGES = (2, 4, 8)  # match length buckets: 1 | 2-3 | 4-7 | 8+ tokens
AGREEMENT_EDGES = (0.34, 0.5, 0.67, 0.9)  # share of the occurrences agreeing on the token


def agreement(probs: tuple[float, ...]) -> list[float]:
    """Per lookup token, the share of the occurrences behind the previous token that agree on
    this one (p_j / p_j-1)."""
    return [p / previous for p, previous in zip(probs, (1.0, *probs))]


def token_bins(source: str, probs: tuple[float, ...], match: int, length: int,
               sampled: bool = False) -> list[tuple]:
    """Each lookup draft token's calibration bin: its source, whether its row samples (a
    sampled row accepts a token with the target's probability of it, a greedy row only if it
    is the argmax: rates learned on one say little about the other), its match-length bucket
    and its agreement bucket. Without probabilities, one bin per source and kind of row."""
    if not probs:
        return [(source, sampled)] * length
    match_bucket = bisect.bisect_right(MATCH_EDGES, match)
    return [(source, sampled, match_bucket, bisect.bisect_right(AGREEMENT_EDGES, share))
            for share in agreement(probs[:length])]


@dataclass
class RowOffer:
    """What one row of the batch can draft this step."""

    req_id: str = ""
    lookup: int = 0  # tokens offered by lookup, from the row's own context or from history
    lookup_source: str = "lookup"  # "lookup" (own context) or "history" (earlier outputs)
    can_self_draft: bool = False  # budget left: may draft with the model (instead of lookup)
    sampled: bool = False  # temperature > 0: verifying its drafts costs a softmax each
    lookup_probs: tuple[float, ...] = ()  # per lookup token, see vllm_selfspec.lookup
    lookup_match: int = 0
    remaining: int | None = None  # tokens the request may still emit (None: no limit known)
    has_mask: bool = False  # its prompt is probed already: a self-draft needs no probe

    @property
    def tokens_left(self) -> float:
        return math.inf if self.remaining is None else self.remaining

    @property
    def lookup_bins(self) -> list[tuple]:
        return token_bins(self.lookup_source, self.lookup_probs, self.lookup_match, self.lookup, self.sampled)


@dataclass
class DraftPlan:
    lookup_lengths: list[int]  # per offer (0 for rows that do not take a lookup draft)
    self_length: int  # draft steps for the self-draft rows
    explored: bool = False
    self_rows: list[bool] = field(default_factory=list)  # per offer: drafts with the model if any

    @staticmethod
    def everything(offers: list[RowOffer], self_budget: int) -> DraftPlan:
        """Every lookup draft whole, self-drafts of the full budget where lookup has none."""
        return DraftPlan([o.lookup for o in offers], self_budget, False,
                         [o.can_self_draft and not o.lookup for o in offers])


@dataclass
class DraftController:
    lookup: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(prior=0.6))
    history: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(prior=0.4))
    self_draft: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(prior=0.7))
    step: LinearCost = field(default_factory=target_step_cost)
    self_step: LinearCost = field(default_factory=self_step_cost)
    explore_after: int = 16  # steps without self-drafting before a retry; doubles, up to 1024
    _idle_steps: int = 0
    probe_seconds: float | None = None  # per probed row, a moving average
    _step_shapes_seen: set = field(default_factory=set)
    # Lookup acceptance per request and source (prior: the source's overall rate): code and
    # prose differ a lot.
    _by_request: dict[tuple[str, str], AcceptanceRate] = field(default_factory=dict)
    # Lookup acceptance per token bin (prior: the agreement share of its first token).
    _by_bin: dict[tuple, AcceptanceRate] = field(default_factory=dict)

    # ---- what happened -----------------------------------------------------------------
    def observe_step(self, prompt_tokens: int, logit_rows: int, sampled_rows: int, seconds: float,
                     draft_tokens: int = 0) -> None:
        shape = (logit_rows, sampled_rows, draft_tokens)
        new_shape = shape not in self._step_shapes_seen
        self._step_shapes_seen.add(shape)
        self.step.observe((prompt_tokens, logit_rows, sampled_rows, draft_tokens > 0, new_shape), seconds)

    def observe_self_step(self, rows: int, seconds: float) -> None:
        self.self_step.observe((rows,), seconds)

    def observe_probe(self, rows: int, seconds: float) -> None:
        """A statistics probe over `rows` new prompts (what a row pays before its first self-draft)."""
        per_row = seconds / rows
        self.probe_seconds = per_row if self.probe_seconds is None else 0.7 * self.probe_seconds + 0.3 * per_row

    def observe_draft(self, req_id: str, source: str, drafted: int, accepted: int, bins=()) -> None:
        """What verification made of a row's draft from `source` (lookup, history or self),
        with its lookup tokens' (bin, prior rate) pairs (`calibration`)."""
        overall = getattr(self, "self_draft" if source == "self" else source)
        overall.observe(drafted, accepted)
        if source != "self":
            key = (req_id, source)
            if key not in self._by_request:
                self._by_request[key] = AcceptanceRate(prior=overall.rate, decay=0.95)
            self._by_request[key].observe(drafted, accepted)
        for j, (b, prior) in enumerate(bins[:min(accepted + 1, drafted)]):  # accepted, the first rejected
            if b not in self._by_bin:
                self._by_bin[b] = AcceptanceRate(prior=min(prior, 0.999))
            self._by_bin[b].observe(1, int(j < accepted))

    def forget(self, req_id: str) -> None:
        for source in ("lookup", "history"):
            self._by_request.pop((req_id, source), None)

    def lookup_rate(self, req_id: str, source: str = "lookup") -> float:
        rate = self._by_request.get((req_id, source))
        return rate.rate if rate else getattr(self, source).rate

    def calibration(self, offer: RowOffer, length: int | None = None) -> list[tuple[tuple, float]]:
        """(bin, prior rate) of an offer's first `length` lookup tokens (all by default). A
        token's prior is the share of occurrences that agree on it (suffix decoding's own
        estimate), or without probabilities its source's overall rate."""
        length = offer.lookup if length is None else length
        shares = agreement(offer.lookup_probs) or [getattr(self, offer.lookup_source).rate] * offer.lookup
        return list(zip(offer.lookup_bins[:length], shares[:length]))

    def lookup_gains(self, offer: RowOffer) -> list[float]:
        """Expected tokens from each depth j of a row's lookup draft: the chance that its first
        j tokens are all accepted, the product of each token's rate, scaled by how this
        request's drafts fare against its source's. Never rises with depth. A token's rate is
        its bin's; in a bin not seen yet, its prior (`calibration`), not the source's overall
        rate, which weak drafts drag down."""
        overall = getattr(self, offer.lookup_source).rate
        request = self.lookup_rate(offer.req_id, offer.lookup_source) / overall
        gains, gain = [], 1.0
        for b, prior in self.calibration(offer):
            rate = self._by_bin[b].rate if b in self._by_bin else prior
            gain *= min(rate * request, 0.999)
            gains.append(gain)
        return gains

    # ---- what to do ---------------------------------------------------------------------
    def plan(self, offers: list[RowOffer], self_budget: int, draining: bool = False) -> DraftPlan:
        """Draft lengths for one step over these rows (every row that sampled a token);
        `draining`: no request admitted lately, so only the batch's end counts (`_drain_plan`)."""
        if not self.step.ready:  # learn the step cost first, with the drafts that cost nothing
            return DraftPlan([o.lookup for o in offers], 0, False, [False] * len(offers))
        t0, (_, t_row, t_sampled, t_verify, _) = self.step.coefficients()
        cost = [max(t_row + t_sampled * o.sampled, 1e-9) for o in offers]
        gains = [self.lookup_gains(o) if o.lookup else [] for o in offers]
        # Rows that would rather self-draft: no lookup draft, or a first lookup token less likely
        # than a self-draft's.
        a_self = self.self_draft.rate
        self_rows = [i for i, o in enumerate(offers) if o.can_self_draft and (
            not o.lookup or (self.self_step.samples and gains[i][0] < a_self))]
        m = len(self_rows)
        self_step = self.self_step.predict((m,)) if m else 0.0
        if draining and len(offers) > 1:  # (one row's end is the batch's: the rate plan is that)
            lookup_lengths, self_length, chosen = self._drain_plan(offers, gains, cost, t0, t_verify, self_budget)
            # At best (every token accepted) a self-draft over these rows saves a step per draft
            # step, on up to K/(K+1) of the steps left to the batch's end.
            best_saving = (t0 - self_step - t_verify) * max(o.tokens_left for o in offers)
        else:
            lookup_lengths, self_length, best_saving = self._steady_plan(
                offers, gains, cost, t0, t_verify, self_rows, self_step, self_budget)
            chosen = set(self_rows) if self_length else set()
        explored = False
        if m and self_length == 0 and self_budget:
            self._idle_steps += 1
            # A retry drafts one step with the rows that have a mask, or else one new row (one
            # probe), and only if its best case pays for it.
            retry_rows = {i for i in self_rows if offers[i].has_mask} or {self_rows[0]}
            if (self._idle_steps >= self.explore_after
                    and self._retry_pays(offers, retry_rows, best_saving * self_budget / (self_budget + 1))):
                self_length, explored, self._idle_steps = 1, True, 0
                self.explore_after = min(2 * self.explore_after, 1024)
                lookup_lengths = [0 if i in self_rows else n for i, n in enumerate(lookup_lengths)]
                chosen = retry_rows
        elif self_length > 0:
            self._idle_steps, self.explore_after = 0, 16
        return DraftPlan(lookup_lengths, self_length, explored, [i in chosen for i in range(len(offers))])

    def _steady_plan(self, offers, gains, cost, t0, t_verify, self_rows, self_step, self_budget):
        """The plan with the most tokens per second: lookup only, or self-drafts for
        `self_rows` with lookup for the rest (so a row that self-drafting does not pay for keeps
        its lookup draft). Returns (lookup lengths, self-draft length, the seconds self-drafting
        could save at best: every token accepted, on all the self rows' tokens left)."""
        plain_step = (float(len(offers)), t0 + sum(cost))  # (tokens, seconds): one logit row each
        self_token_cost = sum(cost[i] for i in self_rows) + self_step
        # Any draft pays t_verify once: take the best tokens at the rate that leaves, then keep
        # the plan only if it beats plain decoding.
        verifying = (plain_step[0], plain_step[1] + t_verify)
        lookup_lengths, self_length, tokens, seconds = self._greedy(offers, gains, cost, verifying)
        if self_rows and self.self_step.samples and self_budget:
            with_self = self._greedy(offers, gains, cost, verifying, self_rows, self_budget, self_token_cost)
            if with_self[1] and with_self[2] / with_self[3] > tokens / seconds:
                lookup_lengths, self_length, tokens, seconds = with_self
        if tokens / seconds <= plain_step[0] / plain_step[1]:
            lookup_lengths, self_length, tokens, seconds = [0] * len(offers), 0, *plain_step
        # At best each self-draft token costs self_token_cost / m, not the plan's seconds per token.
        per_token = seconds / tokens - self_token_cost / max(len(self_rows), 1)
        return lookup_lengths, self_length, per_token * sum(offers[i].tokens_left for i in self_rows)

    def _retry_pays(self, offers, retry_rows, best_saving: float) -> bool:
        """Whether a retry of self-drafts could pay back what it costs, one draft step over
        `retry_rows` and a probe if they have no mask yet: on this CPU probes cost 2-3 target
        steps, and retries whose best case saved less cost 2-5% of a batch-1 run (NOTES,
        attempt 15). A source that was never measured is always worth a try."""
        if not self.self_step.samples:
            return True
        probe = 0.0 if offers[next(iter(retry_rows))].has_mask else self.probe_seconds or 0.0
        return best_saving > self.self_step.predict((len(retry_rows),)) + probe

    def _greedy(self, offers, gains, cost, start, self_rows=(), self_budget=0, self_token_cost=0.0):
        """Add draft tokens, best gain per second first, while each beats the step's rate so
        far. Returns (lookup lengths, self-draft length, tokens, seconds)."""
        tokens, seconds = start
        lookup_lengths, self_length = [0] * len(offers), 0
        # Candidates: (-ratio, kind, row, depth). Within a source the ratio falls with depth,
        # so a row's next token is queued only once its last is taken.
        candidates = [(-gains[i][0] / cost[i], "lookup", i, 1)
                      for i, offer in enumerate(offers) if offer.lookup and i not in self_rows]
        a_self, m = self.self_draft.rate, len(self_rows)
        if self_rows and self_budget:
            candidates.append((-m * a_self / self_token_cost, "self", -1, 1))
        heapq.heapify(candidates)
        while candidates and -candidates[0][0] > tokens / seconds:
            _, kind, i, depth = heapq.heappop(candidates)
            if kind == "lookup":
                lookup_lengths[i] = depth
                tokens, seconds = tokens + gains[i][depth - 1], seconds + cost[i]
                if depth < offers[i].lookup:
                    heapq.heappush(candidates, (-gains[i][depth] / cost[i], "lookup", i, depth + 1))
            else:
                self_length = depth
                tokens, seconds = tokens + m * a_self**depth, seconds + self_token_cost
                if depth < self_budget:
                    heapq.heappush(candidates, (-m * a_self ** (depth + 1) / self_token_cost, "self", -1, depth + 1))
        return lookup_lengths, self_length, tokens, seconds

    def _drain_plan(self, offers, gains, cost, t0, t_verify, self_budget):
        """The plan that brings a draining batch's end nearest, net of what it costs (module
        docstring): every row drafts to a common finish line r steps nearer, lookup where its
        draft is long enough, else self-draft; the best r, or no draft. Returns (lookup lengths,
        self-draft length, rows that self-draft)."""
        left = [o.tokens_left for o in offers]
        # Tokens ahead of the last rows (rows without a limit are level with each other).
        lead = [0 if r == max(left) else max(left) - r for r in left]
        a_self, measured = self.self_draft.rate, self.self_step.samples > 0
        best = (0.0, [0] * len(offers), 0, set())
        for finish in range(1, max(max(o.lookup for o in offers), self_budget) + 1):
            need = [max(0, finish - d) for d in lead]  # a row d tokens ahead needs finish - d
            lengths, self_rows, survival = [0] * len(offers), set(), []  # survival: P(accepted >= j)
            for i, (o, n) in enumerate(zip(offers, need)):
                if n and o.lookup >= n:
                    lengths[i] = n
                    survival.append(gains[i][:n])
                elif n and o.can_self_draft and measured and self_budget >= n:
                    self_rows.add(i)
                    survival.append([a_self**j for j in range(1, n + 1)])
                elif n:
                    break  # this row cannot reach the line: the batch cannot end sooner by it
                else:
                    survival.append([])
            else:
                # E[min over rows of (lead + accepted)], counted in whole tokens up to the line.
                nearer = sum(math.prod(1.0 if y <= d else (s[y - d - 1] if y - d <= len(s) else 0.0)
                                       for d, s in zip(lead, survival)) for y in range(1, finish + 1))
                saved = t0 * nearer + sum(c * sum(s) for c, s in zip(cost, survival))
                self_length = max((need[i] for i in self_rows), default=0)
                spent = (t_verify + sum(c * n for c, n in zip(cost, need))
                         + (self_length * self.self_step.predict((len(self_rows),)) if self_rows else 0.0))
                if saved - spent > best[0]:
                    best = (saved - spent, lengths, self_length, self_rows)
        return best[1:]
