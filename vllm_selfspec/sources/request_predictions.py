# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Every live request's prediction cursor (`prediction_cursor`), followed for a step's rows in
one compiled call.

A request's prediction, its index and its cursor are made at its first step (`PredictionCursor`)
and copied into pooled arrays: each request's slot holds where its arrays lie in the pools and
its cursor's state. A step hands the kernel its drafting rows' slots and the batch's token ids
as vLLM keeps them; the kernel moves each row's cursor along the output tokens it has not
followed yet and writes the prediction's next tokens into the step's drafts. No per-row Python
but a dict lookup for a row's slot. The pools keep a request's arrays until it ends; they are
compacted when what ended outweighs what lives, so memory stays bounded by the live requests'
predictions (each at most `max_prediction_tokens`).
"""

from __future__ import annotations

import numpy as np

from vllm_selfspec.compiled import compiled
from vllm_selfspec.control.acceptance import SOURCE_INDEX, DraftSource
from vllm_selfspec.sources.prediction_cursor import REJOIN_TOKENS, PredictionCursor, _follow

PREDICTION_SOURCE = SOURCE_INDEX[DraftSource.PREDICTION]
NO_PREDICTION = -1  # the slot of a request that sent none (or whose prediction was refused)
# A slot's segments: where its tokens (and credited flags), its distinct tokens and its index's
# keys (and ends) start in the pools, and their lengths.
TOKENS, TOKENS_LEN, DISTINCT, DISTINCT_LEN, KEYS, KEYS_LEN = range(6)
# A slot's cursor: position (-1 where lost), run, lost_at, departures, output tokens followed.
POSITION, RUN, LOST_AT, DEPARTURES, SEEN = range(5)


class _Pool:
    """A growing array that requests' arrays are appended to."""

    def __init__(self, dtype):
        self.array, self.used = np.zeros(256, dtype=dtype), 0

    def append(self, values: np.ndarray) -> int:
        start, end = self.used, self.used + len(values)
        if end > len(self.array):
            grown = np.zeros(max(2 * len(self.array), end), dtype=self.array.dtype)
            grown[: self.used] = self.array[: self.used]
            self.array = grown
        self.array[start:end], self.used = values, end
        return start


class RequestPredictions:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens  # (`max_prediction_tokens`)
        self.slot_of: dict[str, int] = {}  # every request seen: its slot, or NO_PREDICTION
        self._free: list[int] = []
        self.segments = np.zeros((0, 6), dtype=np.int64)
        self.state = np.zeros((0, 5), dtype=np.int64)
        self._new_pools()

    def _new_pools(self) -> None:
        self.tokens, self.credited = _Pool(np.int64), _Pool(np.bool_)
        self.distinct, self.keys, self.ends = _Pool(np.int64), _Pool(np.int64), _Pool(np.int64)
        self.live_tokens = 0  # pooled tokens of live requests (the rest ended)

    def slots(self, step, rows, drafting: list[int], failed: list) -> list[int]:
        """The slots of the rows `drafting` (by index into `rows`, `StepRows`), made now for a request seen
        for the first time (`step.prediction`: its prediction's token ids, or None). A row whose
        prediction cannot be read or indexed is appended to `failed` (index, row, error), with
        no slot."""
        slot_of, req_ids = self.slot_of, rows.req_ids
        slots = [slot_of.get(req_ids[i]) for i in drafting]
        if None in slots:
            for j, i in enumerate(drafting):
                if slots[j] is None:
                    try:
                        slots[j] = self._admit(step, rows[i])
                    except Exception as err:
                        failed.append((i, rows[i], err))
                        slots[j] = NO_PREDICTION
        return slots

    def _admit(self, step, row) -> int:
        tokens = step.prediction(row.index, self.max_tokens)
        if not tokens:
            self.slot_of[row.req_id] = NO_PREDICTION
            return NO_PREDICTION
        cursor = PredictionCursor(tokens)
        if not self._free:
            grown = max(2 * len(self.segments), 16)
            self._free = list(range(grown - 1, len(self.segments) - 1, -1))
            self.segments = np.concatenate((self.segments, np.zeros((grown - len(self.segments), 6), np.int64)))
            self.state = np.concatenate((self.state, np.zeros((grown - len(self.state), 5), np.int64)))
        slot = self.slot_of[row.req_id] = self._free.pop()
        self.segments[slot] = self._pooled(cursor.tokens, cursor._distinct, cursor._keys, cursor._ends)
        self.state[slot] = 0
        self.live_tokens += len(cursor.tokens)
        return slot

    def _pooled(self, tokens, distinct, keys, ends) -> tuple[int, ...]:
        """A request's arrays appended to the pools: its segments."""
        self.credited.append(np.zeros(len(tokens), dtype=bool))
        self.ends.append(ends)  # (where its keys lie)
        start, first_distinct = self.tokens.append(tokens), self.distinct.append(distinct)
        return start, len(tokens), first_distinct, len(distinct), self.keys.append(keys), len(keys)

    def tokens_of(self, slot: int) -> np.ndarray:
        start, length = self.segments[slot, TOKENS], self.segments[slot, TOKENS_LEN]
        return self.tokens.array[start : start + length]

    def follow(self, step, batch_rows: np.ndarray, slots: np.ndarray, budgets: np.ndarray, drafts, at) -> np.ndarray:
        """Move the cursors in `slots` (of batch rows `batch_rows`) along their outputs, and write
        each one's prediction draft, of at most its budget, into the step's `drafts`
        (`StepDrafts`) at its row `at`: returns each one's departures so far."""
        departures = np.zeros(len(slots), dtype=np.int64)
        follow_rows(
            slots, batch_rows, step.token_ids, step.prompt_lengths(batch_rows),
            np.asarray(step.context_lengths(batch_rows), dtype=np.int64), budgets,
            self.segments, self.state, self.tokens.array, self.credited.array,
            self.distinct.array, self.keys.array, self.ends.array,
            at, drafts.tokens, drafts.lengths, drafts.match, drafts.sources, PREDICTION_SOURCE, departures,
        )  # fmt: skip
        return departures

    def forget(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, NO_PREDICTION)
        if slot == NO_PREDICTION:
            return
        self.live_tokens -= int(self.segments[slot, TOKENS_LEN])
        self.segments[slot] = 0
        self._free.append(slot)
        if self.tokens.used > 2 * self.live_tokens + 4096:
            self._compact()

    def _compact(self) -> None:
        """Pool again only the live requests' arrays (what ended is dropped)."""
        old, (tokens, credited, distinct, keys, ends) = self.segments.copy(), (
            self.tokens.array, self.credited.array, self.distinct.array, self.keys.array, self.ends.array,
        )  # fmt: skip
        self._new_pools()
        for slot in {s for s in self.slot_of.values() if s != NO_PREDICTION}:
            t, n, d, m, k, h = old[slot].tolist()
            self.segments[slot] = self._pooled(tokens[t : t + n], distinct[d : d + m], keys[k : k + h], ends[k : k + h])
            start = self.segments[slot, TOKENS]
            self.credited.array[start : start + n] = credited[t : t + n]
            self.live_tokens += n

    def keep_only(self, live_requests) -> None:
        """Drop the requests the runner no longer holds, should one never be forgotten."""
        if len(self.slot_of) > 2 * len(live_requests) + 64:
            for req_id in [r for r in self.slot_of if r not in live_requests]:
                self.forget(req_id)


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
    """Compile the kernel (or load it from numba's cache) for the types a step passes (vLLM
    keeps token ids as int32) at the engine's start, not in its first request's step."""
    from types import SimpleNamespace

    from vllm_selfspec.sources.step_drafts import StepDrafts
    from vllm_selfspec.vllm_integration.runner_state import StepRows

    token_ids = np.array([[5, 1, 2, 3, 4, 0]], dtype=np.int32)
    step = SimpleNamespace(
        prediction=lambda row, limit: [1, 2, 9, 3, 4, 5][:limit],
        token_ids=token_ids,
        prompt_lengths=lambda rows: np.ones(len(rows), dtype=np.int64),
        context_lengths=lambda rows: [5] * len(rows),
    )
    predictions, drafts = RequestPredictions(16), StepDrafts.empty(1, 2)
    rows = StepRows.of([SimpleNamespace(req_id="warm-up", index=0)])
    slots = np.array(predictions.slots(step, rows, [0], []), dtype=np.int64)
    one = np.zeros(1, dtype=np.int64)
    predictions.follow(step, one, slots, np.full(1, 2, dtype=np.int64), drafts, one)
