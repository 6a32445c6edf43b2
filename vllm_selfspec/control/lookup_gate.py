# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Whether looking up pays for itself.

Every row that may draft looks up every step, before any plan, so the lookup's time is paid
whether or not a draft is taken: on the step's critical path, for every request in the batch.
It is bounded (`vllm_selfspec.sources.lookup`), and usually small beside a step, but when what the
lookups find is rarely accepted (contexts that never repeat, a batch of hostile prompts) it buys
nothing. The gate weighs the seconds lookups took against the seconds their accepted tokens
saved (each accepted token saves a row its share of a step), over the last steps looked up; if
lookups cost more, it stops looking up and tries again after a back-off, as the planner retries
self-drafts, measuring afresh each time. One gate serves the whole batch: its decision is shared
by the tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_selfspec.control.backoff import FIRST_RETRY_AFTER, Backoff

__all__ = ["FIRST_RETRY_AFTER", "MIN_ROW_LOOKUPS", "LookupGate"]

MIN_ROW_LOOKUPS = 64  # row lookups measured before the gate ever closes


@dataclass
class LookupGate:
    decay: float = 0.9  # per step looked up: the last few dozen steps count
    row_lookups: float = 0.0
    seconds: float = 0.0  # that they took
    accepted: float = 0.0  # lookup tokens verification accepted of their drafts
    samples: int = 0
    backoff: Backoff = field(default_factory=Backoff)  # while closed: when to look up again

    def observe_lookup(self, rows: int, seconds: float) -> None:
        self.row_lookups = self.row_lookups * self.decay + rows
        self.seconds = self.seconds * self.decay + seconds
        self.accepted *= self.decay
        self.samples += rows

    def observe_accepted(self, tokens: int) -> None:
        self.accepted += tokens

    def pays(self, seconds_per_token: float | None) -> bool:
        """Whether lookups save more than they cost (`seconds_per_token`: what one token costs a
        row at this step's batch; None while the step costs are not known yet)."""
        return (
            seconds_per_token is None
            or self.samples < MIN_ROW_LOOKUPS
            or self.accepted * seconds_per_token >= self.seconds
        )

    def open(self, seconds_per_token: float | None) -> bool:
        """Whether to look up next step: while lookups pay, and once per back-off when not."""
        if seconds_per_token is None or self.samples < MIN_ROW_LOOKUPS:
            return True  # still measuring (the back-off stands)
        if self.pays(seconds_per_token):
            self.backoff.in_use()
            return True
        if not self.backoff.due():
            return False
        # A retry measures afresh (at least MIN_ROW_LOOKUPS of them) rather than against what
        # made the gate close, which may since have left the batch.
        self.backoff.retried()
        self.row_lookups = self.seconds = self.accepted = 0.0
        self.samples = 0
        return True
