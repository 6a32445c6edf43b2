"""How many tokens to draft, from measured costs and acceptance: draft only what pays.

Pure arithmetic, no vLLM (unit-tested in tests/test_controller.py). The proposer feeds it what
it observes and asks it, every step, how long each row's draft should be.

Model. A step that computes n tokens takes T(n) = t0 + t1*n seconds (fitted online to every
step: a verified draft token costs what a prompt token costs, one more query row). A self-draft step over m rows takes e seconds (measured). A draft token at depth j from
a source whose tokens are accepted with probability a (prompt lookup or self-draft, each
measured) is emitted with probability a**j. So a plain step yields B tokens in T(B); each
added draft token adds a**j expected tokens at the price of t1 (lookup) or t1 + e/m per row
(self-draft). Adding a token raises tokens/second exactly when its gain/cost ratio beats the
current tokens/second, so the plan greedily takes the best ratios while they do. With nothing
worth drafting the plan is plain decoding.

A source that is not used is not measured, so self-drafting, once it stops paying, is retried
now and then (one draft step, on a back-off schedule) in case the text has changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
class StepCost:
    """T(n) = t0 + t1 * n, fitted by exponentially weighted least squares."""

    decay: float = 0.98
    min_samples: int = 8
    # Before there is spread in n: an extra verified token costs this share of a 1-token step.
    prior_marginal_share: float = 0.1
    sums: dict = field(default_factory=lambda: dict(w=0.0, n=0.0, nn=0.0, y=0.0, ny=0.0))
    samples: int = 0
    outliers_in_a_row: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        # A lone outlier is an idle gap between requests, not a step; a run of them means the
        # costs changed (say, a much bigger batch) and the fit must follow.
        if self.samples >= self.min_samples and seconds > 4 * self.predict(num_tokens):
            self.outliers_in_a_row += 1
            if self.outliers_in_a_row < 3:
                return
        self.outliers_in_a_row = 0
        s = self.sums
        for key in s:
            s[key] *= self.decay
        s["w"] += 1
        s["n"] += num_tokens
        s["nn"] += num_tokens * num_tokens
        s["y"] += seconds
        s["ny"] += num_tokens * seconds
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        s = self.sums
        if s["w"] == 0:
            return 0.0, 0.0
        mean_n, mean_y = s["n"] / s["w"], s["y"] / s["w"]
        var = s["nn"] / s["w"] - mean_n**2
        if var > 0.25:
            t1 = max((s["ny"] / s["w"] - mean_n * mean_y) / var, 0.0)
        else:  # no spread yet: assume verification is cheap relative to a step
            t1 = self.prior_marginal_share * mean_y / (1 + self.prior_marginal_share * mean_n)
        return max(mean_y - t1 * mean_n, 0.0), t1

    def predict(self, num_tokens: int) -> float:
        t0, t1 = self.coefficients()
        return t0 + t1 * num_tokens

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples


@dataclass
class DraftPlan:
    lookup_lengths: list[int]  # per lookup row
    self_length: int  # draft steps for the self-draft rows
    explored: bool = False


@dataclass
class DraftController:
    lookup: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(prior=0.6))
    self_draft: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(prior=0.7))
    step: StepCost = field(default_factory=StepCost)
    self_step_seconds: Decayed = field(default_factory=lambda: Decayed(0.9))
    self_step_weight: Decayed = field(default_factory=lambda: Decayed(0.9))
    explore_after: int = 16  # steps without self-drafting before a retry; doubles, up to 1024
    _idle_steps: int = 0

    def observe_self_step(self, seconds: float) -> None:
        self.self_step_seconds.add(seconds)
        self.self_step_weight.add(1.0)

    @property
    def self_step_cost(self) -> float:
        w = self.self_step_weight.value
        # Unmeasured: assume a draft step costs a target step (the pessimistic case on CPU).
        return self.self_step_seconds.value / w if w else self.step.predict(1)

    def plan(self, batch_rows: int, lookup_found: list[int], num_self_rows: int,
             self_budget: int) -> DraftPlan:
        """Draft lengths for one step: `lookup_found[i]` tokens are available from prompt lookup
        for each lookup row; `num_self_rows` rows could self-draft up to `self_budget` tokens."""
        if not self.step.ready:  # learn the step cost first, with the drafts that cost nothing
            return DraftPlan(list(lookup_found), 0)
        t0, t1 = self.step.coefficients()
        tokens, seconds = float(batch_rows), t0 + t1 * batch_rows
        a_lookup, a_self = self.lookup.rate, self.self_draft.rate
        lookup_lengths = [0] * len(lookup_found)
        self_length = 0
        while True:
            best, best_ratio = None, tokens / seconds
            for i, found in enumerate(lookup_found):
                j = lookup_lengths[i] + 1
                if j <= found and a_lookup**j / max(t1, 1e-9) > best_ratio:
                    best, best_ratio = ("lookup", i), a_lookup**j / max(t1, 1e-9)
            if num_self_rows and self_length < self_budget:
                j = self_length + 1
                gain = num_self_rows * a_self**j
                ratio = gain / (num_self_rows * t1 + self.self_step_cost)
                if ratio > best_ratio:
                    best, best_ratio = ("self", 0), ratio
            if best is None:
                break
            if best[0] == "lookup":
                lookup_lengths[best[1]] += 1
                tokens, seconds = tokens + a_lookup**lookup_lengths[best[1]], seconds + t1
            else:
                self_length += 1
                tokens += num_self_rows * a_self**self_length
                seconds += num_self_rows * t1 + self.self_step_cost
        explored = False
        if num_self_rows and self_length == 0:
            self._idle_steps += 1
            if self._idle_steps >= self.explore_after:  # retry one draft step, back off if it fails
                self_length, explored, self._idle_steps = 1, True, 0
                self.explore_after = min(2 * self.explore_after, 1024)
        elif self_length > 0:
            self._idle_steps, self.explore_after = 0, 16
        return DraftPlan(lookup_lengths, self_length, explored)
