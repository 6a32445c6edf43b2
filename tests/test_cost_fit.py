# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The step-cost fit's compiled solve (`control/cost_fit.py`) against SciPy's non-negative
least squares over the Cholesky factors of the same normal equations."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize

from vllm_selfspec.control.cost_fit import nonnegative_normal_solve
from vllm_selfspec.control.step_costs import LinearCost, self_step_cost, target_step_cost


def scipy_fit(cost: LinearCost) -> tuple[float, np.ndarray]:
    """The fit as SciPy solves it: what `ridge_nonnegative_fit` must agree with."""
    means = cost._sums / cost._sums[0, 0]
    mean_x, mean_y = means[0, 1:-1], means[0, -1]
    cov = means[1:-1, 1:-1] - np.outer(mean_x, mean_x)
    cross = means[1:-1, -1] - mean_x * mean_y
    share = np.asarray(cost.prior_share)
    prior = share * mean_y / (1 + share @ mean_x)
    strength = np.asarray(cost.ridge) * (np.diag(cov) + 1e-6 * (mean_x**2 + 1))
    lower = np.linalg.cholesky(cov + np.diag(strength))
    coef, _ = scipy.optimize.nnls(lower.T, np.linalg.solve(lower, cross + strength * prior))
    return max(mean_y - float(mean_x @ coef), 0.0), coef


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_fit_agrees_with_scipy(seed):
    rng = np.random.default_rng(seed)
    for trial in range(150):
        cost = target_step_cost() if trial % 3 else self_step_cost()
        k = len(cost.prior_share)
        for _ in range(int(rng.integers(2, 80))):
            # Features of mixed scales, some never seen (0) and some constant (every step alike),
            # and costs that rise, fall or ignore them: the fit meets all of these.
            features = rng.random(k) * rng.choice([0, 1, 10, 100], size=k)
            if trial % 5 == 0:
                features[:] = features[0]
            cost.observe(tuple(features), abs(0.1 + features @ rng.normal(scale=0.01, size=k) + rng.normal(scale=0.01)))
        intercept, coef = cost._solve()  # (not the settled fit's cache: the sums as they are now)
        expected_intercept, expected = scipy_fit(cost)
        assert np.all(coef >= 0)
        assert intercept == pytest.approx(expected_intercept, rel=1e-8, abs=1e-12)
        np.testing.assert_allclose(coef, expected, rtol=1e-7, atol=1e-12 * max(1.0, float(np.abs(expected).max())))


def test_a_feature_never_seen_keeps_its_prior():
    """A direction the data does not determine (sampling, before any request sampled) is pulled
    to its prior share of the mean step, however slight that pull against the data's scale."""
    cost = target_step_cost()
    for rows in (4, 8, 16) * 6:
        cost.observe((0, rows, 0, 0, 0, 0), 0.05 + 0.002 * rows)
    _, coef = cost._solve()
    assert coef[1] == pytest.approx(0.002, rel=1e-3)
    assert coef[0] == pytest.approx(scipy_fit(cost)[1][0], rel=1e-8) and coef[0] > 0


def test_the_solve_keeps_coefficients_non_negative_where_the_free_solution_does_not():
    normal = np.array([[2.0, 1.0], [1.0, 2.0]])
    right = np.array([-1.0, 1.0])  # free solution: (-1, 1)
    np.testing.assert_allclose(nonnegative_normal_solve(normal, right), [0.0, 0.5])
    np.testing.assert_allclose(nonnegative_normal_solve(normal, np.array([3.0, 3.0])), [1.0, 1.0])
    assert not nonnegative_normal_solve(normal, np.array([-1.0, -1.0])).any()
    # A coordinate that entered first and must leave: (0, 0.8), then both free would be (7, -2),
    # so the step stops where the second reaches 0, and the first alone gives (3, 0).
    coupled = np.array([[1.0, 2.0], [2.0, 5.0]])
    np.testing.assert_allclose(nonnegative_normal_solve(coupled, np.array([3.0, 4.0])), [3.0, 0.0], atol=1e-12)


def test_an_exact_line_is_fitted():
    """Steps whose seconds are 2 + 0.5 per row: the fit finds both, up to its light ridge."""
    cost = self_step_cost()
    for rows in (1, 2, 4, 8, 16) * 4:
        cost.observe((rows,), 2.0 + 0.5 * rows)
    intercept, (per_row,) = cost._solve()
    assert intercept == pytest.approx(2.0, rel=1e-2) and per_row == pytest.approx(0.5, rel=1e-2)


def added_by_numpy(sums, features, seconds: float, decay: float) -> np.ndarray:
    """The fit's decayed sums of z z', z = (1, features, seconds), as NumPy updated them (`sums`
    None: the first observation)."""
    z = np.concatenate(([1.0], features, [seconds]))
    if sums is None:
        return np.outer(z, z)
    sums *= decay
    sums += np.outer(z, z)
    return sums


def test_the_sums_update_in_one_call_is_numpys_to_the_last_bit():
    """`add_decayed` against the four NumPy calls it replaced (`sums *= decay; sums +=
    np.outer(z, z)`), over features of every scale the fit meets, the first update included."""
    from vllm_selfspec.control.cost_fit import add_decayed

    rng = np.random.default_rng(7)
    for k in (1, 6):
        compiled, by_numpy = np.zeros((k + 2, k + 2)), None
        for step in range(500):
            features = rng.random(k) * rng.choice([0, 1e-3, 1, 1e3, 1e6], size=k)
            seconds = float(rng.random() * rng.choice([1e-4, 1e-2, 1.0]))
            by_numpy = added_by_numpy(by_numpy, features, seconds, 0.98)
            add_decayed(compiled, features, seconds, 0.98 if step else 0.0)
            assert np.array_equal(compiled, by_numpy), step
    with pytest.raises(IndexError):  # (numba checks no index: the kernel does)
        add_decayed(np.zeros((3, 3)), np.zeros(2), 0.0, 0.98)


def test_a_learned_fit_keeps_the_sums_numpy_kept():
    """`LinearCost.observe`, as a step's costs are learned (its first observation, then decayed),
    keeps the sums the NumPy update kept, to the last bit."""
    rng = np.random.default_rng(8)
    cost, by_numpy = target_step_cost(), None
    for _ in range(300):
        rows, drafts = int(rng.integers(1, 64)), int(rng.integers(0, 32))
        features = (
            int(rng.integers(0, 500)),
            rows + drafts,
            int(rng.integers(0, rows + 1)),
            drafts > 0,
            False,
            0.1 * rows,
        )
        seconds = 2e-3 + 1e-4 * (rows + drafts) + rng.random() * 1e-4  # (never an outlier: all are kept)
        cost.observe(features, seconds)
        by_numpy = added_by_numpy(by_numpy, np.asarray(features, dtype=np.float64), seconds, cost.decay)
        assert np.array_equal(cost._sums, by_numpy)
    assert cost.samples == 300
