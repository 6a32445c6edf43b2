# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The plan for a draining batch (an offline batch that admits nobody: only its end counts).
Every row drafts to a common finish line r steps nearer, lookup where its draft is long enough,
else self-draft; the best r, net of what it costs, or no draft.

Pricing a line takes the product over rows of each one's chance to reach every token before
it: rows x K^2 products a step, which in Python cost milliseconds at a few hundred rows. One
compiled pass prices every line over the batch's arrays (`finish_lines`); the few lines it
returns are chosen among in Python, where the self-draft step's seconds are the fitted model's.
The arithmetic is the row-by-row reference's (tests/test_draining_plan.py), operation for
operation, floats summed left to right, so that the two make the same plans to the last bit.
"""

from __future__ import annotations

import numpy as np

from vllm_selfspec.compiled import compiled


@compiled
def finish_lines(lead, lookup_tokens, may_self_draft, has_mask, cost, gains, self_gains, self_budget, t0, t_verify):
    """Each finish line's price, for each line r = 1, 2, ... it could price (a line some row can
    reach neither by lookup nor by self-drafting ends them: no farther line is reachable either),
    as arrays a line each: the seconds the batch's end comes nearer plus the drafts' verified
    worth; verification's and the lookup drafts' seconds (the self-drafts' apart); the
    self-drafting rows' draft steps; how many rows self-draft; and of those, how many need
    their prompt probed first. `lead`: how many tokens each
    row is ahead of the last ones (inf: a row without a limit beside rows with one); `gains`:
    rows x depth, each lookup token's chance to be accepted with every one before it;
    `self_gains[j - 1]`: a self-draft's j-th token's; `may_self_draft`: its budget and the
    self-draft step's cost measured. Every index is checked before anything is read: a compiled
    kernel reads past an array's end without a word."""
    rows = len(lead)
    if len(lookup_tokens) != rows or len(may_self_draft) != rows or len(has_mask) != rows or len(cost) != rows:
        raise IndexError("per-row arrays of different lengths")
    if len(self_gains) < self_budget or gains.shape[0] < rows:
        raise IndexError("fewer gains than rows, or than the self-draft budget")
    last = self_budget
    for i in range(rows):
        if lookup_tokens[i] > gains.shape[1]:
            raise IndexError("a lookup draft longer than its gains")
        last = max(last, lookup_tokens[i])
    saved, spent = np.zeros(last), np.zeros(last)
    self_length, self_rows, probes = np.zeros(last, np.int64), np.zeros(last, np.int64), np.zeros(last, np.int64)
    need, by_self = np.zeros(rows, np.int64), np.zeros(rows, np.bool_)
    priced = 0
    for line in range(1, last + 1):
        reachable = True
        for i in range(rows):
            n = line - lead[i]
            need[i] = int(n) if n > 0 else 0
            by_self[i] = need[i] > 0 and lookup_tokens[i] < need[i]
            if by_self[i] and not (may_self_draft[i] and self_budget >= need[i]):
                reachable = False
        if not reachable:
            break
        priced = line
        # E[min over rows of (lead + accepted)], counted in whole tokens up to the line.
        nearer = 0.0
        for y in range(1, line + 1):
            product = 1.0
            for i in range(rows):
                if y > lead[i]:
                    depth = int(y - lead[i]) - 1
                    product *= self_gains[depth] if by_self[i] else gains[i, depth]
            nearer += product
        worth, drafted = 0.0, 0.0
        for i in range(rows):
            accepted = 0.0
            for depth in range(need[i]):
                accepted += self_gains[depth] if by_self[i] else gains[i, depth]
            worth += cost[i] * accepted
            drafted += cost[i] * need[i]
            if by_self[i]:
                self_length[line - 1] = max(self_length[line - 1], need[i])
                self_rows[line - 1] += 1
                if not has_mask[i]:
                    probes[line - 1] += 1
        saved[line - 1] = t0 * nearer + worth
        spent[line - 1] = t_verify + drafted
    return saved[:priced], spent[:priced], self_length[:priced], self_rows[:priced], probes[:priced]


def warm_up() -> None:
    """Compile the kernel (or load it from numba's cache) at the engine's start, not in its
    first request's step."""
    flags, tokens = np.ones(2, dtype=np.bool_), np.full(2, 2, dtype=np.int64)
    gains, self_gains = np.full((2, 2), 0.5), np.full(2, 0.5)
    finish_lines(np.zeros(2), tokens, flags, flags, np.full(2, 1e-3), gains, self_gains, 2, 1e-2, 1e-3)
