# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What a step costs: a target step, a self-draft step and a probe, fitted online to measured times.

A target step's time is linear in what it computes:
    T = t0 + t_prompt * prompt tokens + t_row * logit rows + t_sampled * sampled logit rows
           + t_verify * (1 if the step verifies any draft) + t_new * (1 if its shape is new)
           + t_context * context read (thousands of tokens: each logit row's context, summed).
A logit row is a position whose logits are computed: one per request, plus one per draft token.
Prompt tokens need no logits and run as one big matrix product, so they are cheaper than a
verified draft token and get their own coefficient. Rows that sample (temperature > 0) pay the
rejection sampler's softmax over the vocabulary on top. A step that verifies any draft runs
vLLM's rejection sampler and its metadata, a fixed cost. The first step at each shape (logit
rows, sampled rows, draft tokens) pays one-off set-up (kernels for new sizes); t_new takes it,
so it is not charged to verification, which would then look too dear to ever be tried again.
Each logit row attends over its request's context: a draft token of a 6,000-token request costs
more than one of a 100-token request, and t_context prices the difference.
A self-draft step over m rows and a probe per new prompt are measured apart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from vllm_selfspec.control.cost_fit import add_decayed, ridge_nonnegative_fit

MAX_SHAPES_REMEMBERED = 4096


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
    # Once the fit has settled, refit only every this many observations: a solve costs a
    # noticeable part of a small step, and with a decay of 0.98 a few steps move it little.
    refit_every: int = 1
    samples: int = 0
    outliers_in_a_row: int = 0
    _sums: np.ndarray | None = None
    # The last fit and the observation count it saw: the planner asks several times a step.
    _fit: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _fit_samples: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        # (as arrays once: the compiled solve takes no tuples)
        self._prior_share = np.asarray(self.prior_share, dtype=np.float64)
        self._ridge = np.asarray(self.ridge, dtype=np.float64)

    def observe(self, features, seconds: float) -> None:
        x = np.asarray(features, dtype=np.float64)
        # A lone outlier is a step held up by something else (another process on the cores),
        # not its cost; a run of them means the costs changed (say, a much bigger batch) and
        # the fit must follow. (The proposer does not time steps that found the engine idle.)
        if self.ready and seconds > 4 * self.predict(x):
            self.outliers_in_a_row += 1
            if self.outliers_in_a_row < 3:
                return
            self._fit = None  # the costs changed: follow them now, not at the next refit
        self.outliers_in_a_row = 0
        # The decayed sums of (1, features, seconds) times its transpose: every sum the fit
        # needs (weight, features, seconds and their products) in one update.
        first = self._sums is None
        if first:
            self._sums = np.zeros((len(x) + 2, len(x) + 2))
        add_decayed(self._sums, x, float(seconds), 0.0 if first else self.decay)
        self.samples += 1

    def coefficients(self) -> tuple[float, np.ndarray]:
        settled = self.samples >= 4 * self.min_samples
        if self._fit is None or self.samples - self._fit_samples >= (self.refit_every if settled else 1):
            intercept, coef = self._solve()
            coef.flags.writeable = False  # shared by every caller until the next fit
            self._fit, self._fit_samples = (intercept, coef), self.samples
        return self._fit

    def _solve(self) -> tuple[float, np.ndarray]:
        """The ridge-regularised fit with non-negative coefficients (`cost_fit`). Dropping every
        negative coefficient of the free solution at once would drop the wrong ones: one slow
        step could zero t_new and charge its set-up to verification."""
        if self._sums is None:
            return 0.0, np.zeros(len(self.prior_share))
        intercept, coef = ridge_nonnegative_fit(self._sums, self._prior_share, self._ridge)
        if not (np.isfinite(intercept) and np.isfinite(coef).all()):  # (a step timed as inf or nan)
            raise FloatingPointError("the step-cost fit is not finite")
        return float(intercept), coef

    def predict(self, features) -> float:
        intercept, coef = self.coefficients()
        if len(features) == 1:  # (a self-draft step's, asked several times a step: no arrays)
            return intercept + float(features[0] * coef[0])
        return intercept + float(np.asarray(features, dtype=np.float64) @ coef)

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples


def target_step_cost() -> LinearCost:
    """A target step: features (prompt tokens, logit rows, sampled logit rows, verifies any
    draft, first step at its shape, thousands of context tokens read by the logit rows). Context
    is assumed free until seen to cost, like sampling. Sampling and verification are assumed free until seen to
    cost, and pulled hardest to that: a workload that always samples charges its cost to every
    row (the safe side), not to a greedy row it never saw, and one that always drafts charges
    verification to t0. The first verifications are all at new shapes: set-up is pulled less,
    so it takes their extra cost."""
    return LinearCost(
        prior_share=(0.1, 0.1, 0.0, 0.0, 0.0, 0.0), ridge=(1e-4, 1e-4, 1e-2, 1e-2, 1e-3, 1e-2), refit_every=8
    )


def self_step_cost() -> LinearCost:
    """A self-draft step: feature (rows drafting). Rare, so weighted to follow recent ones."""
    return LinearCost(prior_share=(0.1,), ridge=(1e-3,), decay=0.9, min_samples=1)


@dataclass(frozen=True)
class StepCosts:
    """The fitted target-step coefficients, in seconds (module docstring)."""

    t0: float
    t_prompt: float
    t_row: float
    t_sampled: float
    t_verify: float
    t_new: float
    t_context: float = 0.0  # per thousand context tokens a logit row attends over


@dataclass
class StepCostModel:
    """Every cost the planner prices: target steps, self-draft steps and probes."""

    step: LinearCost = field(default_factory=target_step_cost)
    self_step: LinearCost = field(default_factory=self_step_cost)
    probe_seconds: float | None = None  # per probed prompt, a moving average
    _probe_provisional: bool = False  # probe_seconds is the warm-up's (`observe_probe`)
    # The step shapes met lately, most recent last: bounded, since a long-running server meets
    # ever more (a shape dropped and met again is charged its set-up once more, a small error).
    _shapes_seen: OrderedDict = field(default_factory=OrderedDict)
    _target: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (fit, StepCosts)

    def observe_step(
        self,
        prompt_tokens: int,
        logit_rows: int,
        sampled_rows: int,
        seconds: float,
        draft_tokens: int = 0,
        context_read: float = 0.0,
    ) -> None:
        features = self.step_features(prompt_tokens, logit_rows, sampled_rows, draft_tokens, context_read)
        shape = (logit_rows, sampled_rows, draft_tokens)
        self._shapes_seen[shape] = None
        self._shapes_seen.move_to_end(shape)
        if len(self._shapes_seen) > MAX_SHAPES_REMEMBERED:
            self._shapes_seen.popitem(last=False)
        self.step.observe(features, seconds)

    def step_features(
        self, prompt_tokens: int, logit_rows: int, sampled_rows: int, draft_tokens: int, context_read: float
    ) -> tuple:
        """A target step's features as the fit reads them (the module docstring): its shape is
        new until `observe_step` has seen it. `context_read`: context tokens its logit rows read."""
        new_shape = (logit_rows, sampled_rows, draft_tokens) not in self._shapes_seen
        return (prompt_tokens, logit_rows, sampled_rows, draft_tokens > 0, new_shape, context_read / 1000)

    def observe_self_step(self, rows: int, seconds: float) -> None:
        self.self_step.observe((rows,), seconds)

    def observe_probe(self, rows: int, seconds: float, *, provisional: bool = False) -> None:
        """A statistics probe over `rows` new prompts (what a row pays before its first self-draft).
        `provisional`: the warm-up's, one prompt timed before any probe ran in earnest; it prices
        probes until the first one in earnest replaces it, and never replaces one itself."""
        per_row = seconds / rows
        if provisional:
            if self.probe_seconds is None or self._probe_provisional:
                self.probe_seconds, self._probe_provisional = per_row, True
            return
        first = self.probe_seconds is None or self._probe_provisional
        self.probe_seconds = per_row if first else 0.7 * self.probe_seconds + 0.3 * per_row
        self._probe_provisional = False

    @property
    def ready(self) -> bool:
        return self.step.ready

    @property
    def self_step_measured(self) -> bool:
        return self.self_step.samples > 0

    def target(self) -> StepCosts:
        fit = self.step.coefficients()
        if self._target is None or self._target[0] is not fit:  # (asked several times a step)
            t0, coef = fit
            self._target = (fit, StepCosts(t0, *(float(c) for c in coef)))
        return self._target[1]

    def self_step_seconds(self, rows: int) -> float:
        return self.self_step.predict((rows,)) if rows else 0.0


def pin_step_costs(costs: StepCostModel, *, t0: float, t_row: float, t_verify: float, self_step: float) -> None:
    """Fix `costs`' fits (seconds: per step, per logit row, once per step that verifies drafts,
    per self-draft step), so that what the planner decides follows from acceptance alone, not
    from how fast the machine runs that moment: for tests and the lab. Steps are still observed,
    their sums updated as a server's are every step, so that the lab times that work too."""
    step, drafting = target_step_cost(), self_step_cost()
    for rows in (1, 4, 8) * 4:
        for drafts in (0, 2):
            seconds = t0 + t_row * (rows + drafts) + t_verify * (drafts > 0)
            step.observe((0, rows + drafts, 0, drafts > 0, False, 0.0), seconds)
        drafting.observe((rows,), self_step)
    for fitted in (step, drafting):
        fit = fitted.coefficients()
        fitted.coefficients = lambda fit=fit: fit
    costs.step, costs.self_step = step, drafting
