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

from vllm_selfspec.control.acceptance import SOURCE_INDEX, DraftSource
from vllm_selfspec.operations import fail_safe
from vllm_selfspec.operations.fail_safe import fault_point
from vllm_selfspec.request_slots import NO_SLOT, RequestSlots, widened
from vllm_selfspec.sources.prediction_cursor import TOKENS, TOKENS_LEN, PredictionCursor, follow_rows

PREDICTION_SOURCE = SOURCE_INDEX[DraftSource.PREDICTION]
NO_PREDICTION = NO_SLOT  # the slot of a request that sent none (or whose prediction was refused)


class _Pool:
    """Growing arrays that requests' arrays are appended to, side by side at the same offsets
    (a prediction's tokens and its credited flags; its index's keys and ends): all of them or,
    should growing fail, none."""

    def __init__(self, *dtypes):
        self.arrays, self.used = [np.zeros(256, dtype=dtype) for dtype in dtypes], 0

    def append(self, *values: np.ndarray) -> int:
        start, end = self.used, self.used + len(values[0])
        if end > len(self.arrays[0]):
            size = max(2 * len(self.arrays[0]), end)
            self.arrays = [np.concatenate((a[:start], np.zeros(size - start, dtype=a.dtype))) for a in self.arrays]
        for array, value in zip(self.arrays, values):
            array[start:end] = value
        self.used = end
        return start


class RequestPredictions(RequestSlots):
    """Every request seen: the slot of its prediction's arrays and cursor, or NO_PREDICTION."""

    def __init__(self, max_tokens: int):
        super().__init__()
        self.max_tokens = max_tokens  # (`max_prediction_tokens`)
        self.segments = np.zeros((0, 6), dtype=np.int64)
        self.state = np.zeros((0, 5), dtype=np.int64)
        self._new_pools()

    def _new_pools(self) -> None:
        # (tokens with their credited flags, distinct tokens, keys with their ends)
        self.tokens, self.distinct, self.keys = _Pool(np.int64, np.bool_), _Pool(np.int64), _Pool(np.int64, np.int64)
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
        credited = np.zeros(len(cursor.tokens), dtype=bool)
        segments = self._pooled(cursor.tokens, credited, cursor._distinct, cursor._keys, cursor._ends)
        slot = self._take(row.req_id)
        self.segments[slot], self.state[slot] = segments, 0
        self.live_tokens += len(cursor.tokens)
        return slot

    def _pooled(self, tokens, credited, distinct, keys, ends) -> tuple[int, ...]:
        """A request's arrays appended to the pools: its segments."""
        start, first_distinct = self.tokens.append(tokens, credited), self.distinct.append(distinct)
        return start, len(tokens), first_distinct, len(distinct), self.keys.append(keys, ends), len(keys)

    def tokens_of(self, slot: int) -> np.ndarray:
        start, length = self.segments[slot, TOKENS], self.segments[slot, TOKENS_LEN]
        return self.tokens.arrays[0][start : start + length]

    def follow(self, step, batch_rows: np.ndarray, slots: np.ndarray, budgets: np.ndarray, drafts, at) -> np.ndarray:
        """Move the cursors in `slots` (of batch rows `batch_rows`) along their outputs, and write
        each one's prediction draft, of at most its budget, into the step's `drafts`
        (`StepDrafts`) at its row `at`: returns each one's departures so far."""
        departures = np.zeros(len(slots), dtype=np.int64)
        follow_rows(
            slots, batch_rows, step.token_ids, step.prompt_lengths(batch_rows),
            np.asarray(step.context_lengths(batch_rows), dtype=np.int64), budgets,
            self.segments, self.state, *self.tokens.arrays, *self.distinct.arrays, *self.keys.arrays,
            at, drafts.tokens, drafts.lengths, drafts.match, drafts.sources, PREDICTION_SOURCE, departures,
        )  # fmt: skip
        return departures

    def drafts(self, step, rows, budgets, drafting: list[int], drafts, failed: list, lookup_max_match: int):
        """The drafting rows' prediction drafts (`drafting`: indices into `rows`, `StepRows`),
        into the step's `drafts` (`StepDrafts`), in one call (should it raise,
        each row alone, so that a fault is blamed on its row): returns, per row, whether its
        prediction draft stands without a lookup to compare. It does where the output has
        followed it since its first token, or for as long as a lookup can match. Otherwise (a
        prediction built to be left at every fourth token, say) the context's own repeats may
        draft better, and the longer match drafts."""
        stands_alone = np.zeros(len(rows), dtype=bool)
        if not np.count_nonzero(rows.predicted):  # (no row's request sent one: most steps of most servers)
            return stands_alone
        predicted_rows = rows.predicted
        drafting = [i for i in drafting if predicted_rows[i]]
        slots = self.slots(step, rows, drafting, failed)
        predicted = [(i, slot) for i, slot in zip(drafting, slots) if slot != NO_PREDICTION]
        if fail_safe.fault_hook is not None:  # (the tests' faults that one request causes)
            predicted = [(i, slot) for i, slot in predicted if self._hook_passes(rows, i, slot, failed)]
        if not predicted:
            return stands_alone
        at = np.array([i for i, _ in predicted], dtype=np.int64)
        slots = np.array([slot for _, slot in predicted], dtype=np.int64)
        batch_rows = rows.index[at]
        row_budgets = np.array(budgets, dtype=np.int64)[at]
        try:
            departures = self.follow(step, batch_rows, slots, row_budgets, drafts, at)
        except Exception:
            departures, kept = np.zeros(len(at), dtype=np.int64), np.ones(len(at), dtype=bool)
            for j in range(len(at)):
                one = slice(j, j + 1)
                try:
                    departures[j] = self.follow(step, batch_rows[one], slots[one], row_budgets[one], drafts, at[one])[0]
                except Exception as err:
                    failed.append((int(at[j]), rows[at[j]], err))
                    kept[j] = False
            at, departures = at[kept], departures[kept]
        drafted = drafts.lengths[at] > 0
        stands_alone[at] = drafted & ((departures == 0) | (drafts.match[at] >= lookup_max_match))
        return stands_alone

    def _hook_passes(self, rows, i: int, slot: int, failed: list) -> bool:
        try:
            fault_point("lookup", tokens=self.tokens_of(slot))
            return True
        except Exception as err:
            failed.append((i, rows[i], err))
            return False

    def _grow(self, old: int) -> None:
        self.segments, self.state = widened(self.segments, self.capacity), widened(self.state, self.capacity)

    def _freed(self, slot: int) -> None:
        self.live_tokens -= int(self.segments[slot, TOKENS_LEN])
        self.segments[slot] = 0
        if self.tokens.used > 2 * self.live_tokens + 4096:
            self._compact()

    def _compact(self) -> None:
        """Pool again only the live requests' arrays (what ended is dropped)."""
        (tokens, credited), (distinct,), (keys, ends) = self.tokens.arrays, self.distinct.arrays, self.keys.arrays
        old = self.segments.copy()
        self._new_pools()
        for slot in {s for s in self.slot_of.values() if s != NO_PREDICTION}:
            t, n, d, m, k, h = old[slot].tolist()
            self.segments[slot] = self._pooled(
                tokens[t : t + n], credited[t : t + n], distinct[d : d + m], keys[k : k + h], ends[k : k + h]
            )
            self.live_tokens += n


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
