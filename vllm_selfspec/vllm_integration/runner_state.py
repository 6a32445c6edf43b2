# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What the proposer reads of vLLM 0.32's model runner in one step: the batch's rows, their
token ids and requests, and the scheduler output of the step that just ran."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllm_selfspec.compiled import compiled
from vllm_selfspec.request_slots import RequestSlots, widened


class StepRow(NamedTuple):
    """A batch row that sampled a token this step (so it may draft), alone: `StepRows[i]`, for
    the paths that go row by row."""

    index: int  # row in the runner's input batch
    req_id: str
    tokens_left: int | None  # before max_tokens (None: no limit)
    sampled: bool  # temperature > 0
    may_draft: bool  # False: its sampling (min_p, logit_bias) is applied by the plain sampler only

    def draft_budget(self, k: int) -> int:
        """How many of k draft tokens the row can still use: verification emits accepted
        drafts plus one token, so a request with r tokens left can use at most r - 1."""
        return k if self.tokens_left is None else max(0, min(k, self.tokens_left - 1))


@dataclass(eq=False)
class StepRows:
    """The rows that sampled a token this step (so they may draft), as arrays, a row each: what
    a step reads of them costs no Python per row past their request ids."""

    index: np.ndarray  # int64: row in the runner's input batch
    req_ids: list[str]
    tokens_left: np.ndarray  # float64: before max_tokens (inf: no limit)
    sampled: np.ndarray  # bool: temperature > 0
    may_draft: np.ndarray  # bool: False where its sampling is the plain sampler's only (min_p, logit_bias)
    # bool: its request sent a prediction (`sources.prediction`); rows given one by one may have
    # sent one (whether it did is read where their predictions are)
    predicted: np.ndarray

    @staticmethod
    def of(rows) -> StepRows:
        """Rows given one by one (objects with `StepRow`'s fields; `index` and `req_id` at least)."""
        left = [getattr(row, "tokens_left", None) for row in rows]
        return StepRows(
            index=np.array([row.index for row in rows], dtype=np.int64),
            req_ids=[row.req_id for row in rows],
            tokens_left=np.array([math.inf if t is None else t for t in left], dtype=np.float64),
            sampled=np.array([getattr(row, "sampled", False) for row in rows], dtype=bool),
            may_draft=np.array([getattr(row, "may_draft", True) for row in rows], dtype=bool),
            predicted=np.ones(len(rows), dtype=bool),
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    def __getitem__(self, i: int) -> StepRow:
        left = float(self.tokens_left[i])
        return StepRow(
            int(self.index[i]), self.req_ids[i], None if math.isinf(left) else int(left),
            bool(self.sampled[i]), bool(self.may_draft[i]),
        )  # fmt: skip

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def budgets(self, k: int) -> np.ndarray:
        """`StepRow.draft_budget` of every row (0 where it may not draft)."""
        return draft_budgets(self.tokens_left, self.may_draft, k)


class StepShape(NamedTuple):
    """What the step that just ran computed (prompt chunks included: under load few steps are
    decode-only). A logit row is a position whose logits were computed."""

    prompt_tokens: int
    logit_rows: int
    sampled_rows: int
    draft_tokens: int
    context_read: int = 0  # context tokens the logit rows attend over, summed


@dataclass(frozen=True)
class RequestFacts:
    """What a request's sampling parameters say, read once, at its first step: they do not
    change over its life, and reading them costs Python on every row of every step."""

    max_tokens: int | None
    sampled: bool  # temperature > 0
    may_draft: bool  # False: its sampling (min_p, logit_bias) is applied by the plain sampler only
    stop_ids: frozenset[int]  # end-of-sequence and stop token ids
    predicted: bool = False  # it sent a prediction (read, and checked, where drafts are made of it)

    @staticmethod
    def of(params) -> RequestFacts:
        from vllm_selfspec.sources.prediction import PREDICTION_KEY
        from vllm_selfspec.vllm_integration.sampling_params import needs_plain_sampling

        if params is None:
            return RequestFacts(None, False, True, frozenset())
        stops = frozenset(params.stop_token_ids or ()) | {params.eos_token_id}
        predicted = PREDICTION_KEY in (getattr(params, "extra_args", None) or {})
        return RequestFacts(params.max_tokens, _samples(params), not needs_plain_sampling(params), stops, predicted)


class RequestTable(RequestSlots):
    """Each live request's `RequestFacts`, read at its first step, in slots of arrays, so that a
    step gathers its rows' facts at once. The caller keeps it from step to step and drops a
    request when it ends (`forget`)."""

    def __init__(self):
        super().__init__()
        self.max_tokens = np.zeros(0)  # float64 (inf: no limit)
        self.sampled, self.may_draft = np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
        self.predicted = np.zeros(0, dtype=bool)
        self.stop_ids: list[frozenset[int]] = []
        # Every live request's stop ids, each with how many live requests hold it: kept as
        # requests come and go, at the cost of reading their stop ids once, whatever their number.
        self.every_stop_id: dict = {}

    def slots(self, req_ids: list[str], requests) -> np.ndarray:
        """The requests' slots, their facts read now from `requests` (the runner's) where new."""
        slot_of = self.slot_of
        slots = list(map(slot_of.get, req_ids))  # (None where new; `map` iterates in C, for large batches)
        if None in slots:
            slots = [slot_of[r] if r in slot_of else self._admit(r, requests[r].sampling_params) for r in req_ids]
        return np.array(slots, dtype=np.int64)

    def _admit(self, req_id: str, params) -> int:
        facts, slot = RequestFacts.of(params), self._take(req_id)
        self.max_tokens[slot] = math.inf if facts.max_tokens is None else facts.max_tokens
        self.sampled[slot], self.may_draft[slot], self.stop_ids[slot] = facts.sampled, facts.may_draft, facts.stop_ids
        self.predicted[slot] = facts.predicted
        for stop_id in facts.stop_ids:
            self.every_stop_id[stop_id] = self.every_stop_id.get(stop_id, 0) + 1
        return slot

    def _grow(self, old: int) -> None:
        self.max_tokens, self.sampled = widened(self.max_tokens, self.capacity), widened(self.sampled, self.capacity)
        self.may_draft, self.predicted = widened(self.may_draft, self.capacity), widened(self.predicted, self.capacity)
        self.stop_ids.extend([frozenset()] * (self.capacity - old))

    def _freed(self, slot: int) -> None:
        for stop_id in self.stop_ids[slot]:
            held = self.every_stop_id.pop(stop_id) - 1
            if held:
                self.every_stop_id[stop_id] = held
        self.stop_ids[slot] = frozenset()


OUTPUT_TOKEN_IDS = operator.attrgetter("output_token_ids")
# Up to this many requests a step's shape is counted one by one; past it, its rows as arrays
# (whose NumPy calls cost more than a few requests' Python, and far less than hundreds').
FEW_REQUESTS = 48


class StepView:
    """`facts`: each live request's facts (`RequestTable`), kept by the caller from step to step
    (and dropped when the request ends); those missing are read here."""

    def __init__(self, runner, scheduler_output, sampled_token_ids: list[list[int]], facts: RequestTable | None = None):
        self.runner = runner
        self.batch = runner.input_batch
        self.scheduler_output = scheduler_output
        self.sampled_token_ids = sampled_token_ids
        self.req_ids = self.batch.req_ids
        self.facts = RequestTable() if facts is None else facts

    @property
    def num_rows(self) -> int:
        return len(self.sampled_token_ids)

    @property
    def admitted_requests(self) -> int:
        """How many new or resumed requests this step took in."""
        out = self.scheduler_output
        return len(out.scheduled_new_reqs) + len(out.scheduled_cached_reqs.resumed_req_ids)

    @property
    def engine_was_busy(self) -> bool:
        """Whether a request ran on from an earlier step. If none did, the engine may have
        waited for requests before this step (a server between arrivals), and a wait is no part
        of what the step cost."""
        cached = self.scheduler_output.scheduled_cached_reqs
        return any(req_id not in cached.resumed_req_ids for req_id in cached.req_ids)

    @property
    def finishing_rows(self) -> int:
        """Rows whose request ends with this step's tokens: at max_tokens, or on an end-of-sequence
        or stop token among them (stop strings end requests later, in the front end)."""
        rows, sampled = self.rows, self.sampled_token_ids
        ended = rows.tokens_left <= 0
        # (only if the step sampled some live request's stop id are the rows read one by one)
        if not self.facts.every_stop_id.keys().isdisjoint(itertools.chain.from_iterable(sampled)):
            stop_ids = self.facts.stop_ids
            for j, (i, slot) in enumerate(zip(rows.index.tolist(), self._slots.tolist())):
                ended[j] |= not stop_ids[slot].isdisjoint(sampled[i])
        return np.count_nonzero(ended)

    @functools.cached_property
    def rows(self) -> StepRows:
        """Rows that sampled a token this step (a partial prefill samples none)."""
        # (`map` and `compress` iterate in C: a few hundred rows cost a fraction of a comprehension's time)
        index = list(itertools.compress(range(len(self.sampled_token_ids)), self.sampled_token_ids))
        req_ids, requests = list(map(self.req_ids.__getitem__, index)), self.runner.requests
        slots = self._slots = self.facts.slots(req_ids, requests)
        outputs = map(OUTPUT_TOKEN_IDS, map(requests.__getitem__, req_ids))
        emitted = np.fromiter(map(len, outputs), dtype=np.float64, count=len(req_ids))
        return StepRows(
            np.array(index, dtype=np.int64),
            req_ids,
            self.facts.max_tokens[slots] - emitted,
            self.facts.sampled[slots],
            self.facts.may_draft[slots],
            self.facts.predicted[slots],
        )

    def verified_draft_tokens(self, req_id: str) -> int:
        """Draft tokens this step verified for the request (the scheduler pads a draft it cut
        short with -1, the only negative id it writes; counted in C, once per drafting row)."""
        drafts = self.scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
        return len(drafts) - drafts.count(-1)

    def accepted(self, row: int) -> int:
        """Draft tokens accepted in this row this step (the rest of its tokens is the bonus)."""
        return len(self.sampled_token_ids[row]) - 1

    def shape(self) -> StepShape | None:
        """What the step that ran computed: request by request in a step of a few (a few
        operations a request cost less than the NumPy calls that would gather the same); past
        FEW_REQUESTS, the rows that sampled a token as arrays (`_rows_counted_at_once`), and
        one by one only the requests left."""
        out = self.scheduler_output
        if not out.total_num_scheduled_tokens:
            return None
        scheduled, drafts = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens
        left, logit_rows, draft_tokens, sampled_rows, context_read = scheduled, 0, 0, 0, 0
        if len(scheduled) > FEW_REQUESTS:
            ran, (logit_rows, draft_tokens, sampled_rows, context_read) = self._rows_counted_at_once(out)
            # (a request that sampled nothing, or not in the batch, is left)
            left = scheduled.keys() - set(ran) if logit_rows - draft_tokens < len(scheduled) else ()
        slot_of, index = self.facts.slot_of, self.batch.req_id_to_index
        sampled, context = self.facts.sampled, self.batch.num_tokens_no_spec
        for req_id in left:
            rows_of_request = len(drafts[req_id]) + 1 if req_id in drafts else 1  # (a padded draft's -1s too)
            logit_rows, draft_tokens = logit_rows + rows_of_request, draft_tokens + rows_of_request - 1
            row = index.get(req_id, -1)
            if row >= 0:
                context_read += rows_of_request * int(context[row])
            slot = slot_of.get(req_id, -1)
            # (a request not read yet, one that sampled nothing, is read now: a partial prefill)
            if sampled[slot] if slot >= 0 else self.samples(req_id):
                sampled_rows += rows_of_request
        return StepShape(
            max(out.total_num_scheduled_tokens - len(scheduled) - draft_tokens, 0),
            logit_rows,
            sampled_rows,
            draft_tokens,
            context_read,
        )

    def _rows_counted_at_once(self, out) -> tuple[Iterator[str], tuple[int, int, int, int]]:
        """The scheduled rows that sampled a token, counted as arrays, and one by one only those
        with drafts, so that a row that drafted nothing costs no Python of its own (`map` and
        `fromiter` pass over it in C): their request ids (lazily), and their (logit rows, draft tokens,
        sampling logit rows, context read). As vLLM's batch keeps them, `req_id_to_index` is the
        inverse of `req_ids`. Reads `rows` (and so gives new rows their slots), which a step has
        read already."""
        scheduled, drafts, rows = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens, self.rows
        index, context, sampled = self.batch.req_id_to_index, self.batch.num_tokens_no_spec, self.facts.sampled
        ran = np.fromiter(map(scheduled.__contains__, rows.req_ids), dtype=bool, count=len(rows))
        logit_rows = int(np.count_nonzero(ran))
        sampled_rows = int(np.count_nonzero(rows.sampled & ran))
        context_read = int(context[rows.index[ran]].sum(dtype=np.int64))
        draft_tokens = 0
        for req_id, draft in drafts.items():  # (a padded draft's -1s count too)
            row = index.get(req_id, -1)
            if req_id in scheduled and 0 <= row < len(self.sampled_token_ids) and self.sampled_token_ids[row]:
                draft_tokens, logit_rows = draft_tokens + len(draft), logit_rows + len(draft)
                context_read += len(draft) * int(context[row])
                sampled_rows += len(draft) if sampled[self.facts.slot_of[req_id]] else 0
        return itertools.compress(rows.req_ids, ran), (logit_rows, draft_tokens, sampled_rows, context_read)

    def context_lengths(self, rows: np.ndarray | list[int]) -> np.ndarray:
        """Each row's context length (int64): its tokens up to its last sampled one."""
        return self.batch.num_tokens_no_spec[rows].astype(np.int64)

    def samples(self, req_id: str) -> bool:
        slot = self.facts.slot_of.get(req_id)
        if slot is not None:
            return bool(self.facts.sampled[slot])
        request = self.runner.requests.get(req_id)
        return _samples(request.sampling_params if request is not None else None)

    @property
    def token_ids(self) -> np.ndarray:
        """Every row's tokens, as vLLM keeps them (rows x max_model_len; a row's context is its
        first `context_lengths` tokens)."""
        return self.batch.token_ids_cpu

    def context(self, row: int) -> np.ndarray:
        """The row's tokens so far: prompt and output, up to its last sampled token."""
        return self.batch.token_ids_cpu[row, : self.batch.num_tokens_no_spec[row]]

    def prompt(self, row: int) -> np.ndarray:
        return self.batch.token_ids_cpu[row, : self.batch.num_prompt_tokens[row]]

    def output(self, row: int) -> np.ndarray:
        """The row's output so far, up to its last sampled token."""
        return self.batch.token_ids_cpu[row, self.batch.num_prompt_tokens[row] : self.batch.num_tokens_no_spec[row]]

    def prediction(self, row: int, limit: int) -> list[int] | None:
        """The token ids of the request's prediction (`vllm_selfspec.sources.prediction`), at most
        `limit` of them; None without one, or if any is not a token of the model's vocabulary
        (the front end refuses such ids; a request that came another way is not trusted)."""
        from vllm_selfspec.sources.prediction import PREDICTION_KEY, in_vocabulary

        params = self.runner.requests[self.req_ids[row]].sampling_params
        ids = (getattr(params, "extra_args", None) or {}).get(PREDICTION_KEY)
        ids = ids[:limit] if isinstance(ids, list) else None
        return ids if in_vocabulary(ids, self.runner.model_config.get_vocab_size()) else None

    def prompt_of(self, req_id: str) -> np.ndarray | None:
        """A live request's prompt by id (None if the runner no longer holds it)."""
        ids = getattr(self.runner.requests.get(req_id), "prompt_token_ids", None)
        return None if ids is None else np.asarray(ids, dtype=np.int64)

    def prompt_lengths(self, rows: list[int]) -> np.ndarray:
        return self.batch.num_prompt_tokens[rows].astype(np.int64)

    def last_positions(self, rows: list[int]) -> np.ndarray:
        """The position of each row's last sampled token: the first one without KV."""
        return self.batch.num_tokens_no_spec[rows].astype(np.int64) - 1

    def tokens_at(self, rows: list[int], positions: np.ndarray) -> np.ndarray:
        return self.batch.token_ids_cpu[rows, positions]


@compiled
def draft_budgets(tokens_left, may_draft, k):
    """`StepRows.budgets`: one call where NumPy made four (on the host beside every GPU step)."""
    budgets = np.zeros(len(tokens_left), dtype=np.int64)
    for r in range(len(tokens_left)):
        if may_draft[r]:
            budgets[r] = int(max(0.0, min(tokens_left[r] - 1, k)))  # (clamped as floats, then cast)
    return budgets


def warm_up() -> None:
    """Compile `draft_budgets` (or load it from numba's cache) at the engine's start."""
    draft_budgets(np.ones(1), np.ones(1, dtype=bool), 1)


# vLLM's SamplingParams.sampling_type is GREEDY below this temperature; read as vLLM reads
# it, without importing vLLM, so that the pure stages' benchmark runs where vLLM is absent.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _samples(params) -> bool:
    """Whether a request samples (temperature > 0) rather than taking the argmax."""
    return params is not None and params.temperature >= GREEDY_BELOW_TEMPERATURE
