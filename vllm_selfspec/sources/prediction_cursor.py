# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Where an output stands in its prediction (OpenAI's `prediction`, `vllm_selfspec.sources.prediction`).

A `PredictionCursor` stands where the output is in its prediction: each output token that
equals the prediction's token at the cursor moves it on (a token the output used); any other
token loses it, and the cursor looks for where the output rejoins the prediction: a place whose
preceding `REJOIN_TOKENS` tokens equal the output's last ones, the first at or after where the
cursor was lost (an edit in the middle of a file resumes after the edit, not at an earlier copy
of the same lines), else the last before it. While it stands somewhere, the prediction's next
tokens are the row's draft. The same cursor counts the usage OpenAI reports
(`prediction.prediction_usage`). Pure: no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_selfspec.compiled import compiled

# Output tokens that must equal the prediction's before the cursor rejoins it: one or two
# tokens (a space, a bracket) recur everywhere in code and prose; three seldom recur by chance.
REJOIN_TOKENS = 3


class PredictionCursor:
    """Where an output stands in its prediction. Work per output token is bounded whatever the
    prediction holds: constant where the output follows it, and a few binary searches of an
    index built once (O(log P)) where the cursor looks for the way back, however often the
    output's last tokens recur in the prediction. Memory is a few arrays of its length."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.position: int | None = 0  # the prediction's token the output's next token should be
        self.lost_at = 0  # where the cursor last stood before the output departed
        self.departures = 0  # times the output departed from the prediction
        self.seen = 0  # output tokens followed so far
        # Output tokens that equalled the prediction's in a row where the cursor stands (those
        # that found the way back count): the longer, the likelier the next draft holds, as a
        # lookup's match length says (`control.acceptance.token_bins`).
        self.run = 0
        self.credited = np.zeros(len(self.tokens), dtype=bool)  # prediction tokens the output used
        # The index: every REJOIN_TOKENS-gram as one exact key (its tokens renumbered densely, so
        # that the key fits 64 bits whatever the vocabulary), sorted by key, then by position.
        self._distinct = np.unique(self.tokens)
        keys = _gram_keys(np.searchsorted(self._distinct, self.tokens), base=len(self._distinct))
        order = np.argsort(keys, kind="stable")
        self._keys, self._ends = keys[order], np.arange(REJOIN_TOKENS, len(self.tokens) + 1)[order]

    @property
    def used(self) -> int:
        return int(self.credited.sum())

    def follow(self, output: Sequence[int] | np.ndarray) -> None:
        """Move along the output's tokens not followed yet (`output`: the whole output so far)."""
        # Only the new tokens and the few before them that a rejoin compares are read, so that
        # a step costs the same early in a long output as late.
        start = max(0, self.seen - REJOIN_TOKENS + 1)
        new = np.ascontiguousarray(output[start:], dtype=np.int64)
        state = (-1 if self.position is None else self.position, self.run, self.lost_at, self.departures)
        index = (self._distinct, self._keys, self._ends)
        position, self.run, self.lost_at, self.departures = _follow(
            self.tokens, new, self.seen - start, *state, self.credited, *index
        )
        self.position = None if position < 0 else position
        self.seen = start + len(new)

    def draft(self, max_tokens: int) -> np.ndarray:
        """The prediction's next tokens where the cursor stands (none where it is lost)."""
        if self.position is None or max_tokens <= 0:
            return self.tokens[:0]
        return self.tokens[self.position : self.position + max_tokens]


# A cursor follows every drafting row's output every step, and counts usage on the API server:
# compiled, a step's few tokens cost about what one call costs.
@compiled
def _follow(tokens, new, first, position, run, lost_at, departures, credited, distinct, keys, ends):
    """`PredictionCursor.follow` over `new[first:]` (the tokens before `first` are there for a
    rejoin to compare): the cursor's (position, -1 where lost; run; lost_at; departures)."""
    for i in range(first, len(new)):
        at = position
        if 0 <= at < len(tokens) and tokens[at] == new[i]:
            credited[at] = True
            position, run = at + 1, run + 1
            continue
        if at >= 0:
            lost_at, departures = at, departures + 1
        position = _rejoin(new[max(0, i + 1 - REJOIN_TOKENS) : i + 1], lost_at, distinct, keys, ends)
        run = 0 if position < 0 else REJOIN_TOKENS
        if position >= 0:  # the tokens that found the way back were used too
            credited[position - REJOIN_TOKENS : position] = True
    return position, run, lost_at, departures


@compiled
def _rejoin(tail, lost_at, distinct, keys, ends):
    """Just after a place where the prediction's tokens equal `tail` (the output's last
    REJOIN_TOKENS): the first at or after `lost_at`, else the last before it; -1 if none.
    Four binary searches, however many places match."""
    if len(tail) < REJOIN_TOKENS or len(keys) == 0:
        return -1
    base, key = len(distinct), 0
    for token in tail:  # (renumbered densely, as `_gram_keys` makes a key)
        dense = min(np.searchsorted(distinct, token), base - 1)
        if distinct[dense] != token:
            return -1  # a token the prediction never holds
        key = key * base + dense
    lo, hi = np.searchsorted(keys, key, side="left"), np.searchsorted(keys, key, side="right")
    if lo == hi:
        return -1
    ahead = lo + np.searchsorted(ends[lo:hi], lost_at, side="left")  # (places ascend)
    return ends[ahead] if ahead < hi else ends[hi - 1]


# Many cursors as arrays (`request_predictions.RequestPredictions`), here beside the cursor they
# run: numba's cache does not see a change to a function another file's kernel calls.
# A cursor's segments: where its tokens (and credited flags), its distinct tokens and its
# index's keys (and ends) start in the pools, and their lengths.
TOKENS, TOKENS_LEN, DISTINCT, DISTINCT_LEN, KEYS, KEYS_LEN = range(6)
# A cursor's state: position (-1 where lost), run, lost_at, departures, output tokens followed.
POSITION, RUN, LOST_AT, DEPARTURES, SEEN = range(5)


@compiled
def follow_rows(
    slots, rows, token_ids, prompt_lengths, context_lengths, budgets,
    segments, state, tokens, credited, distinct, keys, ends,
    at, out_tokens, out_lengths, out_match, out_sources, source, departures,
):  # fmt: skip
    """`PredictionCursor.follow` and `draft` for each slot r over its pooled arrays
    (`RequestPredictions`), along its row's output (`token_ids[rows[r], prompt_lengths[r]:
    context_lengths[r]]`): its draft of at most `budgets[r]` tokens, where its cursor stands,
    into the step's drafts at row `at[r]` (tokens, length, its run as the match, `source`), and
    its departures so far into `departures[r]`."""
    for r in range(len(slots)):
        slot = slots[r]
        t, n, d, m, k, h = segments[slot]
        seen = state[slot, SEEN]
        start = max(0, seen - REJOIN_TOKENS + 1)
        new = token_ids[rows[r], prompt_lengths[r] + start : context_lengths[r]]
        position, run, lost_at, departed = _follow(
            tokens[t : t + n], new, seen - start,
            state[slot, POSITION], state[slot, RUN], state[slot, LOST_AT], state[slot, DEPARTURES],
            credited[t : t + n], distinct[d : d + m], keys[k : k + h], ends[k : k + h],
        )  # fmt: skip
        state[slot, POSITION], state[slot, RUN], state[slot, LOST_AT] = position, run, lost_at
        state[slot, DEPARTURES], state[slot, SEEN] = departed, start + len(new)
        departures[r] = departed
        length = min(budgets[r], n - position, out_tokens.shape[1]) if position >= 0 else 0
        if length > 0:
            out_tokens[at[r], :length] = tokens[t + position : t + position + length]
            out_lengths[at[r]], out_match[at[r]], out_sources[at[r]] = length, run, source


def warm_up() -> None:
    """Compile the cursor (or load it from numba's cache) at a process's start, not in a step
    or in the first usage counted."""
    PredictionCursor([1, 2, 3, 4, 5]).follow(np.array([1, 2, 9, 3, 4, 5]))


def _gram_keys(dense: np.ndarray, base: int) -> np.ndarray:
    """One int64 key per REJOIN_TOKENS-gram of `dense` (tokens renumbered 0..base-1): equal keys
    are equal grams (a prediction is capped far below the 2**21 distinct tokens that would
    overflow)."""
    if len(dense) < REJOIN_TOKENS:
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(dense.astype(np.int64), REJOIN_TOKENS)
    keys = np.zeros(len(windows), dtype=np.int64)
    for j in range(REJOIN_TOKENS):
        keys = keys * np.int64(base) + windows[:, j]
    return keys
