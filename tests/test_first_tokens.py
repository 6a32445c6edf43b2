# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What keeps a new prompt's first token as early as under plain decoding in a server: the
scheduler withholds drafts in a step about to prefill, and the worker knows when a prompt will
wait for the step it plans (the planner's cap is tested in test_controller.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from vllm_selfspec.control.first_tokens import FirstTokenPolicy, FirstTokens
from vllm_selfspec.options import CLOSED_BATCHES_KEY
from vllm_selfspec.scheduler_note import SchedulerNote, note_of
from vllm_selfspec.vllm_integration.scheduler_queue import schedule_for_first_tokens


def waiting(output) -> int:
    return note_of(output).waiting_requests


class FakeScheduler:
    """What the rule reads of vLLM 0.32's `Scheduler` (its names are checked against vLLM's
    source below); `admits` says whether vLLM's schedule admits the waiting requests."""

    def __init__(self, waiting=0, slots=8, prefilling=False, closed_batches=False, blocked=0, paused=False):
        from vllm.v1.core.sched.interface import PauseState

        self.vllm_config = SimpleNamespace(additional_config={CLOSED_BATCHES_KEY: True} if closed_batches else {})
        self.running = [SimpleNamespace(spec_token_ids=[5, 6], is_prefill_chunk=False) for _ in range(3)]
        self.running[-1].is_prefill_chunk = prefilling
        self.waiting, self.deferred_waiting = waiting, set(range(blocked))
        self.max_num_active_reqs, self.num_waiting_for_streaming_input = slots, 0
        self._pause_state = PauseState.PAUSED_NEW if paused else PauseState.UNPAUSED
        self.admits = True
        self.drafts_scheduled = None
        self.requests = {}  # by id: what the scheduler holds of each request (its cache_salt)

    def get_request_counts(self):
        return len(self.running), self.waiting

    def vllm_schedule(self):
        """vLLM's schedule, as far as the rule sees it: the drafts it finds, whom it admits."""
        self.drafts_scheduled = [list(r.spec_token_ids) for r in self.running if not r.is_prefill_chunk]
        admitted = self.waiting if self.admits else 0
        self.waiting -= admitted
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=f"new-{i}") for i in range(admitted)],
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        )

    def step(self):
        output = schedule_for_first_tokens(self, self.vllm_schedule)
        return not any(self.drafts_scheduled), output


@pytest.mark.parametrize(
    "case, withheld",
    [
        (dict(), False),
        (dict(waiting=2), True),
        (dict(prefilling=True), True),
        (dict(waiting=2, slots=3), False),  # they wait for a slot, which drafts hasten
        (dict(waiting=2, blocked=2), False),  # both wait for a grammar or remote KV
        (dict(waiting=2, paused=True), False),
        (dict(waiting=2, closed_batches=True), False),  # offline: a first token is worth nothing early
    ],
)
def test_a_step_about_to_prefill_verifies_no_drafts_in_a_server(case, withheld):
    """vLLM's schedule finds the drafts cleared exactly when the step will admit or continue
    a prefill."""
    assert FakeScheduler(**case).step()[0] == withheld


def test_a_queue_that_cannot_move_stops_withholding_until_the_counts_change():
    """Withholding that admitted nobody (a full KV cache, say) is not repeated while nothing
    changes, so drafting never stops for a queue that cannot move."""
    s = FakeScheduler(waiting=2)
    s.admits = False
    withheld, output = s.step()
    assert withheld and waiting(output) == 0
    for _ in range(4):  # same counts: drafts verified, and the workers hear of no queue
        for r in s.running:
            r.spec_token_ids = [5, 6]
        withheld, output = s.step()
        assert withheld is False and waiting(output) == 0
    s.waiting += 1  # a new arrival: try again
    for r in s.running:
        r.spec_token_ids = [5, 6]
    assert s.step()[0] is True


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_a_stream_of_long_prompts_withholds_drafts_in_at_most_the_operators_share_of_steps(share):
    """One tenant's prompts prefilled in chunks, one after another, for 200 steps: the running
    requests verify drafts in all but `max_withheld_share` of the steps (plus the few banked),
    and the workers plan drafts for a step that may not withhold them."""
    from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY
    from vllm_selfspec.vllm_integration.scheduler_queue import MAX_BANKED_WITHHOLDINGS

    s = FakeScheduler(prefilling=True, waiting=1)
    s.admits = False  # another prompt always waits behind the one being prefilled
    s.vllm_config.additional_config = {ADDITIONAL_CONFIG_KEY: {"max_withheld_share": share}}
    withheld_steps, told_waiting = 0, []
    for _ in range(200):
        for r in s.running:
            r.spec_token_ids = [5, 6]
        withheld, output = s.step()
        withheld_steps += withheld
        told_waiting.append(waiting(output) > 0)
    assert withheld_steps <= share * 200 + MAX_BANKED_WITHHOLDINGS
    assert withheld_steps >= share * 200 - 1
    if share < 1:
        assert not all(told_waiting)  # the workers draft for the steps past the share


def test_the_workers_hear_of_admissible_requests_left_waiting():
    s = FakeScheduler(waiting=0)
    assert waiting(s.step()[1]) == 0
    s = FakeScheduler(waiting=3, slots=8)
    s.vllm_schedule = lambda: SimpleNamespace(  # admits one of three
        scheduled_new_reqs=[SimpleNamespace(req_id="new")], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set())
    )
    s.waiting = 3
    output = schedule_for_first_tokens(s, lambda: (setattr(s, "waiting", 2), s.vllm_schedule())[1])
    assert waiting(output) == 2
    assert note_of(SimpleNamespace()) == SchedulerNote()  # a step without a note: nobody waits


def test_the_note_carries_each_new_requests_tenant_as_a_digest_and_only_its_own_version_is_read():
    from vllm_selfspec.scheduler_note import NOTE_ATTRIBUTE, salt_digest

    s = FakeScheduler(waiting=3)
    s.requests = {
        "new-0": SimpleNamespace(cache_salt="alice"),
        "new-1": SimpleNamespace(cache_salt=None),
        "new-2": SimpleNamespace(),  # a vLLM without cache_salt: the tenant stays unknown
    }
    note = note_of(s.step()[1])
    assert note.tenants == (("new-0", salt_digest("alice")), ("new-1", None))
    assert len(salt_digest("x" * 100_000)) == 16
    output = SimpleNamespace()
    setattr(output, NOTE_ATTRIBUTE, SimpleNamespace(version=2, waiting_requests=5))  # another version
    assert note_of(output) == SchedulerNote()


def test_a_fault_in_the_rule_never_reaches_vllms_scheduler():
    s = FakeScheduler(waiting=2)
    del s.deferred_waiting  # a vLLM without the attribute
    withheld, output = s.step()
    assert not withheld and waiting(output) == 0


def test_the_scheduler_attributes_the_rule_reads_are_vllms():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    source = inspect.getsource(Scheduler)
    for name in (
        "running",
        "deferred_waiting",
        "max_num_active_reqs",
        "num_waiting_for_streaming_input",
        "_pause_state",
    ):
        assert f"self.{name}" in source, name
    assert "def get_request_counts" in source and "self.is_prefill_chunk" in inspect.getsource(Request)


def step_view(rows):
    """A StepView over fake runner state: rows of (max_tokens, tokens out, sampled, params)."""
    from vllm.sampling_params import SamplingParams

    from vllm_selfspec.vllm_integration.runner_state import StepView

    requests = {}
    for i, (max_tokens, out, _, extra) in enumerate(rows):
        params = SamplingParams(max_tokens=max_tokens, **extra)
        params.update_from_generation_config({}, eos_token_id=2)
        requests[f"r{i}"] = SimpleNamespace(sampling_params=params, output_token_ids=[7] * out)
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(requests)), requests=requests)
    return StepView(runner, SimpleNamespace(), [sampled for _, _, sampled, _ in rows])


def test_rows_that_end_with_the_step_are_counted():
    assert step_view([(16, 10, [9], {}), (16, 3, [9], {})]).finishing_rows == 0
    assert step_view([(16, 16, [9], {}), (16, 3, [9], {})]).finishing_rows == 1  # at max_tokens
    assert step_view([(16, 10, [9, 2], {}), (16, 3, [9], {})]).finishing_rows == 1  # end of sequence
    assert step_view([(16, 10, [2, 9, 9], {})]).finishing_rows == 1  # within an accepted draft
    assert step_view([(16, 10, [2], {"ignore_eos": True})]).finishing_rows == 0
    assert step_view([(16, 10, [11], {"stop_token_ids": [11]})]).finishing_rows == 1


def _first_tokens_over(views, closed_batches=False):
    policy = FirstTokenPolicy()
    return [
        policy.next_step(
            step=step,
            note=SchedulerNote(waiting_requests=view.waiting_requests, closed_batches=closed_batches),
            ended=view.finishing_rows,
            admitted=view.admitted_requests,
            engine_was_busy=view.engine_was_busy,
        )
        for step, view in enumerate(views, start=1)
    ]


def _view(waiting=0, ended=0, admitted=0, busy=True):
    return SimpleNamespace(
        waiting_requests=waiting, finishing_rows=ended, admitted_requests=admitted, engine_was_busy=busy
    )


ENDING, QUEUED, QUIET, ADMITTING = _view(ended=1), _view(waiting=2), _view(), _view(admitted=1)


def test_a_server_expects_a_prompt_for_two_steps_after_a_request_ends_and_an_offline_batch_never():
    E, Q, N = FirstTokens.EXPECTED, FirstTokens.QUEUED, FirstTokens.NONE_WAIT
    assert _first_tokens_over([QUIET, ENDING, QUIET, QUIET, QUEUED]) == [N, E, E, N, Q]
    assert _first_tokens_over([QUIET, ENDING, QUIET, QUIET, QUEUED], closed_batches=True) == [N] * 5


def test_ends_nobody_refills_stop_capping_the_steps_after_them_and_a_refill_brings_it_back():
    """The last requests of a run (or arrivals that do not follow departures) leave slots empty:
    capping the steps after their ends would only cost drafts where drafting pays most."""
    E, N = FirstTokens.EXPECTED, FirstTokens.NONE_WAIT
    refilled = [ENDING, QUIET, ADMITTING] * 4  # a client sends its next prompt as one ends
    assert _first_tokens_over(refilled)[-3:] == [E, E, N]
    unrefilled = [ENDING, QUIET, QUIET, QUIET, QUIET]
    views = unrefilled * 3 + [ENDING, ADMITTING] + unrefilled
    # After two ends nobody refilled, the third end is no longer capped; from there one
    # refilled end restores the cap.
    assert [_first_tokens_over(views)[i] for i in (0, 5, 10, 15, 17)] == [E, E, N, N, E]
    # Ends in consecutive steps, none refilled, lift it too.
    assert _first_tokens_over([ENDING] * 6)[-1] == N


def _share_after(views) -> float:
    from vllm_selfspec.control.first_tokens import Refills

    refills = Refills()
    for step, view in enumerate(views, start=1):
        refills.observe(
            step=step, ended=view.finishing_rows, admitted=view.admitted_requests, engine_was_busy=view.engine_was_busy
        )
    return refills.share


def test_an_end_is_refilled_by_an_admission_within_three_steps_after_it():
    from vllm_selfspec.control.first_tokens import REFILL_WEIGHT

    missed = 1 - REFILL_WEIGHT
    assert _share_after([ENDING, QUIET, ADMITTING, QUIET, QUIET]) == 1.0
    assert _share_after([ENDING, QUIET, QUIET, ADMITTING, QUIET]) == 1.0  # admitted a step late
    assert _share_after([ENDING, QUIET, QUIET, QUIET, ADMITTING]) == pytest.approx(missed)
    # An admission in the step of the end was a prompt that was already waiting.
    assert _share_after([_view(ended=1, admitted=1), QUIET, QUIET, QUIET, QUIET]) == pytest.approx(missed)
    # Two ends, one admission: one refilled, one not.
    assert _share_after([_view(ended=2), ADMITTING, QUIET, QUIET, QUIET]) == pytest.approx(missed)
    # A prompt admitted into an idle engine waited for no step in progress.
    assert _share_after([ENDING, _view(admitted=1, busy=False), QUIET]) == pytest.approx(missed)


def test_ends_waiting_for_a_refill_are_bounded_by_the_window():
    from vllm_selfspec.control.first_tokens import REFILL_WINDOW_STEPS, Refills

    refills = Refills()
    for step in range(1, 1000):
        refills.observe(step=step, ended=16, admitted=0, engine_was_busy=True)
        assert len(refills._pending) <= 16 * (REFILL_WINDOW_STEPS + 1)
    assert refills.share < 1e-6


@pytest.mark.engine
def test_a_server_engine_withholds_drafts_while_it_admits_a_prompt_and_tells_the_workers_who_waits(
    tiny_model_path, tiny_prompt_ids, plain_tiny
):
    """End to end, in an engine built as a server builds it (not offline, where batches are
    closed): two requests decode with drafts, then two long prompts arrive at once while the
    step's token budget admits one chunk. The drafts made before the admission are withheld, the
    workers are told a prompt waits, and every output is plain decoding's."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from benchmarks.engine import engine_args

    from conftest import ENGINE_DEFAULTS, proposer_report, token_ids

    # Drafts in every step: self-drafts of K tokens where lookup has none (the random tiny model
    # is unsure of every token, so no draft exit).
    spec = {"method": "self-admg", "num_speculative_tokens": 4, "adaptive": False, "draft_exit_threshold": 0.0}
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            **engine_args(tiny_model_path, **ENGINE_DEFAULTS, max_num_batched_tokens=64), speculative_config=spec
        )
    )
    # The engine core steps on its own: the decoding requests run long enough to be decoding
    # still when the prompts arrive.
    long, params = (
        SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    )
    decoding, arriving = tiny_prompt_ids[:2], [tiny_prompt_ids[3], tiny_prompt_ids[3][1:]]
    assert min(len(ids) for ids in arriving) > 64  # more than a step's token budget each
    outputs = {}

    def step():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)

    try:
        for i, ids in enumerate(decoding):
            engine.add_request(f"decoding-{i}", {"prompt_token_ids": ids}, long)
        for _ in range(20):  # until both decode with drafts
            step()
            before = proposer_report(engine)
            if before["draft_tokens"] + before["lookup_tokens"] > 0:
                break
        assert before["draft_tokens"] + before["lookup_tokens"] > 0 and not outputs
        for i, ids in enumerate(arriving):
            engine.add_request(f"arriving-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            step()
        after = proposer_report(engine)
    finally:
        engine.engine_core.shutdown()
    assert after["draft_tokens_withheld"] > before["draft_tokens_withheld"]
    assert after["steps_prompts_waiting"] > before["steps_prompts_waiting"]
    prompts = [{"prompt_token_ids": ids} for ids in decoding + arriving]
    plain = token_ids(plain_tiny.generate(prompts, [long, long, params, params], use_tqdm=False))
    names = [f"decoding-{i}" for i in range(2)] + [f"arriving-{i}" for i in range(2)]
    assert [outputs[name] for name in names] == plain


def test_a_steps_rows_read_at_once_are_each_row_read_alone():
    """`StepView.rows` (the rows' facts gathered from a `RequestTable` kept from step to step)
    against each request's own sampling parameters: the rows that sampled, their tokens left,
    whether they sample, may draft and sent a prediction, their draft budgets and how many end with the step (at
    max_tokens, or on a stop id among its tokens); over steps where requests end and new ones
    take their slots."""
    import random

    from vllm.sampling_params import SamplingParams

    from vllm_selfspec.sources.prediction import PREDICTION_KEY
    from vllm_selfspec.vllm_integration.runner_state import RequestFacts, RequestTable, StepRow, StepView

    rng = random.Random(4)
    table, live, compared, ended = RequestTable(), {}, 0, 0
    predicting = {"extra_args": {PREDICTION_KEY: [5, 6, 7]}}  # (what the front door leaves on a request)
    for step_index in range(60):
        while len(live) < 5 or rng.random() < 0.3:
            extra = rng.choice(
                [{}, {"temperature": 0.8}, {"min_p": 0.1, "temperature": 0.5}, {"stop_token_ids": [11]}, predicting]
            )
            params = SamplingParams(max_tokens=rng.choice([None, 4, 40]), **extra)
            params.update_from_generation_config({}, eos_token_id=2)
            live[f"r{step_index}-{len(live)}"] = SimpleNamespace(sampling_params=params, output_token_ids=[])
        req_ids = list(live)
        rng.shuffle(req_ids)
        sampled = [[rng.choice([7] * 30 + [2, 11]) for _ in range(rng.randint(0, 3))] for _ in req_ids]
        for req_id, tokens in zip(req_ids, sampled):
            live[req_id].output_token_ids.extend(tokens)
        runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids), requests=live)
        view = StepView(runner, SimpleNamespace(), sampled, table)
        rows, want, ending, predicted = view.rows, [], 0, []
        for i, (req_id, tokens) in enumerate(zip(req_ids, sampled)):
            facts = RequestFacts.of(live[req_id].sampling_params)
            if tokens:
                left = None if facts.max_tokens is None else facts.max_tokens - len(live[req_id].output_token_ids)
                want.append(StepRow(i, req_id, left, facts.sampled, facts.may_draft))
                predicted.append(PREDICTION_KEY in (live[req_id].sampling_params.extra_args or {}))
                ending += (left is not None and left <= 0) or not facts.stop_ids.isdisjoint(tokens)
        assert list(rows) == want
        assert rows.budgets(8).tolist() == [row.draft_budget(8) if row.may_draft else 0 for row in want]
        assert rows.predicted.tolist() == predicted
        assert view.finishing_rows == ending
        compared, ended = compared + len(want), ended + ending
        for req_id in req_ids:  # (requests end: their slots are taken again)
            if rng.random() < 0.2:
                table.forget(req_id)
                del live[req_id]
    assert compared > 150 and ended > 10 and set(table.slot_of) <= set(live)  # (nothing kept of an ended request)
    assert 0 < sum(table.predicted[slot] for slot in table.slot_of.values()) < len(table.slot_of)
    held = [stop_id for slot in table.slot_of.values() for stop_id in table.stop_ids[slot]]
    assert table.every_stop_id == {stop_id: held.count(stop_id) for stop_id in set(held)}


@pytest.mark.parametrize("few_requests", [0, None, 1_000_000])
def test_a_steps_shape_counts_what_the_step_computed(few_requests, monkeypatch):
    """`StepView.shape`, request by request and as arrays (`few_requests`: where one gives way
    to the other), against each scheduled request counted alone: its prompt tokens, its
    logit rows (one, plus one per draft token, the scheduler's -1 padding included), those of
    requests that sample, and the context each logit row attends over; with rows that sampled
    a token (counted as arrays), requests whose facts were not read yet (a partial prefill
    samples nothing), a row that sampled but was not scheduled (vLLM samples no such row; no
    path counts one), and drafts of requests the step did not schedule; and each request's
    draft tokens the step verified. Steps of up to 60 requests, either side of the threshold
    as it ships."""
    import random

    import numpy as np
    from vllm.sampling_params import SamplingParams

    from vllm_selfspec.vllm_integration import runner_state
    from vllm_selfspec.vllm_integration.runner_state import RequestTable, StepShape, StepView

    if few_requests is not None:  # (None: the threshold as it ships)
        monkeypatch.setattr(runner_state, "FEW_REQUESTS", few_requests)
    rng = random.Random(5)
    table = RequestTable()
    for step_index in range(40):
        req_ids = [f"s{step_index}-{i}" for i in range(rng.randint(1, 60))]
        requests = {}
        for req_id in req_ids:
            params = SamplingParams(max_tokens=64, temperature=rng.choice([0.0, 0.0, 0.7]))
            requests[req_id] = SimpleNamespace(sampling_params=params, output_token_ids=[])
        read = [r for r in req_ids if rng.random() < 0.8]  # (the rest: not read yet)
        table.slots(read, requests)
        context = np.array([rng.randint(1, 4000) for _ in req_ids] + [9999], dtype=np.int32)  # (past the rows: unread)
        prompt_chunk = {r: rng.randint(2, 300) for r in req_ids if r not in read and rng.random() < 0.5}
        draft = lambda: [rng.choice([0, 5])] * rng.randint(1, 8) + [-1] * rng.randint(0, 2)  # noqa: E731
        drafts = {r: draft() for r in read if rng.random() < 0.5}
        drafts["elsewhere"] = [5, 5]  # (a request this step did not schedule)
        scheduled = {r: prompt_chunk.get(r, 1 + len(drafts.get(r, ()))) for r in req_ids}
        gone = [f"gone{step_index}-{i}" for i in range(rng.randint(0, 2))]  # (not in the batch: no context)
        scheduled.update(dict.fromkeys(gone, 1))
        # Rows that sampled a token: most of the rest, read or not; one not scheduled at times.
        sampled = [[7] if r not in prompt_chunk and rng.random() < 0.8 else [] for r in req_ids]
        if rng.random() < 0.3:
            unscheduled = rng.choice([r for r in req_ids if r not in prompt_chunk])
            del scheduled[unscheduled]
            sampled[req_ids.index(unscheduled)] = [7]
        out = SimpleNamespace(
            total_num_scheduled_tokens=sum(scheduled.values()),
            num_scheduled_tokens=scheduled,
            scheduled_spec_decode_tokens=drafts,
        )
        batch = SimpleNamespace(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, num_tokens_no_spec=context
        )
        view = StepView(SimpleNamespace(input_batch=batch, requests=requests), out, sampled, table)
        ran = [r for r in req_ids if r in scheduled]
        logit_rows = {r: 1 + (len(drafts[r]) if r in drafts else 0) for r in ran}
        samples = {r: requests[r].sampling_params.temperature > 0 for r in ran}
        draft_tokens = sum(len(drafts[r]) for r in ran if r in drafts)
        assert view.shape() == StepShape(
            prompt_tokens=sum(prompt_chunk.values()) - len(prompt_chunk),
            logit_rows=len(ran) + len(gone) + draft_tokens,
            sampled_rows=sum(logit_rows[r] for r in ran if samples[r]),
            draft_tokens=draft_tokens,
            context_read=sum(logit_rows[r] * int(context[i]) for i, r in enumerate(req_ids) if r in scheduled),
        )
        for req_id in [*req_ids, "elsewhere"]:  # (the drafts it verified: the -1 padding is none)
            assert view.verified_draft_tokens(req_id) == sum(token >= 0 for token in drafts.get(req_id, ()))
        for req_id in read:
            table.forget(req_id)
    nothing = SimpleNamespace(total_num_scheduled_tokens=0)
    assert StepView(SimpleNamespace(input_batch=batch, requests={}), nothing, []).shape() is None
