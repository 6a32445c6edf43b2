# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A draining batch's plan by the compiled pass over finish lines (`control.draining_plan`)
against the row-by-row reference below, over random batches: the same plan to the last bit.
The reference sums floats left to right (`in_order`), as the kernel does and as the builtin
`sum` did before Python 3.12, which compensates its rounding."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from test_controller import closed, lookup_rows, trained

from vllm_selfspec.control import StepOffers
from vllm_selfspec.control.planner import Choice, draining_choice, in_order


def reference_draining_choice(offers, gains, cost, step, self_budget, a_self, costs) -> Choice:
    """`planner.draining_choice` row by row and line by line, in Python."""
    rows = offers.rows
    left = [o.tokens_left for o in rows]
    lead = [0 if r == max(left) else max(left) - r for r in left]
    t0, t_verify, measured = step.t0, step.t_verify, costs.self_step_measured
    best_net, best = 0.0, Choice([0] * len(rows))
    for finish in range(1, max(max(o.lookup_tokens for o in rows), self_budget) + 1):
        need = [max(0, finish - d) for d in lead]
        lengths, chosen, survival = [0] * len(rows), set(), []  # survival: P(accepted >= j)
        for i, (o, n) in enumerate(zip(rows, need)):
            if n and o.lookup_tokens >= n:
                lengths[i] = n
                survival.append(list(gains[i][:n]))
            elif n and o.can_self_draft and measured and self_budget >= n:
                chosen.add(i)
                survival.append([a_self**j for j in range(1, n + 1)])
            elif n:
                return best
            else:
                survival.append([])
        nearer = in_order(
            math.prod(1.0 if y <= d else s[y - d - 1] for d, s in zip(lead, survival)) for y in range(1, finish + 1)
        )
        saved = t0 * nearer + in_order(c * in_order(s) for c, s in zip(cost, survival))
        self_length = max((need[i] for i in chosen), default=0)
        drafted = in_order(c * n for c, n in zip(cost, need))
        spent = t_verify + drafted + self_length * costs.self_step_seconds(len(chosen))
        if probes := sum(not rows[i].has_mask for i in chosen):
            spent += probes * (costs.probe_seconds or 0.0)
        if saved - spent > best_net:
            best_net, best = saved - spent, Choice(lengths, self_length, chosen)
    return best


def test_the_compiled_draining_plan_is_the_reference_plan():
    """Random batches of 1-24 rows: lookup drafts of 0-8 tokens or none, may self-draft or not,
    probed or not, tokens left level, a few apart, or unlimited beside limited rows; self-drafting
    measured or not, probes priced or free, self-draft budgets 0-8. Every plan alike, and the
    batches cover plans of lookup alone, with self-drafts, and of nothing."""
    rng = random.Random(3)
    kinds = {"nothing": 0, "lookup": 0, "self": 0}
    for case in range(600):
        controller = trained(
            t0=rng.choice([0.0076, 0.05, 0.28]),
            t1=rng.choice([5e-5, 0.0035, 0.0088]),
            self_step=rng.choice([0.001, 0.004, 0.05]),
            lookup_rate=rng.choice([0.6, 0.9, 0.99]),
            self_rate=rng.choice([0.5, 0.9, 0.97]),
        )
        if rng.random() < 0.3:
            controller.observe_probe(1, rng.choice([0.001, 0.9]))
        count = rng.randint(1, 24)
        found = [rng.choice([0, 2, 4, 8]) for _ in range(count)]
        rows = [
            dataclasses.replace(row, can_self_draft=rng.random() < 0.5, has_mask=rng.random() < 0.5)
            for row in lookup_rows(*found)
        ]
        last = rng.choice([30, 40])
        left = [rng.choice([last, last, last - 1, last - 3, last - 20]) for _ in rows]
        if rng.random() < 0.2:
            left = [None if rng.random() < 0.5 else n for n in left]
        offers = StepOffers.of(closed(rows, left))
        planner = controller.planner
        if rng.random() < 0.2:
            planner.costs.self_step.samples = 0  # (self-drafting not measured)
        step, gains = planner.costs.target(), planner.acceptance.step_gains(offers).planned
        cost = rng.choice([0.001, 0.004]) * (1 + np.arange(count) % 3)
        budget = rng.choice([0, 2, 4, 8])
        a_self = planner.acceptance.self_rate
        made = draining_choice(offers, gains, cost, step, budget, a_self, planner.costs)
        expected = reference_draining_choice(offers, gains, cost.tolist(), step, budget, a_self, planner.costs)
        assert (made.lookup_lengths, made.self_length, made.self_rows) == (
            expected.lookup_lengths,
            expected.self_length,
            expected.self_rows,
        ), case
        kinds["self" if made.self_length else "lookup" if any(made.lookup_lengths) else "nothing"] += 1
    assert min(kinds.values()) > 30, kinds


def test_the_kernel_refuses_arrays_it_would_read_past():
    """A compiled kernel reads past an array's end without a word: each shape is checked first."""
    from vllm_selfspec.control.draining_plan import finish_lines

    rows, flags = np.zeros(2), np.ones(2, dtype=bool)
    tokens, cost, gains, self_gains = np.full(2, 2, dtype=np.int64), np.full(2, 1e-3), np.full((2, 2), 0.5), np.ones(2)
    assert len(finish_lines(rows, tokens, flags, flags, cost, gains, self_gains, 2, 1e-2, 1e-3)[0]) == 2
    for bad in (
        (rows, np.full(2, 3, dtype=np.int64), flags, flags, cost, gains, self_gains, 2),  # a draft past its gains
        (rows, tokens, flags, flags, cost, gains, self_gains, 3),  # a budget past the self-draft gains
        (rows, tokens, flags, flags, cost, gains[:1], self_gains, 2),  # fewer gains than rows
        (rows, tokens, flags[:1], flags, cost, gains, self_gains, 2),  # rows of different lengths
        (rows, tokens[:1], flags, flags, cost, gains, self_gains, 2),  # ... the drafts' lengths too
    ):
        with pytest.raises(IndexError):
            finish_lines(*bad, 1e-2, 1e-3)
