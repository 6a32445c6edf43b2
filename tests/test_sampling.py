# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""At temperature 1 the output distribution with self-admg equals plain decoding's, and the
same test catches vLLM 0.32's CPU rejection-sampler bug when our patch is left out."""

import math
import os
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2, chi2_contingency
from vllm import SamplingParams

from conftest import close_llm, make_llm, spec_counters
from fault_injection import UNPATCHED_SAMPLER_ENV

NUM_SAMPLES = 3000
NULL_SIMULATIONS = 400  # draws from the model's own probabilities, to calibrate the test
NUM_TOKENS = 4  # token 0 comes from the prefill; tokens 1-3 go through the rejection sampler


def sample_tokens(llm, prompt_ids) -> np.ndarray:
    params = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt_ids}] * NUM_SAMPLES, params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outputs])


def same_distribution_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test of homogeneity of two samples of token ids; tokens seen fewer than 10
    times in both samples together are pooled into one category."""
    ca, cb = Counter(a.tolist()), Counter(b.tolist())
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rest_a = len(a) - sum(ca[t] for t in common)
    rest_b = len(b) - sum(cb[t] for t in common)
    table = [[ca[t] for t in common] + [rest_a], [cb[t] for t in common] + [rest_b]]
    table = [row for row in np.array(table).T.tolist() if sum(row) > 0]
    return chi2_contingency(np.array(table).T)[1]


def model_fit_p_value(model, prompt_ids: list[int], samples: np.ndarray, position: int) -> float:
    """Do the tokens sampled at `position` follow the model's own distribution given what came
    before them? Each sample's exact next-token distribution is computed (float32, Hugging Face)
    and tokens are counted against the sum of those probabilities, in cells of (token before,
    token) where enough is expected, then of the token alone, then one cell for the rest: a
    chi-square statistic over the conditionals, which a sampler biased in some contexts also
    fails. Nothing random stands on the reference side, so it is sharper than comparing with a
    second sample. Its null distribution is not chi-square with cells - 1 degrees of freedom
    (each sample is one draw from its own distribution): it is simulated from the same
    probabilities, and the statistic is referred to a chi-square matched to its mean and
    variance there."""
    import torch

    contexts = np.concatenate([np.tile(prompt_ids, (len(samples), 1)), samples[:, :position]], axis=1)
    with torch.no_grad():
        probs = torch.softmax(model(torch.from_numpy(contexts)).logits[:, -1].double(), -1).numpy()
    before, vocab = contexts[:, -1], probs.shape[1]
    expected = np.zeros((vocab, vocab))
    np.add.at(expected, before, probs)
    pairs = expected >= 5
    tokens = np.where(pairs, 0, expected).sum(0) >= 5
    cells = np.empty((vocab, vocab), dtype=np.int64)  # each (token before, token)'s cell
    cells[pairs] = np.arange(pairs.sum())
    token_cell = pairs.sum() + np.cumsum(tokens) - 1
    rest = pairs.sum() + tokens.sum()
    cells[~pairs] = np.where(tokens, token_cell, rest)[np.nonzero(~pairs)[1]]
    e = np.bincount(cells.ravel(), weights=expected.ravel(), minlength=rest + 1)
    if e[rest] < 5 and rest > 0:  # too little left for a cell of its own: into the smallest
        cells[cells == rest] = int(np.argmin(e[:rest]))
        e = np.bincount(cells.ravel(), weights=expected.ravel(), minlength=rest + 1)

    def statistic(drawn: np.ndarray) -> float:
        o = np.bincount(cells[before, drawn], minlength=len(e))
        if np.any(o[e == 0]):
            return math.inf  # a token the model gives no chance
        return float(((o - e) ** 2 / np.where(e > 0, e, 1)).sum())

    rng = np.random.default_rng(0)
    cumulative = probs.cumsum(1)
    null = [
        statistic(np.minimum((cumulative < rng.random((len(probs), 1)) * cumulative[:, -1:]).sum(1), vocab - 1))
        for _ in range(NULL_SIMULATIONS)
    ]
    mean, variance = np.mean(null), np.var(null)
    scale, dof = variance / (2 * mean), 2 * mean**2 / variance
    return float(chi2.sf(statistic(samples[:, position]) / scale, dof))


def make_admg(model, options, unpatched: bool):
    if unpatched:
        os.environ[UNPATCHED_SAMPLER_ENV] = "1"  # read by the plugin in the engine's processes
    try:
        return make_llm(model, speculative_config=options)
    finally:
        os.environ.pop(UNPATCHED_SAMPLER_ENV, None)


@pytest.fixture(scope="module")
def samples(plain_tiny, tiny_model_path, tiny_prompt_ids, mixed_options):
    prompt = tiny_prompt_ids[2]
    # No draft exit: the random tiny model is unsure of everything, and every draft token must
    # go through the rejection sampler for this test to mean anything.
    options = {**mixed_options, "draft_exit_threshold": 0.0}
    result = {"prompt": prompt, "plain": sample_tokens(plain_tiny, prompt)}
    for name, unpatched in (("self-admg", False), ("self-admg, unpatched CPU sampler", True)):
        llm = make_admg(tiny_model_path, options, unpatched)
        try:
            result[name] = sample_tokens(llm, prompt)
            result[name + " counters"] = spec_counters(llm)
        finally:
            close_llm(llm)
    return result


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.mark.engine
def test_temperature_one_matches_plain_decoding(samples, reference_model):
    counters = samples["self-admg counters"]
    # Drafts were made for nearly every step and the sampler both accepted and rejected some.
    assert counters["num_draft_tokens"] >= NUM_SAMPLES * 2
    assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"]
    # Plain decoding is the control: it shows the reference is the engine's own model.
    for name in ("plain", "self-admg"):
        for position in range(NUM_TOKENS):
            p = model_fit_p_value(reference_model, samples["prompt"], samples[name], position)
            print(f"{name}, position {position}: p = {p:.3g}")
            assert p > 1e-3, f"{name}: token distribution differs from the model's at position {position}"


@pytest.mark.engine
def test_the_same_test_fails_without_the_cpu_sampler_patch(samples, reference_model):
    broken = samples["self-admg, unpatched CPU sampler"]
    p_values = [model_fit_p_value(reference_model, samples["prompt"], broken, i) for i in (1, 2, 3)]
    print("unpatched p-values:", p_values)
    assert min(p_values) < 1e-6


def test_a_step_without_drafts_is_sampled_as_plain_decoding():
    """vLLM 0.32 sends every step of a speculative engine through the rejection sampler, which
    cost 5-8% of a batch-32 step here even with nothing to verify; ours then uses the plain
    sampler (patches/runner_hook.py), and still the rejection sampler when any row has a draft."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_selfspec.proposer import SelfAdmgProposer
    from vllm_selfspec.vllm_integration import runner_hook

    runner_hook.install()
    calls = []
    runner = SimpleNamespace(
        drafter=object.__new__(SelfAdmgProposer),
        use_async_scheduling=False,
        input_batch=SimpleNamespace(sampling_metadata=None, update_async_output_token_ids=lambda: None),
        sampler=lambda logits, sampling_metadata: calls.append("plain"),
        rejection_sampler=lambda *args: calls.append("rejection"),
        _get_spec_decode_draft_probs=lambda metadata: None,
    )
    logits = torch.zeros(2, 8)
    GPUModelRunner._sample(runner, logits, SpecDecodeMetadata.make_dummy([[], []], device="cpu"))
    GPUModelRunner._sample(runner, logits, SpecDecodeMetadata.make_dummy([[3], []], device="cpu"))
    runner.drafter = None  # another method's engine: untouched
    GPUModelRunner._sample(runner, logits, SpecDecodeMetadata.make_dummy([[], []], device="cpu"))
    assert calls == ["plain", "rejection", "rejection"]


@pytest.fixture(scope="module")
def admg_always_drafting(tiny_model_path, mixed_options):
    llm = make_llm(tiny_model_path, speculative_config={**mixed_options, "draft_exit_threshold": 0.0})
    yield llm
    close_llm(llm)


@pytest.mark.engine
def test_min_p_is_served_with_plain_decodings_distribution(plain_tiny, admg_always_drafting, tiny_prompt_ids):
    """vLLM refuses min_p with any speculative method; self-admg serves it, in a batch whose
    other rows draft, with the same distribution as plain decoding."""
    prompt = {"prompt_token_ids": tiny_prompt_ids[2]}
    min_p = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True, min_p=0.5)
    free = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True)

    def run(llm, with_min_p):
        outputs = llm.generate(
            [prompt] * (2 * NUM_SAMPLES), [min_p, free] * NUM_SAMPLES if with_min_p else free, use_tqdm=False
        )
        return np.array([o.outputs[0].token_ids for o in outputs[0::2]])

    before = spec_counters(admg_always_drafting)
    ours, plain, plain_without = run(admg_always_drafting, True), run(plain_tiny, True), run(plain_tiny, False)
    after = spec_counters(admg_always_drafting)
    assert after["num_draft_tokens"] - before["num_draft_tokens"] >= NUM_SAMPLES  # the other rows drafted
    for position in range(1, NUM_TOKENS):
        assert same_distribution_p_value(plain[:, position], ours[:, position]) > 1e-3
    # The test can tell: min_p changes the distribution.
    assert min(same_distribution_p_value(plain[:, i], plain_without[:, i]) for i in range(1, NUM_TOKENS)) < 1e-6


@pytest.mark.engine
def test_logit_bias_is_served_exactly(plain_tiny, admg_always_drafting, tiny_prompts):
    from conftest import token_ids

    unbiased = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = token_ids(plain_tiny.generate(tiny_prompts, unbiased, use_tqdm=False))
    # Push each prompt's own second greedy token up everywhere: outputs change, and must change alike.
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={ids[1]: 5.0})
        if i % 2 == 0
        else unbiased
        for i, ids in enumerate(first)
    ]
    plain = token_ids(plain_tiny.generate(tiny_prompts, params, use_tqdm=False))
    ours = token_ids(admg_always_drafting.generate(tiny_prompts, params, use_tqdm=False))
    assert ours == plain
    assert plain[0] != first[0]  # the bias took effect
