# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What the proposer learns from each step once it has run: the step's time against what it
computed (`control.step_costs`), and what verification made of each row's draft
(`control.acceptance`). `StepLessons` remembers the drafts it proposed until they are verified,
and when the last step ended, so that the next call can time it. No vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_selfspec.control import Calibration, DraftController, DraftSource
from vllm_selfspec.control.acceptance import NO_CALIBRATION, SOURCE_INDEX, SOURCES, VerifiedDraft
from vllm_selfspec.operations.counters import ProposerCounters, prompt_key


class DraftMade(NamedTuple):
    """A row's draft this step, to learn from when it has been verified. (A tuple: every
    drafting row of every step makes one.)"""

    source: DraftSource
    length: int
    calibration: Calibration  # its lookup tokens' bins and priors
    expected: float = 0.0  # lookup tokens the planner expected to be accepted, as it planned
    estimated: float = 0.0  # the same before its calibration scaled them (what that learns from)


@dataclass
class StepLessons:
    controller: DraftController
    counters: ProposerCounters
    drafted: dict[str, DraftMade] = field(default_factory=dict)
    step_end: float | None = None  # when the proposer last returned drafts
    steps_run: int = 0  # steps the runner began (`note_step`)
    proposed_at: int = -1  # the step of the last call for drafts

    def note_step(self) -> None:
        self.steps_run += 1

    def learn(self, step) -> None:
        """Feed the controller the step that just ran. A step that found the engine idle is not
        timed: its time since the last step includes the wait for requests, which under
        open-loop arrivals precedes most prompts and would be charged to their tokens."""
        now = time.perf_counter()
        # vLLM skips the proposer in some steps (a request within K tokens of max_model_len):
        # then neither the time since the last call nor this step's tokens say what the last
        # call's drafts did.
        follows_last_call = self.proposed_at == self.steps_run - 1
        shape = step.shape()
        if self.step_end is not None and shape is not None and step.engine_was_busy and follows_last_call:
            seconds = now - self.step_end
            self.controller.observe_step(
                shape.prompt_tokens,
                shape.logit_rows,
                shape.sampled_rows,
                seconds,
                shape.draft_tokens,
                shape.context_read,
            )
            self.counters.steps.append(
                (shape.prompt_tokens, shape.logit_rows, shape.sampled_rows, shape.draft_tokens, seconds)
            )
            self.counters.steps_timed += 1
        self.step_end = None
        accepted, verified = None, []
        if follows_last_call:  # (a row that drafted nothing accepted nothing: it costs no lesson)
            accepted = {
                row.req_id: self._learn_row(step, row, verified) if row.req_id in self.drafted else 0
                for row in step.rows
            }
            self.controller.observe_drafts(verified)
        # The per-row rule's ledger settles the step as planned only if it ran as planned: every
        # draft verified whole (a step beside a prefill, whose drafts the scheduler withheld,
        # cost what a plain one does, not what was planned).
        as_planned = accepted is not None and None not in accepted.values()
        self.controller.observe_rows(accepted if as_planned else None)
        self.drafted = {}

    def _learn_row(self, step, row, learned: list[VerifiedDraft]) -> int | None:
        """What verification made of the row's draft, appended to `learned` (for the acceptance
        model to learn a step's drafts at once): its accepted tokens (None: the scheduler cut the
        draft short or withheld it)."""
        made = self.drafted[row.req_id]
        verified = min(made.length, step.verified_draft_tokens(row.req_id))
        self.counters.draft_tokens_withheld += made.length - verified
        if not verified:
            return None
        accepted = min(step.accepted(row.index), verified)
        learned.append(VerifiedDraft(row.req_id, made.source, verified, accepted, made.calibration, made.estimated))
        cut_short = verified < made.length
        if made.source == DraftSource.PREDICTION:  # (not the lookup gate's: predictions cost no lookup)
            self.counters.prediction_accepted += accepted
        elif made.source != DraftSource.SELF:
            self.controller.observe_lookup_accepted(accepted)
            self.counters.lookup_accepted += accepted
            self.counters.lookup_expected += made.expected
            self.counters.lookup_estimated += made.estimated
        return None if cut_short else accepted

    def lookup_drafts_taken(self, prepared, rows: list[int], lengths: list[int]) -> None:
        """What to learn from a step's lookup drafts once they are verified (its rows `rows`,
        `lengths` tokens each): their tokens' bins, and how many of them the planner expected
        accepted (`prepared.gains`, as it planned)."""
        if not rows:
            return
        gains, offers, tokens = prepared.gains, prepared.offers, [0] * len(SOURCES)  # (tokens: by source)
        planned, estimated = gains.expected(rows, lengths)
        # (rank 0's plan, which every rank follows, may draft a row past the draft this rank found)
        offered, sources, made = offers.lookup_tokens.tolist(), offers.sources.tolist(), {}
        for row, length, expected, unscaled in zip(rows, lengths, planned, estimated):
            calibration = gains.calibration(row, min(length, offered[row]))
            made[offers.req_ids[row]] = DraftMade(SOURCES[sources[row]], length, calibration, expected, unscaled)
            tokens[sources[row]] += length
        self.drafted.update(made)  # (all of the step's lessons or, should making them fail, none)
        counters = self.counters
        counters.lookup_tokens += sum(lengths)
        counters.history_tokens += tokens[SOURCE_INDEX[DraftSource.HISTORY]]
        counters.prediction_tokens += tokens[SOURCE_INDEX[DraftSource.PREDICTION]]
        counters.context_tokens += tokens[SOURCE_INDEX[DraftSource.LOOKUP]]

    def self_drafted(self, req_id: str, length: int) -> None:
        self.drafted[req_id] = DraftMade(DraftSource.SELF, length, NO_CALIBRATION)

    def step_ended(self, *, drafted: bool) -> None:
        """The proposer is about to return this step's drafts (none if not `drafted`: then
        there is nothing to learn from the step after)."""
        if not drafted:
            self.drafted = {}
            self.controller.observe_rows(None)  # (the plan's drafts were not made)
        self.step_end = time.perf_counter()

    def call_ended(self) -> None:
        """The proposer was asked for drafts in this step, whatever came of it."""
        self.proposed_at = self.steps_run

    def probed(self, probe) -> None:
        """Prompts measured for self-drafting (`self_drafting.drafter.ProbeResult`)."""
        for m in probe.measurements:
            self.counters.measurements.append((prompt_key(m.prompt), m.attention_similarity, m.mlp_similarity, m.mask))
        self.counters.prompts_measured += len(probe.measurements)
        self.counters.prompt_tokens_measured += probe.tokens
        self.counters.probe_seconds += probe.seconds
        self.controller.observe_probe(len(probe.measurements), probe.seconds)

    def self_drafts_ran(self, run) -> None:
        """A batch of self-drafts (`self_drafting.drafter.DraftRun`): each draft step's rows and time."""
        for rows, seconds in zip(run.step_rows, run.step_seconds):
            self.controller.observe_self_step(rows, seconds)
        self.counters.draft_steps += len(run.step_rows)
        self.counters.draft_calls += 1
        self.counters.draft_tokens += run.tokens
        self.counters.draft_seconds += run.seconds
