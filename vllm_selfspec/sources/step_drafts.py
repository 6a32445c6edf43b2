# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A step's drafts that cost no forward, one per row, as arrays over the batch's rows: what
`RowLookup.find` fills (the rows' lookups in one compiled call per tenant's history, written in
place; a row looked up alone, where a batch's call failed, by `put`), what the
planner's offers are made of (`offers`), and what the planned tokens are taken from. A row
without a draft has length 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_selfspec.control.acceptance import SOURCE_INDEX, SOURCES, DraftSource
from vllm_selfspec.control.offers import StepOffers
from vllm_selfspec.sources.lookup import NO_DRAFT, LookupDraft

Found = tuple[DraftSource, LookupDraft]


@dataclass(eq=False)
class StepDrafts:
    tokens: np.ndarray  # int64, rows x the largest budget (at least 1)
    probs: np.ndarray  # float64, alike: each token's share of the occurrences (unread past a draft)
    lengths: np.ndarray  # int64
    match: np.ndarray  # int64: how many of the context's last tokens the draft matched
    sources: np.ndarray  # int64: each row's source, by its index in `acceptance.SOURCES`
    has_probs: np.ndarray  # bool (a prediction's tokens have none)

    @staticmethod
    def empty(rows: int, width: int) -> StepDrafts:
        width = max(width, 1)
        # (filled in place: np.ones and np.full are Python wrappers round the same, at a cost on
        # the host beside every GPU step)
        probs, sources = np.empty((rows, width)), np.empty(rows, dtype=np.int64)
        probs.fill(1.0)
        sources.fill(SOURCE_INDEX[DraftSource.LOOKUP])
        return StepDrafts(
            tokens=np.zeros((rows, width), dtype=np.int64),
            probs=probs,
            lengths=np.zeros(rows, dtype=np.int64),
            match=np.zeros(rows, dtype=np.int64),
            sources=sources,
            has_probs=np.zeros(rows, dtype=bool),
        )

    def put(self, row: int, found: Found) -> None:
        """The row's draft from `found`, in place of what it held."""
        source, draft = found
        n = len(draft)
        self.tokens[row, :n], self.lengths[row], self.match[row] = draft.tokens, n, draft.match
        self.sources[row], self.has_probs[row] = SOURCE_INDEX[source], bool(draft.probs)
        if draft.probs:  # (else unread: `has_probs` says so)
            self.probs[row, :n] = draft.probs

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    def __getitem__(self, row: int) -> Found:
        """The row's draft as one (NO_DRAFT without one)."""
        n = int(self.lengths[row])
        if not n:
            return SOURCES[self.sources[row]], NO_DRAFT
        probs = tuple(self.probs[row, :n].tolist()) if self.has_probs[row] else ()
        return SOURCES[self.sources[row]], LookupDraft(self.tokens[row, :n].copy(), probs, int(self.match[row]))

    def offers(self, step, rows, budgets: list[int], probed) -> StepOffers:
        """The rows' offers to the planner: each one's draft, and whether it may self-draft
        (`budgets`; `probed`: the requests whose prompts are measured already)."""
        req_ids = rows.req_ids
        return StepOffers(
            req_ids=req_ids,
            lookup_tokens=self.lengths,
            sources=self.sources,
            probs=self.probs,
            has_probs=self.has_probs,
            match=self.match,
            can_self_draft=np.array(budgets, dtype=bool),  # (budgets are never negative)
            sampled=rows.sampled,
            remaining=rows.tokens_left,
            has_mask=np.array([r in probed for r in req_ids], dtype=bool) if probed else np.zeros(len(rows), bool),
            context=np.asarray(step.context_lengths(rows.index), dtype=np.int64),
        )

    def taken(self, row: int, length: int) -> list[int]:
        """The row's first `length` draft tokens (at most its draft: rank 0's plan, which every
        rank follows, may plan a draft this rank did not find)."""
        return self.tokens[row, : min(length, int(self.lengths[row]))].tolist()
