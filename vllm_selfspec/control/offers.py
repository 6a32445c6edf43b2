# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What each row of a step can draft, as the planner and the acceptance model read it.

`StepOffers` holds the step's rows as arrays, made once a step from what lookup found, so that
planning and pricing a step cost no Python per row that drafts nothing. `RowOffer` is one row's,
for a step built by hand (the tests) and for the planner's rarer paths (self-drafts, a draining
batch, retries), which reason row by row: `StepOffers.rows` makes them when such a path asks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from vllm_selfspec.control.acceptance import SOURCE_INDEX, SOURCES, DraftSource, token_bins


@dataclass
class RowOffer:
    """What one row of the batch can draft this step."""

    req_id: str = ""
    lookup_tokens: int = 0  # offered by lookup, from the row's own context or from history
    lookup_source: DraftSource = DraftSource.LOOKUP
    can_self_draft: bool = False  # budget left: may draft with the model (instead of lookup)
    sampled: bool = False  # temperature > 0: verifying its drafts costs a softmax each
    lookup_probs: tuple[float, ...] = ()  # per lookup token, see vllm_selfspec.sources.lookup
    lookup_match: int = 0
    remaining: int | None = None  # tokens the request may still emit (None: no limit known)
    has_mask: bool = False  # its prompt is probed already: a self-draft needs no probe
    context: int = 0  # tokens each of its logit rows attends over

    @property
    def tokens_left(self) -> float:
        return math.inf if self.remaining is None else self.remaining

    @functools.cached_property  # (asked several times a plan; an offer is not changed once made)
    def lookup_bins(self) -> list[tuple]:
        return token_bins(self.lookup_source, self.lookup_probs, self.lookup_match, self.lookup_tokens, self.sampled)


@dataclass(eq=False)
class StepOffers:
    """`RowOffer`'s fields over a step's rows, an array each (a row without a lookup draft
    offers 0 tokens; `probs` past a row's draft is not read, and a row whose draft has no
    probabilities, a prediction's, has `has_probs` False). Read-only once made: its arrays are
    the step's drafts' own (`sources.step_drafts.StepDrafts`)."""

    req_ids: list[str]
    lookup_tokens: np.ndarray  # int64
    sources: np.ndarray  # int64: each row's lookup source, by its index in SOURCES
    probs: np.ndarray  # float64, rows x at least the longest draft (and 1)
    has_probs: np.ndarray  # bool
    match: np.ndarray  # int64
    can_self_draft: np.ndarray  # bool
    sampled: np.ndarray  # bool
    remaining: np.ndarray  # float64: tokens the request may still emit (inf: no limit known)
    has_mask: np.ndarray  # bool
    context: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.req_ids)

    @staticmethod
    def of(rows: list[RowOffer]) -> StepOffers:
        """A step's offers from each row's."""
        width = max(max((max(r.lookup_tokens, len(r.lookup_probs)) for r in rows), default=0), 1)
        probs = np.ones((len(rows), width))
        for i, row in enumerate(rows):
            probs[i, : len(row.lookup_probs)] = row.lookup_probs
        return StepOffers(
            req_ids=[r.req_id for r in rows],
            lookup_tokens=np.array([r.lookup_tokens for r in rows], dtype=np.int64),
            sources=np.array([SOURCE_INDEX[DraftSource(r.lookup_source)] for r in rows], dtype=np.int64),
            probs=probs,
            has_probs=np.array([bool(r.lookup_probs) for r in rows], dtype=bool),
            match=np.array([r.lookup_match for r in rows], dtype=np.int64),
            can_self_draft=np.array([r.can_self_draft for r in rows], dtype=bool),
            sampled=np.array([r.sampled for r in rows], dtype=bool),
            remaining=np.array([r.tokens_left for r in rows], dtype=np.float64),
            has_mask=np.array([r.has_mask for r in rows], dtype=bool),
            context=np.array([r.context for r in rows], dtype=np.int64),
        )

    @functools.cached_property
    def rows(self) -> list[RowOffer]:
        """Each row's `RowOffer` (for the planner's paths that go row by row)."""
        lengths, probs = self.lookup_tokens.tolist(), self.probs.tolist()
        return [
            RowOffer(
                req_id=req_id,
                lookup_tokens=n,
                lookup_source=SOURCES[source],
                can_self_draft=can_self_draft,
                sampled=sampled,
                lookup_probs=tuple(probs[i][:n]) if has_probs else (),
                lookup_match=match,
                remaining=None if math.isinf(remaining) else int(remaining),
                has_mask=has_mask,
                context=context,
            )
            for i, (req_id, n, source, has_probs, match, can_self_draft, sampled, remaining, has_mask, context) in (
                enumerate(
                    zip(
                        self.req_ids,
                        lengths,
                        self.sources.tolist(),
                        self.has_probs.tolist(),
                        self.match.tolist(),
                        self.can_self_draft.tolist(),
                        self.sampled.tolist(),
                        self.remaining.tolist(),
                        self.has_mask.tolist(),
                        self.context.tolist(),
                    )
                )
            )
        ]
