# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The planner's greedy plan of lookup drafts, held to the per-row rule, as one compiled kernel
over the batch's arrays (rows x K): the same plan `DraftPlanner._greedy` makes token by token
in Python, which it still makes for plans with self-drafts (their tokens span rows).

At 64 rows with predictions the greedy takes hundreds of tokens a step and the per-row rule
gives most of them back, a few Python calls each; compiled, the whole plan costs less than
building its arrays. The arithmetic is the Python path's, operation for operation, so that the
two make the same plans to the last bit (tests/test_controller.py compares them). Like the
Python path, it takes a row's gains as never rising with depth (`AcceptanceModel.lookup_gains`:
products of rates below 1), so that a row's tokens are taken shallowest first. In three stages:

1. greedy: every lookup token, best gain per second first (ties: lower row, then shallower),
   while it beats the rate of the tokens taken so far by DRAFT_MARGIN; a token that would make
   the step longer than `max_seconds` is left, with its row's deeper tokens;
2. lift (`planner.keep_every_row_due`): each trusted row the step leaves short of its due
   lengthens its own draft while its tokens pay at plain decoding's rate;
3. give back, while some row is left short: the least paying deepest token of a row left its
   due without it, else of a row that does not bind, else the least paying (`planner.GiveBack`).

`steady_lookup_plan` is a steady step's whole lookup plan in one call: each row's price, plain
decoding's seconds, the rows that would rather self-draft, each row's trust and due, the sign
that every token binds, and the greedy above (`planner.lay_out_in_python`, the reference).
"""

from __future__ import annotations

import numpy as np

from vllm_selfspec.compiled import compiled

# The per-row rule's arguments when the plan is held to the batch's throughput instead.
NO_DUE = (0.0, 0.0, 0.0, np.zeros(0), np.zeros(0))


def warm_up() -> None:
    """Compile the kernel (or load it from numba's cache) at the engine's start, not in its
    first request's step."""
    gains, offered, cost = np.full((2, 1), 0.5), np.ones(2, dtype=np.int64), np.full(2, 1e-3)
    due = (0.01, 1e-3, 0.02, np.ones(2), np.zeros(2))
    greedy_lookup_plan(gains, offered, cost, 2.0, 0.01, np.inf, 0.2, True, due)
    flags, no = np.ones(2, dtype=np.bool_), np.zeros(2, dtype=np.bool_)
    offers = (offered, flags, np.full(2, 100, dtype=np.int64), flags, no, np.full(2, np.inf), offered)
    rule = (True, flags, np.zeros(2, dtype=np.int64), np.full((2, 1), -1, dtype=np.int64), offered, 16, 2, np.zeros(2))
    steady_lookup_plan(offers, gains, (1e-3, 1e-4, 0.0, 0.0, 1e-3), (0.5, True, False, True), (0.2, 0.02, 0.05), rule)


@compiled
def _allowance(t_plain, t_verify, row_slack, credited, ahead, own, drafted):
    """`RowProtection._allowance`: how much longer than plain's the step may be for a row."""
    extra = t_plain * ((1 + credited) / (1 - row_slack) - 1) + ahead
    return extra + (own + t_verify if drafted else 0.0)


@compiled
def _allowance_without(allowance, t_plain, t_verify, row_slack, gain, trusted, drafted):
    """`RowProtection.allowance_without`: a row's allowance once it gives back its deepest token."""
    return allowance - t_plain * gain * trusted / (1 - row_slack) - t_verify * (drafted == 1)


@compiled
def greedy_lookup_plan(gains, lengths_offered, cost, start_tokens, start_seconds, max_seconds, margin, protection, due):
    """(lookup lengths per row, the plan's expected tokens, its seconds).
    gains: (rows, K) expected tokens from each depth; lengths_offered: tokens offered per row;
    cost: seconds per token per row; protection: False for the batch's throughput (no per-row
    rule); due: (t_plain, t_verify, row_slack, trusted per row as 0/1, ahead per row)."""
    rows = len(cost)
    lengths = np.zeros(rows, dtype=np.int64)
    # The tokens taken, in the order taken: row, gain per second, gain (lifting takes only
    # offered tokens the greedy left: at most all offered in all).
    offered = int(lengths_offered.sum())
    taken_row, taken_ratio, taken_gain = np.empty(offered, np.int64), np.empty(offered), np.empty(offered)
    taken, tokens, seconds = _greedy(
        gains,
        lengths_offered,
        cost,
        (start_tokens, start_seconds, max_seconds, margin),
        lengths,
        taken_row,
        taken_ratio,
        taken_gain,
    )
    if not protection:
        return lengths, tokens, seconds
    t_plain, t_verify, row_slack, trusted, ahead = due
    drafted, own, credited = np.zeros(rows, np.int64), np.zeros(rows), np.zeros(rows)
    allowances = np.empty(rows)
    for i in range(rows):
        allowances[i] = _allowance(t_plain, t_verify, row_slack, 0.0, ahead[i], 0.0, 0)
    for j in range(taken):
        _take(taken_row[j], cost[taken_row[j]], taken_gain[j], 1, due, drafted, own, credited, allowances)
    taken_tokens, rule = (taken_row, taken_ratio, taken_gain), (drafted, own, credited, allowances)
    limits = (start_tokens / start_seconds, max_seconds)
    taken, tokens, seconds = _lift(
        gains, lengths_offered, cost, limits, due, lengths, taken_tokens, taken, tokens, seconds, rule
    )
    tokens, seconds = _give_back(cost, gains.shape[1], due, lengths, taken_tokens, taken, tokens, seconds, rule)
    return lengths, tokens, seconds


@compiled
def _greedy(gains, lengths_offered, cost, limits, lengths, taken_row, taken_ratio, taken_gain):
    """1. Every offered token, best gain per second first (stably over (row, depth) order),
    while it beats the rate so far by the margin; (tokens taken, expected tokens, seconds)."""
    tokens, seconds, max_seconds, margin = limits
    rows = len(cost)
    token_row, token_depth, ratio = (
        np.empty(len(taken_row), np.int64),
        np.empty(len(taken_row), np.int64),
        np.empty(len(taken_row)),
    )
    n = 0
    for i in range(rows):
        for d in range(lengths_offered[i]):
            token_row[n], token_depth[n], ratio[n] = i, d, gains[i, d] / cost[i]
            n += 1
    left_out = np.zeros(rows, dtype=np.bool_)
    taken = 0
    for k in np.argsort(-ratio, kind="mergesort"):
        i, d = token_row[k], token_depth[k]
        if left_out[i]:
            continue
        if not ratio[k] > (1 + margin) * (tokens / seconds):
            break
        if seconds + cost[i] > max_seconds:
            left_out[i] = True
            continue
        lengths[i] = d + 1
        taken_row[taken], taken_ratio[taken], taken_gain[taken] = i, ratio[k], gains[i, d]
        taken += 1
        tokens, seconds = tokens + gains[i, d], seconds + cost[i]
    return taken, tokens, seconds


@compiled
def _take(i, seconds_each, gain, sign, due, drafted, own, credited, allowances):
    """`RowProtection.take` for one row's token (`sign` -1: give it back)."""
    t_plain, t_verify, row_slack, trusted, ahead = due
    drafted[i] += sign
    own[i] += sign * seconds_each
    credited[i] += sign * gain * trusted[i]
    allowances[i] = _allowance(t_plain, t_verify, row_slack, credited[i], ahead[i], own[i], drafted[i])


@compiled
def _lift(gains, lengths_offered, cost, limits, due, lengths, taken_tokens, taken, tokens, seconds, rule):
    """2. Each trusted row short of its due when a pass starts, lowest first, lengthens its
    draft while its tokens pay at plain decoding's rate; (tokens taken, tokens, seconds)."""
    plain_rate, max_seconds = limits
    t_plain, trusted = due[0], due[3]
    taken_row, taken_ratio, taken_gain = taken_tokens
    drafted, own, credited, allowances = rule
    rows = len(cost)
    binding = np.zeros(rows, dtype=np.bool_)
    lifting = True
    while lifting:
        lifting = False
        for i in range(rows):
            binding[i] = seconds - t_plain > allowances[i]
        for i in range(rows):
            if not binding[i] or not trusted[i]:
                continue
            d = lengths[i]
            fits = d < lengths_offered[i] and seconds + cost[i] <= max_seconds
            if fits and gains[i, d] / cost[i] > plain_rate:
                lengths[i] += 1
                taken_row[taken], taken_ratio[taken], taken_gain[taken] = i, gains[i, d] / cost[i], gains[i, d]
                taken += 1
                _take(i, cost[i], gains[i, d], 1, due, drafted, own, credited, allowances)
                tokens, seconds, lifting = tokens + gains[i, d], seconds + cost[i], True
    return taken, tokens, seconds


@compiled
def _give_back(cost, depth, due, lengths, taken_tokens, taken, tokens, seconds, rule):
    """3. While some row is short of its due, give back the least paying deepest token of a row
    left its due without it, else of a row that does not bind, else the least paying;
    (tokens, seconds). Ranked by gain per second, best first (stably: a row's deeper tokens
    stay after its others), a row's deepest token is its last place not given back."""
    t_plain, t_verify, row_slack, trusted = due[0], due[1], due[2], due[3]
    taken_row, taken_ratio, taken_gain = taken_tokens
    drafted, own, credited, allowances = rule
    rows = len(cost)
    ranked = np.argsort(-taken_ratio[:taken], kind="mergesort")
    places = np.empty((rows, depth), dtype=np.int64)  # (a row's tokens: at most K)
    counted = np.zeros(rows, dtype=np.int64)
    for place in range(taken):
        i = taken_row[ranked[place]]
        places[i, counted[i]] = place
        counted[i] += 1
    given = np.zeros(taken, dtype=np.bool_)
    last = taken - 1
    while last >= 0:
        added = seconds - t_plain
        short, due_place, free_place = False, -1, -1  # (one pass: whether any row binds, and the choices)
        for i in range(rows):
            if added > allowances[i]:
                short = True
                continue
            if drafted[i] == 0:
                continue
            place = places[i, drafted[i] - 1]
            gain = taken_gain[ranked[place]]
            without = _allowance_without(allowances[i], t_plain, t_verify, row_slack, gain, trusted[i], drafted[i])
            if without >= added:
                due_place = max(due_place, place)
            else:
                free_place = max(free_place, place)
        if not short:
            break
        place = due_place if due_place >= 0 else (free_place if free_place >= 0 else last)
        i, gain = taken_row[ranked[place]], taken_gain[ranked[place]]
        given[place] = True
        while last >= 0 and given[last]:
            last -= 1
        lengths[i] -= 1
        _take(i, cost[i], gain, -1, due, drafted, own, credited, allowances)
        tokens, seconds = tokens - gain, seconds - cost[i]
    return tokens, seconds


@compiled
def steady_lookup_plan(offers, gains, step, self_drafting, limits, rule):
    """A steady step's lookup plan, as `planner.lay_out_in_python` makes it, to the last
    bit: (each row's price per token, plain decoding's seconds, the rows that would rather
    self-draft, their prices summed, their tokens left summed, whether any row offers a lookup
    draft, what the lookup plan came to, its lengths, tokens and seconds). What it came to: 0,
    none made (nothing offered, or not `plan`); 1, made; 2, every lookup token binds (plain's).
    offers: (lookup tokens, sampled, context, can self-draft, has a mask, tokens left, source
    index); gains: (rows, K) planned; step: (t0, t_row, t_sampled, t_context, t_verify);
    self_drafting: (self rate, self step measured, prompts waiting, plan); limits: (margin,
    row slack, first-token slack); rule: (protect rows, each slot's own trust, each row's slot,
    each token's bin (-1 past a draft), each bin's verified tokens, tokens a bin is trusted
    at, the prediction's source index, each row's seconds ahead)."""
    offered, sampled, context, can_self_draft, has_mask, remaining, sources = offers
    t0, t_row, t_sampled, t_context, t_verify = step
    self_rate, self_measured, prompts_waiting, plan = self_drafting
    margin, row_slack, first_token_slack = limits
    protect, own_trusted, slots, bins, bin_verified, trusted_at, prediction, ahead = rule
    rows = len(offered)
    _check_indices(offers, gains, protect and rows > 1, rule)
    cost, self_rows = np.empty(rows), np.zeros(rows, dtype=np.bool_)
    summed, self_cost, self_left, any_offered = 0.0, 0.0, 0.0, False
    for i in range(rows):
        price = t_row + t_sampled * sampled[i] + t_context * context[i] / 1000
        cost[i] = 1e-9 if price < 1e-9 else price  # (np.maximum's: NaN stays NaN)
        summed += cost[i]
        rather_self = offered[i] == 0 or (self_measured and gains[i, 0] < self_rate)
        self_rows[i] = can_self_draft[i] and rather_self and (has_mask[i] or not prompts_waiting)
        if self_rows[i]:
            self_cost += cost[i]
            self_left += remaining[i]
        any_offered |= offered[i] > 0
    plain_seconds = t0 + summed
    lengths = np.zeros(rows, dtype=np.int64)
    if not (plan and any_offered):
        return cost, plain_seconds, self_rows, self_cost, self_left, any_offered, 0, lengths, 0.0, 0.0
    max_seconds = plain_seconds * (1 + first_token_slack) if prompts_waiting else np.inf
    protected = protect and rows > 1
    trusted = np.zeros(rows)
    if protected:
        cheapest = np.inf  # (the offered rows' lowest price; NaN if any is, as NumPy's `min`)
        for i in range(rows):
            if offered[i] > 0 and (cost[i] < cheapest or np.isnan(cost[i])):
                cheapest = cost[i]
                if np.isnan(cheapest):
                    break
        blocking, blocking_unoffered = 0, False
        for i in range(rows):
            own = own_trusted[slots[i]]
            if not own and offered[i] > 0 and sources[i] != prediction:
                own = True
                for j in range(bins.shape[1]):
                    if bins[i, j] >= 0 and bin_verified[bins[i, j]] < trusted_at:
                        own = False
            # (a row behind its pace is credited nothing: its estimates have fallen short)
            trusted[i] = 1.0 if own and ahead[i] >= 0 else 0.0
            # `planner.every_lookup_token_binds`
            allowed = plain_seconds * ((1 + 0.0) / (1 - row_slack) - 1) + ahead[i]
            if trusted[i] == 0.0 and allowed < cheapest + (0.0 if offered[i] > 0 else t_verify):
                blocking += 1
                blocking_unoffered |= offered[i] == 0
        if blocking >= 2 or blocking_unoffered:
            return cost, plain_seconds, self_rows, self_cost, self_left, any_offered, 2, lengths, 0.0, 0.0
    due = (plain_seconds, t_verify, row_slack, trusted, ahead)
    lengths, tokens, seconds = greedy_lookup_plan(
        gains, offered, cost, float(rows), plain_seconds + t_verify, max_seconds, margin, protected, due
    )
    return cost, plain_seconds, self_rows, self_cost, self_left, any_offered, 1, lengths, tokens, seconds


@compiled
def _check_indices(offers, gains, protected, rule):
    """Raise if `steady_lookup_plan` would read outside its arrays (numba checks no index, and
    the kernel reads the step's arrays in place)."""
    offered, sampled, context, can_self_draft, has_mask, remaining, sources = offers
    rows = len(offered)
    lengths = (len(sampled), len(context), len(can_self_draft), len(has_mask), len(remaining), len(sources))
    if min(lengths) != rows or max(lengths) != rows:
        raise IndexError("a step's offers of different lengths")
    widest = 1
    for i in range(rows):
        widest = max(widest, offered[i])
    if gains.shape[0] != rows or gains.shape[1] < widest:
        raise IndexError("gains narrower than a row's lookup draft")
    if protected:
        _, own_trusted, slots, bins, bin_verified, _, _, ahead = rule
        if len(slots) != rows or len(ahead) != rows or bins.shape[0] != rows:
            raise IndexError("the per-row rule's arrays of another length than the step's")
        for i in range(rows):
            if not 0 <= slots[i] < len(own_trusted):
                raise IndexError("a row's request slot outside the trust array")
            for j in range(bins.shape[1]):
                if bins[i, j] >= len(bin_verified):
                    raise IndexError("a token's bin outside the bins")
