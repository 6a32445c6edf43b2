# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""SelfAdmgProposer: vLLM builds it as a `custom_class` proposer in each worker, hands it the
target model through `load_model`, and calls `propose_for_runner` after every step (through
`vllm_integration.runner_hook`). One step, `propose_for_runner`:

1. read, learn, look up, offer and plan: rank-local and pure (`DraftPipeline.prepare`);
2. agree: one small all-reduce across tensor-parallel ranks, so that a fault on any rank costs
   every rank this step's drafts alike (`fail_safe`; the order is `DraftPipeline.propose`);
3. draft: take rank 0's plan, the planned lookup tokens, and self-draft the rest (`self_drafting.drafter`);
4. return ragged lists of draft tokens, which vLLM's scorer and rejection sampler verify.
Every draft is a point mass (greedy or looked up): rejection sampling keeps the target's distribution.
"""

from __future__ import annotations

import time

import torch

from vllm_selfspec.control import DraftPlan
from vllm_selfspec.draft_pipeline import DraftPipeline, PreparedStep
from vllm_selfspec.operations.counters import PartClock, updating_states
from vllm_selfspec.operations.fail_safe import FailSafe
from vllm_selfspec.operations.metrics import MetricsPublisher, metrics_snapshot
from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, SelfAdmgConfigError, make_options
from vllm_selfspec.scheduler_note import SchedulerNote
from vllm_selfspec.self_drafting.drafter import SelfDrafter
from vllm_selfspec.vllm_integration import runner_hook
from vllm_selfspec.vllm_integration.draft_forward import (
    DraftForward,
    max_over_ranks,
    meet_after,
    rank0_ints,
    tensor_parallel_rank,
)
from vllm_selfspec.vllm_integration.runner_state import StepView


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
        self.fail_safe = FailSafe(max_over_ranks=max_over_ranks)
        self.pipeline = pipeline = DraftPipeline(self.options, self.num_speculative_tokens, self.fail_safe)
        # (read by the worker extension, the metrics and the tests)
        self.counters, self.controller, self.lookup = pipeline.counters, pipeline.controller, pipeline.lookup
        self.scheduler_faults = 0
        self.self_drafter: SelfDrafter | None = None
        engine = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0)
        MetricsPublisher.from_environment(rank=tensor_parallel_rank(), engine=engine).start(self, metrics_snapshot)

    # vLLM's CPU runner calls this unconditionally, the GPU runner when it exists. The target is
    # kept under another name than `model`: the runner treats `drafter.model` as a separate draft
    # network (graph wrappers, EPLB, get_draft_model).
    def load_model(self, target_model: torch.nn.Module) -> None:
        self.self_drafter = SelfDrafter(target_model, self.options)
        self._device = next(target_model.parameters()).device

    def begin_step(self, note: SchedulerNote, live_requests) -> None:
        """A step began (the scheduler's faults counted first: the pipeline's part may fault)."""
        self.scheduler_faults = max(self.scheduler_faults, note.scheduler_faults)
        updating_states(self.counters, lambda: self.pipeline.begin_step(note, live_requests))

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids, common_attn_metadata) -> list[list[int]]:
        """This step's drafts; none if anything in making them fails on any rank (`fail_safe`).
        Its time is on every step's critical path, drafting or not, so it is counted."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            drafter = self.self_drafter
            return self.pipeline.propose(
                StepView(runner, scheduler_output, sampled_token_ids, self.pipeline.request_facts),
                PartClock(self.counters.part_seconds),
                probed=drafter.masks if drafter is not None else {},
                warmed_up=drafter is not None and drafter.warmed_up,
                draft=lambda prepared, warm_up: self._draft(prepared, common_attn_metadata, warm_up),
            )
        finally:
            self.counters.propose_calls += 1
            self.counters.propose_seconds += time.perf_counter() - start
            self.counters.propose_cpu_seconds += time.thread_time() - cpu_start

    def _draft(self, prepared: PreparedStep, common_attn_metadata, warm_up: bool) -> list[list[int]]:
        """The part every rank runs alike: the shared plan, lookup drafts and self-drafts. Each
        rank's own part before a forward ends at a checkpoint (`meet_after`), where a fault on
        one rank stops every rank; the warm-up is the ranks' agreed vote."""
        step, rows = prepared.step, prepared.step.rows
        # Rank 0's plan on every rank: each rank planned from its own step timings.
        plan = DraftPlan.from_ints(rank0_ints(prepared.plan_ints, self._device), len(prepared.offers))
        # Alike on every rank: the rank-local quarantine is left out here, since rank 0's plan,
        # which every rank follows, already left it out.
        budgets = rows.budgets(self.num_speculative_tokens).tolist()
        self_rows = [(rows[i], budget) for i, (budget, chosen) in enumerate(zip(budgets, plan.self_rows)) if chosen]
        warm_row = next((rows[i].index for i, budget in enumerate(budgets) if budget), None) if warm_up else None
        forwards = warm_row is not None or bool(plan.self_length and self_rows)
        drafts: list[list[int]] = [[] for _ in range(step.num_rows)]

        def own_part() -> DraftForward | None:
            self.pipeline.take_lookup_drafts(prepared, plan, drafts)
            return DraftForward(step.runner, self.vllm_config, common_attn_metadata) if forwards else None

        forward = meet_after(own_part) if forwards else own_part()  # (no forward follows: no checkpoint)
        if warm_row is not None:
            warm = self.self_drafter.warm_up(step, forward, warm_row)
            self.counters.warmup_seconds += warm.seconds
            self.fail_safe.attempt(lambda: self.pipeline.lessons.warm_up_probed(warm.probe_seconds))
        if plan.self_length and self_rows:
            self._self_draft(step, forward, self_rows, plan.self_length, drafts)
        self.pipeline.lessons.step_ended(drafted=True)
        return drafts

    def _self_draft(self, step: StepView, forward: DraftForward, rows: list, length: int, drafts: list) -> None:
        """Probe the rows not measured yet, then draft up to `length` tokens for all of them."""
        new = [row.index for row, _ in rows if row.req_id not in self.self_drafter.masks]
        if new:  # (what is learned is rank-local: its fault costs the lesson, never the ranks' step)
            probe = self.self_drafter.probe(step, forward, new)
            self.fail_safe.attempt(lambda: self.pipeline.lessons.probed(probe))
        run = self.self_drafter.draft(
            step, forward, [row.index for row, _ in rows], [min(b, length) for _, b in rows], drafts
        )
        self.fail_safe.attempt(lambda: self.pipeline.lessons.self_drafts_ran(run))
        for row, _ in rows:
            if drafts[row.index]:
                self.pipeline.lessons.self_drafted(row.req_id, len(drafts[row.index]))

    def forget(self, req_id: str, request=None) -> None:
        """The runner dropped this request (finished or aborted): drop what is tracked for it
        (`DraftPipeline.forget`), even with drafting switched off."""
        updating_states(self.counters, lambda: self.pipeline.forget(req_id, request))
        if self.self_drafter is not None:
            self.fail_safe.attempt(lambda: updating_states(self.counters, lambda: self.self_drafter.forget(req_id)))

    def forget_history(self) -> None:
        """Forget every earlier output (the worker sleeps)."""
        self.lookup.forget_history()
