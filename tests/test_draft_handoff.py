# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A step's drafts reach the engine core with its sampled tokens (vllm_integration/
draft_handoff.py): vLLM's executors, whose calls to the workers are answered here, hand over the
drafts a step's output carried without asking the workers again, ask them as vLLM does where an
output carries none, and never hand over an earlier step's. No engine starts here: the engine
tests run every request through the hand-off (a fault in it, `test_fail_safe.py`'s hooks, leaves
the output plain's)."""

from __future__ import annotations

import pickle

import pytest
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from vllm_selfspec.vllm_integration import draft_handoff

EXECUTORS = (MultiprocExecutor, UniProcExecutor)


@pytest.fixture(scope="module", autouse=True)
def handoff_patched():
    draft_handoff.apply()  # (as the plugin does in the engine process; a second apply is a no-op)


def executor_of(cls, replies: dict):
    """An executor of class `cls` whose calls to the workers get `replies[method]()`, each call
    recorded by method name."""
    executor, calls = object.__new__(cls), []

    def collective_rpc(method, *args, **kwargs):
        calls.append(method)
        return replies[method]()

    executor.collective_rpc = collective_rpc
    executor.output_rank, executor.kv_output_aggregator, executor.ec_output_aggregator = 0, None, None
    return executor, calls


def step_output(drafts=None, attach=True):
    """A step's output as the engine process receives it (pickled on the way, as vLLM's message
    queue sends it), with `drafts` attached by the runner if `attach`."""
    output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[1], [2]])
    if attach:
        draft_handoff.attach(output, lambda: drafts)
    return pickle.loads(pickle.dumps(output))


@pytest.mark.parametrize("cls", EXECUTORS)
def test_a_steps_drafts_come_with_its_output_and_no_call_asks_for_them(cls):
    drafts = DraftTokenIds(["a", "b"], [[5, 6], []])
    executor, calls = executor_of(cls, {"sample_tokens": lambda: step_output(drafts)})
    output = executor.sample_tokens(None)
    assert output.sampled_token_ids == [[1], [2]] and draft_handoff.DRAFTS not in output.__dict__
    assert executor.take_draft_token_ids() == drafts
    assert calls == ["sample_tokens"]  # (the workers were not asked for the drafts)


@pytest.mark.parametrize("cls", EXECUTORS)
def test_a_step_without_drafts_hands_over_none_without_a_call(cls):
    executor, calls = executor_of(cls, {"sample_tokens": lambda: step_output(None)})
    executor.sample_tokens(None)
    assert executor.take_draft_token_ids() is None and calls == ["sample_tokens"]


@pytest.mark.parametrize("cls", EXECUTORS)
def test_an_output_without_drafts_attached_asks_the_workers_as_vllm_does(cls):
    """Another method's runner, or a hand-off that faulted: the drafts come by vLLM's own call."""
    asked = DraftTokenIds(["a"], [[7]])
    replies = {"sample_tokens": lambda: step_output(attach=False), "take_draft_token_ids": lambda: asked}
    executor, calls = executor_of(cls, replies)
    executor.sample_tokens(None)
    assert executor.take_draft_token_ids() == asked and calls == ["sample_tokens", "take_draft_token_ids"]


@pytest.mark.parametrize("cls", EXECUTORS)
def test_drafts_never_taken_are_not_handed_over_in_a_later_step(cls):
    """A step whose drafts the engine core did not take (it ran no model, say): the next step's
    own output decides, never the earlier drafts."""
    outputs = iter([step_output(DraftTokenIds(["a"], [[5]])), step_output(attach=False)])
    fresh = DraftTokenIds(["a"], [[9]])
    replies = {"sample_tokens": lambda: next(outputs), "take_draft_token_ids": lambda: fresh}
    executor, calls = executor_of(cls, replies)
    executor.sample_tokens(None)
    executor.sample_tokens(None)
    assert executor.take_draft_token_ids() == fresh
    assert executor.take_draft_token_ids() == fresh  # (handed over once: then asked for)
    assert calls == ["sample_tokens", "sample_tokens", "take_draft_token_ids", "take_draft_token_ids"]


def test_the_runner_attaches_drafts_only_to_a_steps_own_output():
    """vLLM returns one shared empty output for steps that sample nothing: drafts put on it
    would ride on every later such step."""
    taken = []
    draft_handoff.attach(EMPTY_MODEL_RUNNER_OUTPUT, lambda: taken.append(1))
    draft_handoff.attach(None, lambda: taken.append(1))
    assert not taken and draft_handoff.DRAFTS not in EMPTY_MODEL_RUNNER_OUTPUT.__dict__
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    draft_handoff.attach(output, lambda: "drafts")
    assert output.__dict__[draft_handoff.DRAFTS] == "drafts"
