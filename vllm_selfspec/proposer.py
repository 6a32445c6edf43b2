# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""SelfAdmgProposer: vLLM builds it as a `custom_class` proposer in each worker, hands it the
target model through `load_model`, and calls `propose_for_runner` after every step (through
`vllm_integration.runner_hook`). One step, `propose_for_runner`:

1. learn: what the step that just ran cost, and how much of each row's draft was accepted;
2. offer: each row's lookup draft, from its own context or its tenant's earlier outputs;
3. plan: how many tokens of which source pay this step, possibly none (`control`);
4. agree: one small all-reduce across tensor-parallel ranks, so that a fault on any rank costs
   every rank this step's drafts alike (`fail_safe`); steps 1-3 are rank-local;
5. draft: take rank 0's plan, the planned lookup tokens, and self-draft the rest (`self_draft`);
6. return ragged lists of draft tokens, which vLLM's scorer and rejection sampler verify.
Every draft is a point mass (greedy or looked up), so rejection sampling reproduces the target's
distribution exactly. Its state is in three parts: what it learns (`learning.StepLessons` and
the controller), what it tracks per request (`row_lookup.RowLookup`, the self-drafter's masks)
and what the scheduler told it (`first_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_selfspec.control import DraftController, DraftPlan, RowOffer
from vllm_selfspec.counters import PartClock, ProposerCounters
from vllm_selfspec.fail_safe import FailSafe, fault_point
from vllm_selfspec.first_tokens import FirstTokenPolicy, FirstTokens, SchedulerNote
from vllm_selfspec.learning import StepLessons
from vllm_selfspec.lookup import warm_up as warm_up_lookup
from vllm_selfspec.metrics import MetricsPublisher, metrics_snapshot
from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, SelfAdmgConfigError, make_options
from vllm_selfspec.row_lookup import Found, RowLookup
from vllm_selfspec.self_draft import SelfDrafter
from vllm_selfspec.vllm_integration import runner_hook
from vllm_selfspec.vllm_integration.draft_forward import (
    DraftForward,
    max_over_ranks,
    meet_after,
    rank0_ints,
    tensor_parallel_rank,
)
from vllm_selfspec.vllm_integration.runner_state import StepView


@dataclass(frozen=True)
class PreparedStep:
    """What a step's rank-local part found: the step, each drafting row's lookup draft and
    offer, and this rank's plan, ready for the broadcast (`DraftPlan.as_ints`)."""

    step: StepView
    found: list[Found]
    offers: list[RowOffer]
    plan_ints: list[int]


class SelfAdmgProposer(runner_hook.HookedProposer):
    def __init__(self, vllm_config):
        from vllm_selfspec.vllm_integration.front_door import refusals_of

        refusals = refusals_of(vllm_config)
        if refusals:
            raise SelfAdmgConfigError("self-admg: " + "; also: ".join(refusals))
        runner_hook.install()
        self.vllm_config = vllm_config
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.options = make_options((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))
        self.counters = ProposerCounters()
        self.controller = DraftController()
        self.controller.planner.protect_rows = self.options.objective == "per-request"
        self.lessons = StepLessons(self.controller, self.counters)
        self.fail_safe = FailSafe(max_over_ranks=max_over_ranks)
        self.lookup = RowLookup(self.options, self.fail_safe)
        self.first_tokens = FirstTokenPolicy()
        self.note = SchedulerNote()  # what the scheduler said with the step in progress
        self.scheduler_faults = 0
        self._prefix_cache_resets = 0
        self.self_drafter: SelfDrafter | None = None
        self._look_up = True  # the ranks' agreed decision, for the next step
        engine = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0)
        MetricsPublisher.from_environment(rank=tensor_parallel_rank(), engine=engine).start(self, metrics_snapshot)
        if self.options.lookup:
            self.fail_safe.attempt(warm_up_lookup)

    # vLLM's CPU runner calls this unconditionally, the GPU runner when it exists. The target is
    # kept under another name than `model`: the runner treats `drafter.model` as a separate draft
    # network (graph wrappers, EPLB, get_draft_model).
    def load_model(self, target_model: torch.nn.Module) -> None:
        self.self_drafter = SelfDrafter(target_model, self.options)
        self._device = next(target_model.parameters()).device

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "SelfAdmgProposer is driven by vllm_selfspec's runner hook; it cannot run as a bare "
            "custom_class proposer (is the vllm_selfspec plugin loaded in this process?)"
        )

    def begin_step(self, note: SchedulerNote, live_requests) -> None:
        """The runner began a step, whether or not vLLM asks for drafts in it: the scheduler's
        note (a new prefix-cache reset empties the history; new requests' tenants)."""
        self.lessons.note_step()
        self.note = note
        self.scheduler_faults = max(self.scheduler_faults, note.scheduler_faults)
        if note.prefix_cache_resets != self._prefix_cache_resets:
            self._prefix_cache_resets = note.prefix_cache_resets
            self.lookup.forget_history()
        fault_point("update_states")
        self.lookup.admit(note.tenants, live_requests)

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids, common_attn_metadata) -> list[list[int]]:
        """This step's drafts; none if anything in making them fails on any rank (`fail_safe`).
        Its time is on every step's critical path, drafting or not, so it is counted."""
        start = time.perf_counter()
        rows, clock = len(sampled_token_ids), PartClock(self.counters.part_seconds)
        try:
            self.fail_safe.tick()
            if self.fail_safe.disabled:
                return self._no_drafts(rows)
            step = StepView(runner, scheduler_output, sampled_token_ids)
            prepared = self.fail_safe.attempt(lambda: self._prepare(step, clock))
            warmed_up = self.self_drafter is not None and self.self_drafter.warmed_up
            votes = (int(self._wants_lookup(prepared)), int(not warmed_up))
            clock.lap("plan")
            may_draft, (look_up, warm_up) = self.fail_safe.agree(prepared is not None, votes)
            self._look_up = bool(look_up)
            clock.lap("agree")
            if not may_draft:
                return self._no_drafts(rows)
            return self.fail_safe.call(
                lambda: self._draft(prepared, common_attn_metadata, warm_up), lambda: self._no_drafts(rows)
            )
        finally:
            self.lessons.call_ended()
            clock.lap("draft")
            self.counters.propose_calls += 1
            self.counters.propose_seconds += time.perf_counter() - start

    def _wants_lookup(self, prepared: PreparedStep | None) -> bool:
        """This rank's vote on looking up next step (the ranks look up if any wants to): it is
        paid on every row before any plan, so the controller weighs it against what it saved."""
        if not self.options.lookup or not self.options.adaptive:
            return True
        try:
            return self.controller.look_up_next(len(prepared.offers) if prepared is not None else 0)
        except Exception as err:  # a vote is no reason to skip the agreement
            self.fail_safe.record(err)
            return True

    def _no_drafts(self, rows: int) -> list[list[int]]:
        self.lessons.step_ended(drafted=False)
        return [[] for _ in range(rows)]

    def _prepare(self, step: StepView, clock: PartClock) -> PreparedStep:
        """The rank-local part of a step, before the ranks meet: learn from the step that ran,
        offer each row's lookup draft and plan (each rank its own plan; rank 0's is used)."""
        rows = step.rows  # (read from vLLM's state once, here)
        clock.lap("read_step")
        self.lessons.learn(step)
        first_tokens = self.first_tokens.next_step(
            step=self.lessons.steps_run,
            note=self.note,
            ended=step.finishing_rows,
            admitted=step.admitted_requests,
            engine_was_busy=step.engine_was_busy,
        )
        clock.lap("learn")
        k = self.num_speculative_tokens
        budgets = [row.draft_budget(k) if row.may_draft and self.lookup.allowed(step, row) else 0 for row in rows]
        found = self.lookup.find(step, rows, budgets, self._look_up)
        if self.lookup.rows_looked_up:
            self.controller.observe_lookup(self.lookup.rows_looked_up, self.lookup.seconds)
        clock.lap("look_up")
        offers = self.lookup.offers(step, rows, budgets, found, probed=self.self_drafter.masks)
        return PreparedStep(step, found, offers, self._plan(offers, max(budgets, default=0), first_tokens).as_ints())

    def _plan(self, offers: list[RowOffer], self_budget: int, first_tokens: FirstTokens) -> DraftPlan:
        """How much of each kind of draft pays this step (everything offered, if not adaptive)."""
        fault_point("plan")
        if first_tokens == FirstTokens.QUEUED:
            self.counters.steps_prompts_waiting += 1
            return DraftPlan.nothing(len(offers))
        if not self.options.adaptive:
            return DraftPlan.everything(offers, self_budget)
        expected = first_tokens == FirstTokens.EXPECTED
        return self.controller.plan(offers, self_budget, self.first_tokens.draining, expected)

    def _draft(self, prepared: PreparedStep, common_attn_metadata, warm_up: bool) -> list[list[int]]:
        """The part every rank runs alike: the shared plan, lookup drafts and self-drafts. Each
        rank's own part before a forward ends at a checkpoint (`meet_after`), where a fault on
        one rank stops every rank; the warm-up is the ranks' agreed vote."""
        step, rows = prepared.step, prepared.step.rows
        # Rank 0's plan on every rank: each rank planned from its own step timings.
        plan = DraftPlan.from_ints(rank0_ints(prepared.plan_ints, self._device), len(prepared.offers))
        # Alike on every rank: the rank-local quarantine is left out here, since rank 0's plan,
        # which every rank follows, already left it out.
        budgets = [row.draft_budget(self.num_speculative_tokens) if row.may_draft else 0 for row in rows]
        self_rows = [(row, budget) for row, budget, chosen in zip(rows, budgets, plan.self_rows) if chosen]
        warm_row = next((row.index for row, budget in zip(rows, budgets) if budget), None) if warm_up else None
        forwards = warm_row is not None or bool(plan.self_length and self_rows)
        drafts: list[list[int]] = [[] for _ in range(step.num_rows)]

        def own_part() -> DraftForward | None:
            self._take_lookup_drafts(prepared, plan, drafts)
            return DraftForward(step.runner, self.vllm_config, common_attn_metadata) if forwards else None

        forward = meet_after(own_part) if forwards else own_part()  # (no forward follows: no checkpoint)
        if warm_row is not None:
            self.counters.warmup_seconds += self.self_drafter.warm_up(step, forward, warm_row)
        if plan.self_length and self_rows:
            self._self_draft(step, forward, self_rows, plan.self_length, drafts)
        self.lessons.step_ended(drafted=True)
        return drafts

    def _take_lookup_drafts(self, prepared: PreparedStep, plan: DraftPlan, drafts: list[list[int]]) -> None:
        for row, offer, (source, draft), length in zip(
            prepared.step.rows, prepared.offers, prepared.found, plan.lookup_lengths
        ):
            if length:  # (what is learned is guarded on its own)
                drafts[row.index] = [int(t) for t in draft.tokens[:length]]
                self.fail_safe.attempt(lambda: self.lessons.lookup_drafted(row.req_id, offer, source, length))  # noqa: B023

    def _self_draft(self, step: StepView, forward: DraftForward, rows: list, length: int, drafts: list) -> None:
        """Probe the rows not measured yet, then draft up to `length` tokens for all of them."""
        new = [row.index for row, _ in rows if row.req_id not in self.self_drafter.masks]
        if new:  # (what is learned is rank-local: its fault costs the lesson, never the ranks' step)
            probe = self.self_drafter.probe(step, forward, new)
            self.fail_safe.attempt(lambda: self.lessons.probed(probe))
        budgets = [min(budget, length) for _, budget in rows]
        run = self.self_drafter.draft(step, forward, [row.index for row, _ in rows], budgets, drafts)
        self.fail_safe.attempt(lambda: self.lessons.self_drafts_ran(run))
        for row, _ in rows:
            if drafts[row.index]:
                self.lessons.self_drafted(row.req_id, len(drafts[row.index]))

    def forget(self, req_id: str, request=None) -> None:
        """The runner dropped this request (finished or aborted): drop what is tracked for it,
        and keep its output for its tenant's later requests (`RowLookup.forget`). Runs even with
        drafting switched off, so that nothing is left behind."""
        # Each clean-up on its own, so that one that raises leaves nothing else behind.
        for clean_up in (
            lambda: self.lookup.forget(req_id, request),
            lambda: self.controller.forget(req_id),
            lambda: self.self_drafter.forget(req_id) if self.self_drafter is not None else None,
        ):
            try:
                clean_up()
            except Exception as err:  # never let clean-up of an optimisation fail a request
                self.fail_safe.record(err)

    def forget_history(self) -> None:
        """Forget every earlier output (the worker sleeps)."""
        self.lookup.forget_history()
