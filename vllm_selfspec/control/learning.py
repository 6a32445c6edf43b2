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

import numpy as np

from vllm_selfspec.control import DraftController, DraftSource
from vllm_selfspec.control.acceptance import SOURCE_INDEX
from vllm_selfspec.control.request_rates import DraftsMade
from vllm_selfspec.operations.counters import ProposerCounters, prompt_key


@dataclass
class StepLessons:
    controller: DraftController
    counters: ProposerCounters
    made: DraftsMade | None = None  # the step's lookup drafts
    self_made: dict[str, int] = field(default_factory=dict)  # ... and self-drafts (req_id: length)
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
                (*shape[:4], seconds, shape.context_read)  # (prompt tokens, logit rows, sampled rows, drafts)
            )
            self.counters.steps_timed += 1
        self.step_end = None
        # (a row that drafted nothing accepted nothing: it costs no lesson)
        accepted = self._learn_drafts(step) if follows_last_call else None
        # The per-row rule's ledger settles the step as planned only if it ran as planned: every
        # draft verified whole (a step beside a prefill, whose drafts the scheduler withheld,
        # cost what a plain one does, not what was planned).
        as_planned = accepted is not None and None not in accepted.values()
        self.controller.observe_rows(accepted if as_planned else None)
        self.made, self.self_made = None, {}

    def _learn_drafts(self, step) -> dict[str, int | None]:
        """What verification made of the last call's drafts, learned at once, in the step's row
        order: each row's accepted draft tokens (None: the scheduler cut its draft short or
        withheld it; 0: it drafted nothing)."""
        made = self._made()
        if made is None:  # (no drafts: most steps)
            return dict.fromkeys(step.rows.req_ids, 0)
        index = dict(zip(step.rows.req_ids, step.rows.index.tolist()))
        accepted: dict[str, int | None] = dict.fromkeys(index, 0)
        order = sorted((index[r], k) for k, r in enumerate(made.req_ids) if r in index)
        if not order:
            return accepted
        at = [k for _, k in order]
        scheduled = np.array([step.verified_draft_tokens(made.req_ids[k]) for k in at], dtype=np.int64)
        sampled = np.array([step.accepted(i) for i, _ in order], dtype=np.int64)
        settled, sums = self.controller.learn_drafts(made, np.array(at, dtype=np.int64), scheduled, sampled)
        for k, tokens in zip(at, settled.tolist()):
            accepted[made.req_ids[k]] = tokens if tokens >= 0 else None
        counters, (withheld, predicted, looked_up, expected, estimated, drafts) = self.counters, sums.tolist()
        counters.draft_tokens_withheld += int(withheld)
        counters.prediction_accepted += int(predicted)  # (not the lookup gate's: predictions cost no lookup)
        if drafts:
            self.controller.observe_lookup_accepted(int(looked_up))
            counters.lookup_accepted += int(looked_up)
            counters.lookup_expected += expected
            counters.lookup_estimated += estimated
        return accepted

    def _made(self) -> DraftsMade | None:
        """The last call's drafts: its lookup drafts, and its self-drafts in place of a row's
        lookup draft."""
        if not self.self_made:
            return self.made
        made = DraftsMade.self_drafts(list(self.self_made), list(self.self_made.values()))
        if self.made is None:
            return made
        kept = [i for i, r in enumerate(self.made.req_ids) if r not in self.self_made]
        return self.made.taken(np.array(kept, dtype=np.int64)).joined(made)

    def lookup_drafts_taken(self, prepared, rows: list[int], lengths: list[int]) -> None:
        """What to learn from a step's lookup drafts once they are verified (its rows `rows`,
        `lengths` tokens each): their tokens' bins, and how many of them the planner expected
        accepted (`prepared.gains`, as it planned)."""
        if not rows:
            return
        gains, offers = prepared.gains, prepared.offers
        at, lengths = np.array(rows, dtype=np.int64), np.array(lengths, dtype=np.int64)
        planned, estimated = gains.expected(at, lengths)
        sources = offers.sources[at]
        slots = self.controller.acceptance.slots(offers, gains)
        # (rank 0's plan, which every rank follows, may draft a row past the draft this rank
        # found: its tokens past that have no bin, -1)
        self.made = DraftsMade(
            [offers.req_ids[row] for row in rows], slots[at], sources, lengths, planned, estimated,
            gains.bins[at], gains.priors[at],
        )  # fmt: skip
        counters, tokens = self.counters, np.bincount(sources, weights=lengths, minlength=len(SOURCE_INDEX))
        counters.lookup_tokens += int(lengths.sum())
        counters.history_tokens += int(tokens[SOURCE_INDEX[DraftSource.HISTORY]])
        counters.prediction_tokens += int(tokens[SOURCE_INDEX[DraftSource.PREDICTION]])
        counters.context_tokens += int(tokens[SOURCE_INDEX[DraftSource.LOOKUP]])

    def self_drafted(self, req_id: str, length: int) -> None:
        self.self_made[req_id] = length

    def step_ended(self, *, drafted: bool) -> None:
        """The proposer is about to return this step's drafts (none if not `drafted`: then
        there is nothing to learn from the step after)."""
        if not drafted:
            self.made, self.self_made = None, {}
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

    def warm_up_probed(self, seconds: float) -> None:
        """The warm-up's timed probe of one prompt: until a probe runs in earnest, what one is
        priced at (a retry's per-row room, a new row's unpaid probe)."""
        self.controller.observe_probe(1, seconds, provisional=True)

    def self_drafts_ran(self, run) -> None:
        """A batch of self-drafts (`self_drafting.drafter.DraftRun`): each draft step's rows and time."""
        for rows, seconds in zip(run.step_rows, run.step_seconds):
            self.controller.observe_self_step(rows, seconds)
        self.counters.draft_steps += len(run.step_rows)
        self.counters.draft_calls += 1
        self.counters.draft_tokens += run.tokens
        self.counters.draft_seconds += run.seconds
