# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A step's drafts reach the engine core with its sampled tokens (vllm_integration/
draft_handoff.py): vLLM's executors, whose calls to the workers are answered here, hand over the
drafts a step's output carried without asking the workers again, ask them as vLLM does where an
output carries none, and never hand over an earlier step's; and in real engines the drafts handed
over are those vLLM's own call returns, a fault in the hand-off costing no drafts."""

from __future__ import annotations

import pickle

import pytest
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from vllm_selfspec.vllm_integration import draft_handoff

from conftest import close_llm, make_llm, proposer_report, spec_counters, token_ids
from fault_injection import INJECT_ENV

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


SPEC = {
    "method": "self-admg",
    "num_speculative_tokens": 3,
    "adaptive": False,
}  # (drafts by rule: alike in every engine)


def served(model, prompts, drafts_with_output: bool):
    """The tokens, vLLM's spec-decode counters and the proposer's report of one engine."""
    from vllm import SamplingParams

    llm = make_llm(model, speculative_config={**SPEC, "experimental": {"drafts_with_output": drafts_with_output}})
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return token_ids(outputs), spec_counters(llm), proposer_report(llm)
    finally:
        close_llm(llm)


@pytest.mark.engine
def test_the_drafts_handed_over_are_those_vllm_asks_for(tiny_model_path, tiny_prompts, monkeypatch):
    """Engines alike but for the hand-off verify the same drafts and accept the same tokens (a
    step handed an earlier step's drafts would accept fewer); the option on, steps' drafts are
    handed over, off, none are; and with every hand-off faulting the drafts still arrive, by
    vLLM's call, and no drafting fault is counted."""
    handed = served(tiny_model_path, tiny_prompts, True)
    asked = served(tiny_model_path, tiny_prompts, False)
    monkeypatch.setenv(INJECT_ENV, "draft_handoff@every")
    faulted = served(tiny_model_path, tiny_prompts, True)
    assert handed[0] == asked[0] == faulted[0]
    assert handed[1] == asked[1] == faulted[1] and handed[1]["num_draft_tokens"] > 0, (handed[1], asked[1])
    assert handed[2]["drafts_handed_over"] > 0 and asked[2]["drafts_handed_over"] == 0
    faults = faulted[2]
    assert faults["draft_handoff_faults"] > 0 and faults["drafts_handed_over"] == 0 and faults["faults"] == 0, faults
