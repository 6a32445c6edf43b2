"""SelfAdmgProposer: vLLM builds it as a `custom_class` proposer in each worker, hands it the
target model through `load_model`, and calls `propose_for_runner` after every step (through
`vllm_compat.runner_hook`). One step, `propose_for_runner`:

1. learn: what the step that just ran cost, and how much of each row's draft was accepted;
2. offer: each row's lookup draft, from its own context or earlier outputs (`lookup`);
3. plan: how many tokens of which source pay this step, possibly none (`control`);
4. agree: one small all-reduce across tensor-parallel ranks, so that a fault on any rank costs
   every rank this step's drafts alike (`fail_safe`); steps 1-3 are rank-local;
5. draft: take rank 0's plan, the planned lookup tokens, and self-draft the rest (`self_draft`);
6. return ragged lists of draft tokens, which vLLM's scorer and rejection sampler verify.
Every draft is a point mass (greedy or looked up), so rejection sampling reproduces the target's
distribution exactly.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_selfspec.control import DraftController, DraftPlan, DraftSource, RowOffer
from vllm_selfspec.control.refills import Refills
from vllm_selfspec.fail_safe import FailSafe, RequestQuarantine, fault_point, warn_if_injecting
from vllm_selfspec.lookup import NO_DRAFT, LookupDraft, TenantHistories, lookup_draft
from vllm_selfspec.lookup import warm_up as warm_up_lookup
from vllm_selfspec.metrics import MetricsPublisher
from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, CLOSED_BATCHES_KEY, SelfAdmgConfigError, make_options

# SelfAdmgWorkerExtension is re-exported so that worker-extension paths naming this module work.
from vllm_selfspec.report import ProposerCounters, SelfAdmgWorkerExtension, metrics_snapshot, prompt_key  # noqa: F401
from vllm_selfspec.self_draft import SelfDrafter
from vllm_selfspec.vllm_compat.draft_forward import (
    DraftForward,
    max_over_ranks,
    same_on_all_ranks,
    tensor_parallel_rank,
)
from vllm_selfspec.vllm_compat.request_tenant import tenant_of
from vllm_selfspec.vllm_compat.runner_state import StepRow, StepView

# Steps without a request admitted after which a closed batch counts as draining: a row that
# finishes early frees a slot nobody takes (vllm_selfspec.control.planner). In a server nobody
# waits for a batch's end, so every step is planned for tokens per second.
DRAIN_AFTER_STEPS = 4


@dataclass(frozen=True)
class PreparedStep:
    """What a step's rank-local part found: the step, per drafting row its lookup draft (with
    source) and offer, and this rank's plan."""

    step: StepView
    found: list[tuple[DraftSource, LookupDraft]]
    offers: list[RowOffer]
    plan_ints: list[int]  # this rank's plan, ready for the broadcast (`DraftPlan.as_ints`)


class FirstTokens(enum.Enum):
    """Whether a new prompt will wait for the next step (`SelfAdmgProposer._first_tokens`)."""

    NONE_WAIT = "none wait"
    QUEUED = "queued"  # the scheduler withholds the step's drafts: make none
    EXPECTED = "expected"  # the step may be at most FIRST_TOKEN_SLACK longer than plain's


@dataclass(frozen=True)
class DraftMade:
    """A row's draft this step, to learn from when it has been verified."""

    source: DraftSource
    length: int
    bins: list  # its lookup tokens' calibration (control.acceptance.BinPrior)
    expected: float = 0.0  # lookup tokens the planner expected to be accepted, as it planned
    estimated: float = 0.0  # the same before its calibration scaled them (what that learns from)


class SelfAdmgProposer:
    def __init__(self, vllm_config):
        from vllm_selfspec.vllm_compat import runner_hook
        from vllm_selfspec.vllm_compat.front_door import refusals_of

        refusals = refusals_of(vllm_config)
        if refusals:
            raise SelfAdmgConfigError("self-admg: " + "; also: ".join(refusals))
        runner_hook.install()
        self.vllm_config = vllm_config
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.options = make_options((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))
        self.closed_batches = bool((vllm_config.additional_config or {}).get(CLOSED_BATCHES_KEY, False))
        self.counters = ProposerCounters()
        self.controller = DraftController()
        self.controller.planner.protect_rows = self.options.objective == "per-request"
        self.self_drafter: SelfDrafter | None = None
        self.history = (
            TenantHistories(
                self.options.lookup_history,
                max_tenants=self.options.lookup_history_tenants,
                share_unsalted=self.options.lookup_history_unsalted,
            )
            if self.options.lookup and self.options.lookup_history
            else None
        )
        self.quarantine = RequestQuarantine()
        self._prefix_cache_resets = 0
        self.scheduler_faults = 0
        self._drafted: dict[str, DraftMade] = {}
        self._step_end: float | None = None
        self._look_up = True  # the ranks' agreed decision, for the next step
        self._steps_run = 0  # steps the runner began (note_step)
        self._proposed_at = -1  # the step of the last call for drafts
        self._steps_since_admission = 0
        self._requests_ended = 0  # in the step before the last one the proposer saw
        self.refills = Refills()
        self.fail_safe = FailSafe(max_over_ranks=max_over_ranks)
        warn_if_injecting()
        MetricsPublisher.from_environment(
            rank=tensor_parallel_rank(),
            engine=getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0),
        ).start(self, metrics_snapshot)
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

    def propose_for_runner(
        self, runner, scheduler_output, sampled_token_ids: list[list[int]], common_attn_metadata
    ) -> list[list[int]]:
        """This step's drafts; none if anything in making them fails on any rank (`fail_safe`).
        Its time is on every step's critical path, drafting or not, so it is counted."""
        start = time.perf_counter()
        rows = len(sampled_token_ids)
        try:
            self.fail_safe.tick()
            if self.fail_safe.disabled:
                return self._no_drafts(rows)
            step = StepView(runner, scheduler_output, sampled_token_ids)
            prepared = self.fail_safe.attempt(lambda: self._prepare(step))
            warmed_up = self.self_drafter is not None and self.self_drafter.warmed_up
            votes = (int(self._wants_lookup(prepared)), int(not warmed_up))
            may_draft, (look_up, warm_up) = self.fail_safe.agree(prepared is not None, votes)
            self._look_up = bool(look_up)
            if not may_draft:
                return self._no_drafts(rows)
            return self.fail_safe.call(
                lambda: self._draft(prepared, common_attn_metadata, warm_up), lambda: self._no_drafts(rows)
            )
        finally:
            self._proposed_at = self._steps_run
            self.counters.propose_calls += 1
            self.counters.propose_seconds += time.perf_counter() - start

    def note_step(self) -> None:
        """The runner began a step (whether or not vLLM asks this proposer for drafts in it)."""
        self._steps_run += 1

    def follow_scheduler(self, prefix_cache_resets: int, scheduler_faults: int) -> None:
        """What the scheduler counts: its prefix-cache resets (a new one empties the history)
        and its hooks' faults (published with this rank's)."""
        self.scheduler_faults = max(self.scheduler_faults, scheduler_faults)
        if prefix_cache_resets != self._prefix_cache_resets:
            self._prefix_cache_resets = prefix_cache_resets
            self.forget_history()

    def forget_history(self) -> None:
        """Forget every earlier output (vLLM reset its prefix cache, or the worker sleeps)."""
        if self.history is not None:
            self.history.clear()

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
        self._drafted = {}
        self._step_end = time.perf_counter()
        return [[] for _ in range(rows)]

    def _prepare(self, step: StepView) -> PreparedStep:
        """The rank-local part of a step, before the ranks meet: learn from the step that ran,
        offer each row's lookup draft and plan (each rank its own plan; rank 0's is used)."""
        self._learn(step)
        rows = step.rows
        budgets = [
            self._draft_budget(row.tokens_left) if row.may_draft and self._allowed(step, row) else 0 for row in rows
        ]
        found = self._lookup(step, rows, budgets)
        offers = [
            RowOffer(
                row.req_id,
                len(draft),
                source,
                budget > 0,
                row.sampled,
                draft.probs,
                draft.match,
                row.tokens_left,
                has_mask=row.req_id in self.self_drafter.masks,
                context=step.context_length(row.index),
            )
            for row, budget, (source, draft) in zip(rows, budgets, found)
        ]
        plan = self._plan(offers, max(budgets, default=0), self._first_tokens(step))
        return PreparedStep(step, found, offers, plan.as_ints())

    def _draft(self, prepared: PreparedStep, common_attn_metadata, warm_up: bool) -> list[list[int]]:
        """The part every rank runs alike: the shared plan, lookup drafts and self-drafts. Between
        the agreement and the forwards nothing rank-local may raise (one rank's exception would
        put the ranks' collectives out of step): the warm-up is the ranks' agreed vote, and
        what is remembered to learn from later is guarded on its own."""
        step, found, offers = prepared.step, prepared.found, prepared.offers
        rows = step.rows
        # Alike on every rank: the rank-local quarantine is left out here, since rank 0's plan,
        # which every rank follows, already left it out.
        budgets = [self._draft_budget(row.tokens_left) if row.may_draft else 0 for row in rows]
        # Rank 0's plan on every rank: each rank planned from its own step timings.
        shared = same_on_all_ranks(torch.tensor(prepared.plan_ints, device=self._device))
        plan = DraftPlan.from_ints(shared.tolist(), len(offers))
        forward = DraftForward(step.runner, self.vllm_config, common_attn_metadata)
        if warm_up and any(budgets):
            warm_row = next(row.index for row, budget in zip(rows, budgets) if budget)
            self.counters.warmup_seconds += self.self_drafter.warm_up(step, forward, warm_row)
        drafts: list[list[int]] = [[] for _ in range(step.num_rows)]
        for row, offer, (source, draft), length in zip(rows, offers, found, plan.lookup_lengths):
            if length:
                drafts[row.index] = [int(t) for t in draft.tokens[:length]]
                self.fail_safe.attempt(lambda: self._remember_lookup_draft(row.req_id, offer, source, length))  # noqa: B023
        self_rows = [(row, budget) for row, budget, chosen in zip(rows, budgets, plan.self_rows) if chosen]
        if plan.self_length and self_rows:
            self._self_draft(step, forward, self_rows, plan.self_length, drafts)
        self._step_end = time.perf_counter()
        return drafts

    def _remember_lookup_draft(self, req_id: str, offer: RowOffer, source: DraftSource, length: int) -> bool:
        """What to learn from a lookup draft once it is verified (rank-local: its fault costs
        the lesson, not the draft)."""
        expectation = self.controller.expected_accepted(offer, length)
        self._drafted[req_id] = DraftMade(
            source, length, self.controller.calibration(offer, length), expectation.planned, expectation.estimated
        )
        self.counters.lookup_tokens += length
        if source == DraftSource.HISTORY:
            self.counters.history_tokens += length
        else:
            self.counters.context_tokens += length
        return True

    def _learn(self, step: StepView) -> None:
        """Feed the controller the step that just ran: its time against what it computed, and
        what verification made of the drafts proposed for it. A step that found the engine idle
        is not timed: its time since the last step includes the wait for requests, which under
        open-loop arrivals precedes most prompts and would be charged to their tokens."""
        now = time.perf_counter()
        self._steps_since_admission = 0 if step.admitted_requests else self._steps_since_admission + 1
        # vLLM skips the proposer in some steps (a request within K tokens of max_model_len):
        # then neither the time since the last call nor this step's tokens say what the last
        # call's drafts did.
        follows_last_call = self._proposed_at == self._steps_run - 1
        if not follows_last_call:
            self._drafted = {}
        shape = step.shape()
        if self._step_end is not None and shape is not None and step.engine_was_busy and follows_last_call:
            seconds = now - self._step_end
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
        self._step_end = None
        for row in step.rows:
            made = self._drafted.get(row.req_id)
            verified = min(made.length, step.verified_draft_tokens(row.req_id)) if made else 0
            self.counters.draft_tokens_withheld += made.length - verified if made else 0
            if verified:  # (the scheduler may have cut a draft short)
                accepted = min(step.accepted(row.index), verified)
                self.controller.observe_draft(row.req_id, made.source, verified, accepted, made.bins, made.estimated)
                if made.source != DraftSource.SELF:
                    self.controller.observe_lookup_accepted(accepted)
                    self.counters.lookup_accepted += accepted
                    self.counters.lookup_expected += made.expected
                    self.counters.lookup_estimated += made.estimated
        self._drafted = {}

    def _draft_budget(self, tokens_left: int | None) -> int:
        """How many draft tokens can still be used: verification emits accepted drafts plus one
        token, so a request with r tokens left can use at most r - 1."""
        k = self.num_speculative_tokens
        return k if tokens_left is None else max(0, min(k, tokens_left - 1))

    def _lookup(self, step: StepView, rows: list[StepRow], budgets: list[int]) -> list[tuple[DraftSource, LookupDraft]]:
        """Each row's best lookup draft (NO_DRAFT where lookup is off or finds nothing). A row
        whose own lookup raises while others' do not is that request's fault: it is
        quarantined (its budget set to 0 in `budgets`), and the other rows' drafts go on. If
        every row's raises, the step faults (nobody is blamed for what strikes all)."""
        fault_point("lookup")
        found, failed = [], []
        start, looked_up = time.perf_counter(), 0
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            source, draft = DraftSource.LOOKUP, NO_DRAFT
            if budget and not self._allowed(step, row):
                budgets[i] = 0  # a twin of a request blamed earlier in this step
            elif self.options.lookup and self._look_up and budget:
                try:
                    source, draft = self._lookup_row(step, row, budget)
                except Exception as err:
                    failed.append((i, row, err))
                looked_up += 1
            found.append((source, draft))
        if failed and len(failed) == looked_up > 1:
            raise failed[0][2]
        for i, row, err in failed:
            self.fail_safe.record(err, one_request=True)
            self.quarantine.blame(row.req_id, step.tenant(row.index), step.prompt(row.index))
            budgets[i] = 0
        if looked_up:
            self.controller.observe_lookup(looked_up, time.perf_counter() - start)
        return found

    def _allowed(self, step: StepView, row: StepRow) -> bool:
        """Whether the row's request is out of quarantine (checked again per row: a request
        blamed earlier in the step may have a twin in it, n > 1 or a resent prompt)."""
        return self.quarantine.allows(row.req_id, lambda: (step.tenant(row.index), step.prompt(row.index)))

    def _lookup_row(self, step: StepView, row: StepRow, budget: int) -> tuple[DraftSource, LookupDraft]:
        context = step.context(row.index)
        fault_point("lookup", tokens=context)
        tenant = step.tenant(row.index)
        history = self.history.pool(tenant) if self.history is not None else None
        try:
            return lookup_draft(context, budget, self.options.lookup_max_match, history)
        except Exception as err:
            if history is None:
                raise
            # The tenant's history may be what raises: it goes, and the row drafts from its own
            # context (if that raises too, the row is at fault).
            self.history.forget(tenant)
            self.fail_safe.record(err, one_request=True)
            return lookup_draft(context, budget, self.options.lookup_max_match, None)

    def _first_tokens(self, step: StepView) -> FirstTokens:
        """Whether a new prompt will wait for the next step, in a server (offline, a first
        token is worth nothing before the batch's end): requests are queued that the scheduler
        can admit, so it withholds the next step's drafts anyway; or a request ended with this
        step or the one before, and its client sends the next prompt, which arrives during the
        next step or the one after, where ends have lately been followed by prompts (`Refills`)."""
        ended, self._requests_ended = self._requests_ended, step.finishing_rows
        if self.closed_batches:
            return FirstTokens.NONE_WAIT
        # Numbered by the steps the runner began, so that a step vLLM ran without asking for
        # drafts still counts against an end's window (an admission in it goes unseen).
        self.refills.observe(
            step=self._steps_run,
            ended=step.finishing_rows,
            admitted=step.admitted_requests,
            engine_was_busy=step.engine_was_busy,
        )
        if step.waiting_requests:
            self.counters.steps_prompts_waiting += 1
            return FirstTokens.QUEUED
        recent_end = ended or self._requests_ended
        return FirstTokens.EXPECTED if recent_end and self.refills.expected else FirstTokens.NONE_WAIT

    def _plan(self, offers: list[RowOffer], self_budget: int, first_tokens: FirstTokens) -> DraftPlan:
        """How much of each kind of draft pays this step (everything offered, if not adaptive)."""
        fault_point("plan")
        if first_tokens == FirstTokens.QUEUED:
            return DraftPlan.nothing(len(offers))
        if not self.options.adaptive:
            return DraftPlan.everything(offers, self_budget)
        draining = self.closed_batches and self._steps_since_admission > DRAIN_AFTER_STEPS
        return self.controller.plan(offers, self_budget, draining, first_tokens == FirstTokens.EXPECTED)

    def _self_draft(
        self,
        step: StepView,
        forward: DraftForward,
        rows: list[tuple[StepRow, int]],
        length: int,
        drafts: list[list[int]],
    ) -> None:
        """Probe the rows not measured yet, then draft up to `length` tokens for all of them."""
        new = [row.index for row, _ in rows if row.req_id not in self.self_drafter.masks]
        if new:
            probe = self.self_drafter.probe(step, forward, new)
            for m in probe.measurements:
                self.counters.measurements.append(
                    (prompt_key(m.prompt), m.attention_similarity, m.mlp_similarity, m.mask)
                )
            self.counters.prompts_measured += len(new)
            self.counters.prompt_tokens_measured += probe.tokens
            self.counters.probe_seconds += probe.seconds
            self.controller.observe_probe(len(new), probe.seconds)
        indices = [row.index for row, _ in rows]
        run = self.self_drafter.draft(step, forward, indices, np.array([min(b, length) for _, b in rows]), drafts)
        for m, seconds in zip(run.step_rows, run.step_seconds):
            self.controller.observe_self_step(m, seconds)
        self.counters.draft_steps += len(run.step_rows)
        self.counters.draft_calls += 1
        self.counters.draft_tokens += run.tokens
        self.counters.draft_seconds += run.seconds
        for row, _ in rows:
            if drafts[row.index]:
                self._drafted[row.req_id] = DraftMade(DraftSource.SELF, len(drafts[row.index]), [])

    def forget(self, req_id: str, request=None) -> None:
        """The runner dropped this request (finished or aborted): drop its mask and rates, and
        keep its output for its tenant's later requests to draft from. An output that a stop
        string ended was cut in the front end at a point the worker does not know, so it is not
        kept: its tail was never sent. Runs even with drafting switched off, so that nothing is
        left behind."""
        quarantined = req_id in self.quarantine.requests  # its output may be what faults: not kept
        # Each clean-up on its own, so that one that raises leaves nothing else behind.
        for clean_up in (
            lambda: self.quarantine.forget(req_id),
            lambda: self.controller.forget(req_id),
            lambda: self.self_drafter.forget(req_id) if self.self_drafter is not None else None,
            lambda: None if quarantined else self._keep_output(request),
        ):
            try:
                clean_up()
            except Exception as err:  # never let clean-up of an optimisation fail a request
                self.fail_safe.record(err)

    def _keep_output(self, request) -> None:
        params = getattr(request, "sampling_params", None)
        if (
            self.history is not None
            and request is not None
            and request.output_token_ids
            and not (params is not None and params.stop)
        ):
            self.history.add(tenant_of(request), np.array(request.output_token_ids))
