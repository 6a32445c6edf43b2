# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Past one machine, as far as this one can test it: tensor parallelism (masks and drafts
identical on every rank), Ray Data batch inference with a self-admg engine in every replica on
a local Ray cluster, and a clear refusal of vLLM's Ray executor, which vLLM 0.32's CPU build
does not support (docs/design.md, "Past one machine")."""

import pytest
from ray import cloudpickle
from vllm import SamplingParams

import benchmarks
from benchmarks import ray_data_batch
from vllm_selfspec.operations.worker_extension import proposer_report

from conftest import ENGINE_DEFAULTS, close_llm, make_llm, spec_counters, token_ids
from fault_injection import INJECT_ENV

# Ray's workers import modules by name only from the driver's working directory; ship the lab's
# code by value, so that the test passes from any directory.
cloudpickle.register_pickle_by_value(benchmarks)

pytestmark = pytest.mark.engine

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def plain_greedy(plain_tiny, tiny_prompts):
    return token_ids(plain_tiny.generate(tiny_prompts, SamplingParams(**GREEDY), use_tqdm=False))


def test_ray_data_replicas_match_plain_decoding(
    ray_cluster, tiny_model_path, tiny_prompts, mixed_options, plain_greedy
):
    rows = ray_data_batch.generate(
        tiny_prompts * 2,
        str(tiny_model_path),
        mixed_options,
        workers=2,
        sampling=GREEDY,
        engine=ENGINE_DEFAULTS,
        batch_size=1,
    )
    assert [r["token_ids"] for r in rows] == plain_greedy * 2
    assert len({r["replica"] for r in rows}) == 2  # both replicas served rows


def within(seconds: float, call):
    """call(), failing the test (and ending the engine's processes) if it has not returned in
    `seconds`: ranks out of step hang in a collective rather than fail."""
    import threading

    import psutil

    result = {}
    thread = threading.Thread(target=lambda: result.update(value=call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for child in psutil.Process().children(recursive=True):
            child.kill()
        pytest.fail(f"no answer within {seconds} s: the tensor-parallel ranks hung")
    return result["value"]


def test_tensor_parallel_ranks_take_identical_decisions(
    tiny_model_path, tiny_prompts, mixed_options, plain_greedy, monkeypatch
):
    """Tensor parallel 2 (vLLM's multiprocessing executor: the Ray executor does not run on the
    CPU build). Each rank holds half of every layer; masks come from all-reduced activations
    and, with the draft tokens and exits, are broadcast from rank 0, so every rank must hold
    the same masks and draft the same tokens. A fault on rank 1 only, in its own part of a step,
    makes both ranks skip that step's drafts (without their agreement rank 0 would wait in the
    step's broadcast for a rank that is not coming)."""
    # vLLM's CPU auto-binding wants a NUMA node per rank, and this machine has one: one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv(INJECT_ENV, "lookup@5@rank1")
    hybrid = {
        **mixed_options,
        "lookup": True,
        "adaptive": True,  # rank-local timings
        "experimental": {**mixed_options["experimental"], "lookup_max_match": 4},
    }
    llm = make_llm(tiny_model_path, tensor_parallel_size=2, speculative_config=hybrid)
    try:
        outputs = within(120, lambda: llm.generate(tiny_prompts, SamplingParams(**GREEDY), use_tqdm=False))
        assert token_ids(outputs) == plain_greedy
        # Long enough for the controller to retry self-drafts (so masks exist to compare).
        within(120, lambda: llm.generate(tiny_prompts, SamplingParams(**{**GREEDY, "max_tokens": 96}), use_tqdm=False))
        assert spec_counters(llm)["num_draft_tokens"] > 0
        reports = llm.collective_rpc(proposer_report)
        assert len(reports) == 2
        assert reports[0]["measurements"] and reports[0]["measurements"] == reports[1]["measurements"]
        for counter in ("draft_steps", "draft_tokens", "lookup_tokens", "steps_skipped_for_faults"):
            assert reports[0][counter] == reports[1][counter]
        assert reports[0]["draft_tokens"] + reports[0]["lookup_tokens"] > 0
        assert [r["faults"] for r in reports] == [0, 1] and reports[0]["steps_skipped_for_faults"] == 1
        assert not any(r["drafting_disabled"] for r in reports)

        # Rank 1 alone reaches its fault limit: both ranks switch off in the same step, without
        # hanging, and serve on as plain decoding.
        def limit_reached_on_rank_1(worker):  # nested, so pickled by value into the workers
            from vllm_selfspec.vllm_integration.draft_forward import tensor_parallel_rank

            if tensor_parallel_rank() == 1:
                worker.model_runner.drafter.fail_safe.switch_off_wanted = True

        llm.collective_rpc(limit_reached_on_rank_1)
        outputs = within(120, lambda: llm.generate(tiny_prompts, SamplingParams(**GREEDY), use_tqdm=False))
        assert token_ids(outputs) == plain_greedy
        reports = llm.collective_rpc(proposer_report)
        assert [r["drafting_disabled"] for r in reports] == [True, True]
    finally:
        close_llm(llm)


def test_a_fault_on_one_rank_inside_the_draft_forwards_stops_every_rank_at_one_checkpoint(
    tiny_model_path, tiny_prompts, mixed_options, plain_greedy, monkeypatch
):
    """After the ranks agreed to draft, rank 1 alone faults inside a probe's forward and then
    inside a draft step's forward (after its forward context is set, before the target's
    modules run). Rank 0 must not wait in a collective rank 1 never reaches: both stop at the
    same checkpoint, serve those steps without drafts, count the same skipped steps, and go on
    drafting (`mixed_options` self-drafts in every step, so the forwards are certain to run)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv(INJECT_ENV, "probe@3@rank1,draft@3@rank1")  # (the warm-up probes twice)
    llm = make_llm(tiny_model_path, tensor_parallel_size=2, speculative_config=mixed_options)
    try:
        outputs = within(120, lambda: llm.generate(tiny_prompts, SamplingParams(**GREEDY), use_tqdm=False))
        assert token_ids(outputs) == plain_greedy
        reports = llm.collective_rpc(proposer_report)
    finally:
        close_llm(llm)
    assert [r["faults"] for r in reports] == [0, 2], [r["fault_kinds"] for r in reports]
    assert [r["steps_skipped_for_faults"] for r in reports] == [2, 2]
    for counter in ("draft_steps", "draft_tokens"):
        assert reports[0][counter] == reports[1][counter] > 0, counter
    assert not any(r["drafting_disabled"] for r in reports)


def test_ray_executor_on_the_cpu_build_is_refused_early(tiny_model_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec.options import SelfAdmgConfigError

    with pytest.raises(SelfAdmgConfigError, match="distributed_executor_backend='ray' does not run"):
        EngineArgs(
            model=str(tiny_model_path), distributed_executor_backend="ray", speculative_config={"method": "self-admg"}
        ).create_engine_config()
