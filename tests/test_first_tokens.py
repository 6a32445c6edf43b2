"""What keeps a new prompt's first token as early as under plain decoding in a server: the
scheduler withholds drafts in a step that prefills, and the worker knows when a prompt will
wait for the step it plans (the planner's cap is tested in test_controller.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_selfspec.options import CLOSED_BATCHES_KEY
from vllm_selfspec.vllm_compat.scheduler_queue import waiting_requests, withhold_drafts_beside_prefill


def scheduler(waiting=0, running_full=False, prefilling=False, closed_batches=False):
    running = [SimpleNamespace(spec_token_ids=[5, 6], is_prefill_chunk=False) for _ in range(3)]
    running[-1].is_prefill_chunk = prefilling
    if prefilling:
        running[-1].spec_token_ids = []
    return SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={CLOSED_BATCHES_KEY: True} if closed_batches else {}),
        running=running,
        max_num_running_reqs=3 if running_full else 8,
        get_request_counts=lambda: (len(running), waiting),
    )


@pytest.mark.parametrize(
    "case, withheld",
    [
        (dict(), False),
        (dict(waiting=2), True),
        (dict(prefilling=True), True),
        (dict(waiting=2, running_full=True), False),  # they wait for a slot, which drafts hasten
        (dict(waiting=2, closed_batches=True), False),  # offline: a first token is worth nothing early
    ],
)
def test_a_step_that_will_prefill_verifies_no_drafts_in_a_server(case, withheld):
    s = scheduler(**case)
    assert withhold_drafts_beside_prefill(s) == withheld
    decoding = [r for r in s.running if not r.is_prefill_chunk]
    assert all((r.spec_token_ids == []) == withheld for r in decoding)


def test_a_scheduler_output_without_the_count_says_none_wait():
    assert waiting_requests(SimpleNamespace()) == 0
    assert waiting_requests(SimpleNamespace(self_admg_waiting=3)) == 3


def step_view(rows):
    """A StepView over fake runner state: rows of (max_tokens, tokens out, last sampled, params)."""
    from vllm.sampling_params import SamplingParams

    from vllm_selfspec.vllm_compat.runner_state import StepView

    requests = {}
    for i, (max_tokens, out, _, extra) in enumerate(rows):
        params = SamplingParams(max_tokens=max_tokens, **extra)
        params.update_from_generation_config({}, eos_token_id=2)
        requests[f"r{i}"] = SimpleNamespace(sampling_params=params, output_token_ids=[7] * out)
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(requests)), requests=requests)
    return StepView(runner, SimpleNamespace(), [[7, last] for *_, last, _ in rows])


def test_rows_that_end_with_the_step_are_counted():
    assert step_view([(16, 10, 9, {}), (16, 3, 9, {})]).finishing_rows == 0
    assert step_view([(16, 16, 9, {}), (16, 3, 9, {})]).finishing_rows == 1  # at max_tokens
    assert step_view([(16, 10, 2, {}), (16, 3, 9, {})]).finishing_rows == 1  # end of sequence
    assert step_view([(16, 10, 2, {"ignore_eos": True})]).finishing_rows == 0
    assert step_view([(16, 10, 11, {"stop_token_ids": [11]})]).finishing_rows == 1


def test_a_server_expects_a_prompt_when_a_request_ends_and_an_offline_batch_does_not():
    from vllm_selfspec.proposer import SelfAdmgProposer

    ending = SimpleNamespace(waiting_requests=0, finishing_rows=1)
    queued = SimpleNamespace(waiting_requests=2, finishing_rows=0)
    quiet = SimpleNamespace(waiting_requests=0, finishing_rows=0)
    for closed_batches, expected in ((False, [True, True, False]), (True, [False, True, False])):
        proposer = SimpleNamespace(closed_batches=closed_batches)
        assert [SelfAdmgProposer._prompts_waiting(proposer, s) for s in (ending, queued, quiet)] == expected
