# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The proposer's stages that need no model, over one step: read it, learn from the step that
ran, look up each row's draft, offer, plan, and (once the ranks agreed on rank 0's plan) hand
over the planned lookup drafts. No vLLM and no torch: the step is read through an object with
`vllm_integration.runner_state.StepView`'s interface, so that the lab can time these stages on
any machine (`benchmarks/host_time.py`), a GPU host without vLLM included.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_selfspec.control import DraftController, DraftPlan, StepGains, StepOffers
from vllm_selfspec.control.acceptance import warm_up as warm_up_acceptance
from vllm_selfspec.control.cost_fit import warm_up as warm_up_cost_fit
from vllm_selfspec.control.draining_plan import warm_up as warm_up_draining_plan
from vllm_selfspec.control.first_tokens import FirstTokenPolicy, FirstTokens
from vllm_selfspec.control.learning import StepLessons
from vllm_selfspec.control.lookup_plan import warm_up as warm_up_lookup_plan
from vllm_selfspec.operations.counters import PartClock, ProposerCounters
from vllm_selfspec.operations.fail_safe import FailSafe, fault_point
from vllm_selfspec.options import SelfAdmgOptions
from vllm_selfspec.scheduler_note import SchedulerNote
from vllm_selfspec.sources.lookup import warm_up as warm_up_lookup
from vllm_selfspec.sources.prediction_cursor import warm_up as warm_up_prediction_cursor
from vllm_selfspec.sources.request_predictions import warm_up as warm_up_request_predictions
from vllm_selfspec.sources.row_lookup import RowLookup
from vllm_selfspec.sources.step_drafts import StepDrafts
from vllm_selfspec.vllm_integration.runner_state import RequestTable
from vllm_selfspec.vllm_integration.runner_state import warm_up as warm_up_step_rows


class PreparedStep(NamedTuple):
    """What a step's rank-local part found: the step, each drafting row's lookup draft, offer
    and gains, and this rank's plan, ready for the broadcast (`DraftPlan.as_ints`)."""

    step: object  # a StepView
    found: StepDrafts
    offers: StepOffers
    gains: StepGains
    plan_ints: list[int]


class DraftPipeline:
    def __init__(self, options: SelfAdmgOptions, num_speculative_tokens: int, fail_safe: FailSafe):
        self.options = options
        self.num_speculative_tokens = num_speculative_tokens
        self.fail_safe = fail_safe
        self.counters = ProposerCounters()
        self.controller = DraftController()
        self.controller.planner.protect_rows = options.objective == "per-request"
        self.lessons = StepLessons(self.controller, self.counters)
        self.lookup = RowLookup(options, fail_safe)
        self.first_tokens = FirstTokenPolicy()
        self.note = SchedulerNote()  # what the scheduler said with the step in progress
        self.look_up = True  # the ranks' agreed decision, for the next step
        self.request_facts = RequestTable()  # per live request
        self.prefix_cache_resets = 0  # as the scheduler's note last counted them
        # (compiled now, at the engine's start, not in its first request's step)
        fail_safe.attempt(warm_up_lookup_plan)
        fail_safe.attempt(warm_up_acceptance)
        fail_safe.attempt(warm_up_cost_fit)
        fail_safe.attempt(warm_up_draining_plan)
        fail_safe.attempt(warm_up_prediction_cursor)
        fail_safe.attempt(warm_up_request_predictions)
        fail_safe.attempt(warm_up_step_rows)
        if options.lookup:
            fail_safe.attempt(warm_up_lookup)

    def begin_step(self, note: SchedulerNote, live_requests) -> None:
        """A step began: the scheduler's note (a new prefix-cache reset empties the history; new
        requests' tenants)."""
        self.lessons.note_step()
        self.note = note
        if note.prefix_cache_resets != self.prefix_cache_resets:
            self.prefix_cache_resets = note.prefix_cache_resets
            self.lookup.forget_history()
        fault_point("update_states")
        self.lookup.admit(note.tenants, live_requests)
        self.controller.acceptance.requests.keep_only(live_requests)
        self.request_facts.keep_only(live_requests)

    def propose(self, step, clock: PartClock, *, probed, warmed_up: bool, draft) -> list[list[int]]:
        """One step's drafts, the proposer's order, every rank alike: tick the fail-safe, the
        rank-local part (`prepare`), the ranks' agreement on drafting and on the shared votes,
        then `draft(prepared, warm_up)`, the part every rank runs alike (none if anything
        fails on any rank: `fail_safe`). `probed`: the requests whose prompts are measured for
        self-drafting; `warmed_up`: whether this rank's self-drafting has warmed up."""
        rows = step.num_rows
        try:
            self.fail_safe.tick()
            if self.fail_safe.disabled:
                return self.no_drafts(rows)
            prepared = self.fail_safe.attempt(lambda: self.prepare(step, clock, probed))
            votes = (int(self.wants_lookup(prepared)), int(not warmed_up))
            clock.lap("plan")
            may_draft, (look_up, warm_up) = self.fail_safe.agree(prepared is not None, votes)
            self.look_up = bool(look_up)
            clock.lap("agree")
            if not may_draft:
                return self.no_drafts(rows)
            return self.fail_safe.call(lambda: draft(prepared, bool(warm_up)), lambda: self.no_drafts(rows))
        finally:
            self.lessons.call_ended()
            clock.lap("draft")

    def prepare(self, step, clock: PartClock, probed) -> PreparedStep:
        """The rank-local part of a step, before the ranks meet: learn from the step that ran,
        offer each row's lookup draft and plan (each rank its own plan; rank 0's is used).
        `probed`: the requests whose prompts are measured for self-drafting."""
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
        budgets = self.lookup.budgets(step, rows, self.num_speculative_tokens)
        found = self.lookup.find(step, rows, budgets, self.look_up)
        if self.lookup.rows_looked_up:
            self.controller.observe_lookup(self.lookup.rows_looked_up, self.lookup.seconds)
        self.counters.rows_looked_up += self.lookup.rows_looked_up
        self.counters.tokens_offered += int(found.lengths.sum())
        clock.lap("look_up")
        offers = found.offers(step, rows, budgets, probed=probed)
        # (once a step: the plan prices the drafts by them, and learning weighs what was accepted)
        gains = self.controller.acceptance.step_gains(offers)
        self_budget = self.options.uncopied_budget(max(budgets, default=0))
        plan = self.plan(offers, gains, self_budget, first_tokens)
        return PreparedStep(step, found, offers, gains, plan.as_ints())

    def plan(self, offers: StepOffers, gains: StepGains, self_budget: int, first_tokens: FirstTokens) -> DraftPlan:
        """How much of each kind of draft pays this step (everything offered, if not adaptive)."""
        fault_point("plan")
        if first_tokens == FirstTokens.QUEUED:
            self.counters.steps_prompts_waiting += 1
            return DraftPlan.nothing(len(offers))
        if not self.options.adaptive:
            return DraftPlan.everything(offers, self_budget)
        expected = first_tokens == FirstTokens.EXPECTED
        return self.controller.plan(
            offers, self_budget, draining=self.first_tokens.draining, prompts_waiting=expected, gains=gains
        )

    def wants_lookup(self, prepared: PreparedStep | None) -> bool:
        """This rank's vote on looking up next step (the ranks look up if any wants to): it is
        paid on every row before any plan, so the controller weighs it against what it saved."""
        if not self.options.lookup or not self.options.adaptive:
            return True
        try:
            return self.controller.look_up_next(len(prepared.offers) if prepared is not None else 0)
        except Exception as err:  # a vote is no reason to skip the agreement
            self.fail_safe.record(err)
            return True

    def take_lookup_drafts(self, prepared: PreparedStep, plan: DraftPlan, drafts: list[list[int]]) -> None:
        """The planned part of each row's lookup draft, into `drafts` (by batch row)."""
        index, found, lengths = prepared.step.rows.index.tolist(), prepared.found, plan.lookup_lengths
        taken = [i for i, length in enumerate(lengths) if length]
        for i in taken:
            drafts[index[i]] = found.taken(i, lengths[i])
        # (what is learned is guarded on its own)
        self.fail_safe.attempt(lambda: self.lessons.lookup_drafts_taken(prepared, taken, [lengths[i] for i in taken]))

    def forget(self, req_id: str, request=None) -> None:
        """The request ended: drop what is tracked for it, and keep its output for its tenant's
        later requests (`RowLookup.forget`)."""
        # Each clean-up on its own, so that one that raises leaves nothing else behind.
        for clean_up in (
            lambda: self.request_facts.forget(req_id),
            lambda: self.lookup.forget(req_id, request),
            lambda: self.controller.forget(req_id),
        ):
            self.fail_safe.attempt(clean_up)  # (never let clean-up of an optimisation fail a request)

    def no_drafts(self, rows: int) -> list[list[int]]:
        self.lessons.step_ended(drafted=False)
        return [[] for _ in range(rows)]
