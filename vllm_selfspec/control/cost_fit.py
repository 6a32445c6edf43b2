# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The step-cost fit's solve (`step_costs.LinearCost`), compiled: ridge-regularised least
squares with non-negative coefficients, from the decayed sums of (1, features, seconds) times
their transpose.

It is solved on its normal equations by the active-set method of Lawson and Hanson: the same
minimum as `scipy.optimize.nnls` over the Cholesky factors, found in one call on a few features.
A settled fit is solved every few steps, on the step's critical path, where NumPy's and SciPy's
small linear-algebra calls cost more than the whole compiled solve.
"""

from __future__ import annotations

import numpy as np

from vllm_selfspec.compiled import compiled

EPSILON = float(np.finfo(np.float64).eps)


@compiled
def ridge_nonnegative_fit(sums, prior_share, ridge):
    """(intercept, coefficients): `sums` is the (features + 2) square of decayed sums of
    z z' with z = (1, features, seconds); `prior_share[k]`: a unit of feature k costs that share
    of the mean step a priori; `ridge[k]`: the pull towards it, relative to the feature's variance."""
    n = sums.shape[0] - 2
    weight = sums[0, 0]
    mean_x = sums[0, 1 : n + 1] / weight
    mean_y = sums[0, n + 1] / weight
    normal = np.empty((n, n))
    for i in range(n):
        for j in range(n):
            normal[i, j] = sums[1 + i, 1 + j] / weight - mean_x[i] * mean_x[j]
    shifted = 1.0
    for i in range(n):
        shifted += prior_share[i] * mean_x[i]
    right = np.empty(n)
    for i in range(n):
        prior = prior_share[i] * mean_y / shifted
        strength = ridge[i] * (normal[i, i] + 1e-6 * (mean_x[i] ** 2 + 1))
        normal[i, i] += strength
        right[i] = sums[1 + i, n + 1] / weight - mean_x[i] * mean_y + strength * prior
    coef = nonnegative_normal_solve(normal, right)
    intercept = mean_y
    for i in range(n):
        intercept -= mean_x[i] * coef[i]
    return max(intercept, 0.0), coef


@compiled
def nonnegative_normal_solve(normal, right):
    """argmin over c >= 0 of c' normal c / 2 - right' c, `normal` symmetric positive definite
    (Lawson and Hanson's active set; a few features, so each subproblem is solved afresh)."""
    n = len(right)
    free = np.zeros(n, dtype=np.bool_)
    rejected = np.zeros(n, dtype=np.bool_)  # entered and left at once (rounding): not again until a step succeeds
    coef, trial = np.zeros(n), np.zeros(n)
    for _ in range(3 * n):
        # The coordinate whose gradient most favours rising from 0, past its rounding (per
        # coordinate: a direction the data leaves to the prior has a gradient near 0, not noise).
        best, entering = 0.0, -1
        for i in range(n):
            gradient, size = right[i], abs(right[i])
            for j in range(n):
                gradient -= normal[i, j] * coef[j]
                size += abs(normal[i, j] * coef[j])
            if not free[i] and not rejected[i] and gradient > 10 * EPSILON * size and gradient > best:
                best, entering = gradient, i
        if entering < 0:
            break
        free[entering] = True
        for inner in range(n + 1):
            _solve_free(normal, right, free, trial)
            step, blocking = 2.0, -1
            for i in range(n):
                if free[i] and trial[i] <= 0:
                    gap = coef[i] - trial[i]
                    ratio = coef[i] / gap if gap > 0 else 0.0
                    if ratio < step:
                        step, blocking = ratio, i
            if blocking < 0:
                coef[:] = trial
                rejected[:] = False
                break
            if inner == 0 and blocking == entering:
                rejected[entering] = True
            for i in range(n):
                coef[i] += step * (trial[i] - coef[i])
            coef[blocking], free[blocking] = 0.0, False
            for i in range(n):
                if free[i] and coef[i] <= 0:
                    free[i], coef[i] = False, 0.0
    return coef


@compiled
def _solve_free(normal, right, free, out):
    """`out` = the solution of `normal` z = `right` over the free coordinates, 0 elsewhere (by
    Cholesky's factors of the free block)."""
    index = np.flatnonzero(free)
    m = len(index)
    lower = np.zeros((m, m))
    for a in range(m):
        for b in range(a + 1):
            total = normal[index[a], index[b]]
            for k in range(b):
                total -= lower[a, k] * lower[b, k]
            lower[a, b] = np.sqrt(max(total, 1e-300)) if a == b else total / lower[b, b]
    solved = np.empty(m)
    for a in range(m):
        total = right[index[a]]
        for k in range(a):
            total -= lower[a, k] * solved[k]
        solved[a] = total / lower[a, a]
    for a in range(m - 1, -1, -1):
        total = solved[a]
        for k in range(a + 1, m):
            total -= lower[k, a] * solved[k]
        solved[a] = total / lower[a, a]
    out[:] = 0.0
    for a in range(m):
        out[index[a]] = solved[a]


@compiled
def add_decayed(sums, features, seconds, decay):
    """`sums` = `sums` x `decay` + z z', z = (1, features, seconds), in place: NumPy's
    `sums *= decay; sums += np.outer(z, z)` to the last bit, in one call instead of four."""
    n = len(features) + 2
    if sums.shape[0] != n or sums.shape[1] != n:  # (numba checks no index)
        raise IndexError("the cost fit's sums of another size than its features")
    z = np.empty(n)
    z[0], z[n - 1] = 1.0, seconds
    for i in range(len(features)):
        z[1 + i] = features[i]
    for i in range(n):
        for j in range(n):
            sums[i, j] = sums[i, j] * decay + z[i] * z[j]


def warm_up() -> None:
    """Compile the solve (or load it from numba's cache) at the engine's start."""
    sums = np.eye(3)
    ridge_nonnegative_fit(sums, np.zeros(1), np.ones(1))
    add_decayed(sums, np.zeros(1), 0.0, 0.5)
