# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Shared fixtures. Each vLLM engine costs ~20-30 s to start, so engines are built once per
session (or module) and shut down when their last user is done."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

# Tests read the proposer's counters from the worker through collective_rpc with a function.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
sys.path.insert(0, str(Path(__file__).parent))

from benchmarks.engine import build_llm, close_llm  # noqa: E402,F401

from fault_injection import install_test_plugin  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

# The suite's own vLLM plugin (fault injection, the unpatched sampler), in every engine process
# this session starts; it acts only where a test sets its environment variables.
_TEST_PLUGIN_DIR = Path(tempfile.mkdtemp(prefix="vllm-selfspec-test-plugin-"))
atexit.register(shutil.rmtree, _TEST_PLUGIN_DIR, ignore_errors=True)
install_test_plugin(_TEST_PLUGIN_DIR)

ENGINE_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=512,
    disable_log_stats=False,
    seed=0,
)


# Fixtures that start a vLLM engine, a server or a Ray cluster, here and in the test files. A
# test that uses one, however indirectly, is marked `engine` at collection (below), so that a
# new test using one cannot land in the unit lane (`make test-unit`, `-m "not engine"`).
ENGINE_FIXTURES = frozenset(
    {
        "plain_tiny",
        "admg_mixed",
        "admg_none",  # test_tiny_engine.py
        "admg_all",  # test_tiny_engine.py
        "admg_always_drafting",  # test_sampling.py
        "quick_run",  # test_benchmark.py
        "servers",  # test_serve.py
        "faulty_server",  # test_serve.py
        "default_server",  # test_serve.py
        "llm",  # test_tenants.py
        "ray_cluster",  # test_distributed.py
    }
)
# Fixtures that fetch the real SmolLM2 (test_real_model.py): their tests are marked `real_model`.
REAL_MODEL_FIXTURES = frozenset({"smollm2"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(item.fixturenames)  # the whole fixture closure
        if used & ENGINE_FIXTURES and item.get_closest_marker("engine") is None:
            item.add_marker(pytest.mark.engine)
        if used & REAL_MODEL_FIXTURES and item.get_closest_marker("real_model") is None:
            item.add_marker(pytest.mark.real_model)


# Neither prompt lookup nor the adaptive controller: every row self-drafts K tokens each step.
SELF_DRAFTS_ONLY = {"lookup": False, "adaptive": False}


def make_llm(model, **overrides):
    """The lab's engine builder with the test engines' defaults (small, eager, float32)."""
    return build_llm(model, **{**ENGINE_DEFAULTS, **overrides})


def proposer_report(llm) -> dict:
    from vllm_selfspec.operations.worker_extension import proposer_report as report

    return llm.collective_rpc(report)[0]


def spec_counters(llm) -> dict[str, float]:
    from benchmarks.engine import spec_decode_counters

    return spec_decode_counters(llm)


def pin_step_costs(llm, t0: float, t_row: float, t_verify: float, self_step: float) -> None:
    """Fix the engine controller's step costs (seconds: per step, per logit row, once per step
    that verifies drafts, per self-draft step): it observes steps, but plans by these alone, so that what it decides
    follows from acceptance alone, not from how fast this machine runs the tiny model that
    moment. Its cost learning is unit-tested in test_controller.py."""

    def pin(worker):  # nested, so pickled by value into the worker
        from vllm_selfspec.control.step_costs import pin_step_costs as pin_costs

        costs = worker.model_runner.drafter.controller.costs
        pin_costs(costs, t0=t0, t_row=t_row, t_verify=t_verify, self_step=self_step)

    llm.collective_rpc(pin)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_prompts(tiny_model_path) -> list[str]:
    """Prompts of different lengths; several are longer than the chunked-prefill budget used
    by the mixed engine, so their prefill (and statistics) come in chunks."""
    base = [
        "def add(a, b):\n    return a + b\n" * 3,
        "The quick brown fox jumps over the lazy dog. " * 6,
        "for i in range(10):",
        "Summarize the following article in one sentence. Speculative decoding drafts a few "
        "tokens cheaply and lets the full model verify them in one pass." * 2,
        "import numpy as np\nx = np.arange(12).reshape(3, 4)\n",
        "The quick brown",
    ]
    return base


@pytest.fixture(scope="session")
def plain_tiny(tiny_model_path):
    llm = make_llm(tiny_model_path)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="session")
def tiny_prompt_ids(tiny_model_path, tiny_prompts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return [tokenizer(p).input_ids for p in tiny_prompts]


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_path, tiny_prompt_ids):
    from reference import hf_similarities

    return hf_similarities(tiny_model_path, tiny_prompt_ids)


def splitting_threshold(similarities) -> tuple[int, float]:
    """The layer whose similarity varies most across prompts, and a threshold in the middle of
    that spread: some prompts skip the sublayer there and others keep it."""
    values = np.stack(similarities)  # [prompts, layers]
    layer = int(np.argmax(values.max(0) - values.min(0)))
    return layer, float((values[:, layer].max() + values[:, layer].min()) / 2)


@pytest.fixture(scope="session")
def mixed_options(tiny_reference) -> dict:
    """Thresholds that give different prompts different masks; both structural rules off so the
    thresholds alone decide. Self-drafts only, always K of them: these engines test the drafting
    machinery, not the choice of how much to draft."""
    _, attention_threshold = splitting_threshold([a for a, _ in tiny_reference])
    _, mlp_threshold = splitting_threshold([m for _, m in tiny_reference])
    return {
        "method": "self-admg",
        "num_speculative_tokens": 3,
        "keep_edge_layers": 0,
        "fill_gaps": 0,
        "attention_threshold": attention_threshold,
        "mlp_threshold": mlp_threshold,
        "draft_exit_threshold": 0.3,
        **SELF_DRAFTS_ONLY,
        "stats_window": 0,  # the whole prompt, as the reference measures it
        "experimental": {"draft_vocab": 128},
    }  # of 512: drafts score a quarter of the vocabulary plus the context


# Tiny-model KV cache of ~600 tokens (2 KiB per token): more than max_model_len, less than the
# test batch needs at once, so the scheduler preempts and recomputes requests.
SMALL_KV_BYTES = 2048 * 640


@pytest.fixture(scope="session")
def admg_mixed(tiny_model_path, mixed_options):
    """Per-sequence masks, draft exit, chunked prefill (64-token budget) and a KV cache small
    enough to force preemption: the hard case, all in one engine."""
    llm = make_llm(
        tiny_model_path,
        speculative_config=mixed_options,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=SMALL_KV_BYTES,
    )
    yield llm
    close_llm(llm)
