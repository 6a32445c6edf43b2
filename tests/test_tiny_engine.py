# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""self-admg end to end on a tiny random Llama in float32: exact output, positions and KV
sharing (skip-nothing drafts are all accepted), per-sequence masks, statistics against
transformers, prefix caching, chunked prefill, preemption, aborts, and no extra KV cache."""

import time

import numpy as np
import pytest
from vllm import SamplingParams

from vllm_selfspec.operations.counters import PROPOSER_PARTS, prompt_key
from vllm_selfspec.options import SelfAdmgOptions

from conftest import (
    SELF_DRAFTS_ONLY,
    close_llm,
    make_llm,
    pin_step_costs,
    proposer_report,
    spec_counters,
    token_ids,
)
from reference import hf_similarities

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
# Self-drafts that skip no sublayer and never exit early: every draft token must be accepted.
SKIP_NOTHING = {
    "method": "self-admg",
    "num_speculative_tokens": 3,
    **SELF_DRAFTS_ONLY,
    "attention_threshold": 1.0,
    "mlp_threshold": 1.0,
    "draft_exit_threshold": 0.0,
}


def generate(llm, prompt_ids, params=GREEDY):
    return llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)


@pytest.fixture(scope="module")
def plain_ids(plain_tiny, tiny_prompt_ids):
    return token_ids(generate(plain_tiny, tiny_prompt_ids))


@pytest.fixture(scope="module")
def admg_none(tiny_model_path):
    llm = make_llm(
        tiny_model_path,
        speculative_config=SKIP_NOTHING,
    )
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def admg_all(tiny_model_path):
    llm = make_llm(
        tiny_model_path,
        speculative_config={
            "method": "self-admg",
            "num_speculative_tokens": 2,
            **SELF_DRAFTS_ONLY,
            "attention_threshold": -1.0,
            "mlp_threshold": -1.0,
            "keep_edge_layers": 0,
            "fill_gaps": 0,
            "draft_exit_threshold": 0.0,
        },
    )
    yield llm
    close_llm(llm)


def test_skip_nothing_accepts_every_draft(admg_none, tiny_prompt_ids, plain_ids):
    """With nothing skipped the draft is the target itself: any wrong position, slot or KV
    read would show up as a rejected draft."""
    before = spec_counters(admg_none)
    assert token_ids(generate(admg_none, tiny_prompt_ids)) == plain_ids
    after = spec_counters(admg_none)
    drafted = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    assert drafted > 0 and accepted == drafted
    report = proposer_report(admg_none)
    assert all(not any(m["skip_attention"] + m["skip_mlp"]) for m in report["measurements"])
    # The first step's warm-up draft is neither proposed nor counted.
    assert report["warmup_seconds"] > 0 and report["draft_tokens"] == after["num_draft_tokens"]


def test_default_window_measures_the_last_prompt_tokens(admg_none, tiny_model_path, tiny_prompt_ids, tiny_reference):
    """By default the probe measures each prompt's last `stats_window` tokens only (reading
    the rest from the KV cache): the same numbers as transformers over those tokens, and not
    the whole prompt's."""
    window = SelfAdmgOptions().stats_window
    assert any(len(ids) > 2 * window for ids in tiny_prompt_ids)
    generate(admg_none, tiny_prompt_ids, SamplingParams(max_tokens=4, temperature=0))
    measured = {m["prompt_key"]: m for m in proposer_report(admg_none)["measurements"]}
    windowed = hf_similarities(tiny_model_path, tiny_prompt_ids, window=window)
    for ids, (attn, mlp), (whole_attn, _) in zip(tiny_prompt_ids, windowed, tiny_reference):
        m = measured[prompt_key(ids)]
        np.testing.assert_allclose(m["attention_similarity"], attn, atol=1e-4)
        np.testing.assert_allclose(m["mlp_similarity"], mlp, atol=1e-4)
        if len(ids) > 2 * window:
            assert np.abs(np.array(m["attention_similarity"]) - whole_attn).max() > 1e-3


def test_skip_everything_is_still_exact(admg_all, tiny_prompt_ids, plain_ids):
    assert token_ids(generate(admg_all, tiny_prompt_ids)) == plain_ids
    report = proposer_report(admg_all)
    assert report["measurements"] and all(
        all(m["skip_attention"]) and all(m["skip_mlp"]) for m in report["measurements"]
    )
    counters = spec_counters(admg_all)
    assert counters["num_accepted_tokens"] < counters["num_draft_tokens"]


def test_engines_side_by_side_count_their_own_drafts(admg_none, admg_all, tiny_prompt_ids):
    """Each engine's spec-decode counters are its own, with another engine alive beside it:
    vLLM's Prometheus registry is process-wide and keeps only the last engine built, which
    `LLM.get_metrics()` reads whichever engine is asked (`benchmarks.engine.spec_decode_counters`)."""
    params = SamplingParams(max_tokens=8, temperature=0)
    for drafting, idle in ((admg_none, admg_all), (admg_all, admg_none)):
        before, idle_before = spec_counters(drafting), spec_counters(idle)
        generate(drafting, tiny_prompt_ids[:1], params)
        assert spec_counters(drafting)["num_draft_tokens"] > before["num_draft_tokens"]
        assert spec_counters(idle) == idle_before


def test_no_extra_kv_cache(plain_tiny, admg_none):
    def kv_bytes(llm):
        return llm.collective_rpc(
            lambda worker: sum(t.numel() * t.element_size() for t in worker.model_runner.kv_caches)
        )[0]

    assert kv_bytes(admg_none) == kv_bytes(plain_tiny) > 0


def test_different_masks_in_one_batch_are_exact(admg_mixed, tiny_prompt_ids, plain_ids):
    """One batch, a different mask per sequence, ragged drafts (draft exit), prompts longer
    than the 64-token prefill budget (chunked), and a KV cache too small for the whole batch
    (preemption and recomputation)."""
    prompts = tiny_prompt_ids * 2
    assert token_ids(generate(admg_mixed, prompts)) == plain_ids * 2
    report = proposer_report(admg_mixed)
    masks = {(tuple(m["skip_attention"]), tuple(m["skip_mlp"])) for m in report["measurements"]}
    assert len(masks) >= 2, masks
    assert any(any(a) or any(m) for a, m in masks)
    counters = spec_counters(admg_mixed)
    assert 0 < counters["num_draft_tokens"] < 3 * counters["num_drafts"]  # draft exit: ragged
    preemptions = [m.value for m in admg_mixed.get_metrics() if m.name == "vllm:num_preemptions"]
    assert preemptions and preemptions[0] > 0


def test_similarities_match_transformers(admg_mixed, tiny_prompt_ids, tiny_reference):
    """The probe's statistic equals the same cosine similarities computed with plain
    transformers hooks, within 1e-4 (float32, different kernels); prompts were prefilled in
    chunks of at most 64 tokens."""
    generate(admg_mixed, tiny_prompt_ids, SamplingParams(max_tokens=4, temperature=0))
    measured = {m["prompt_key"]: m for m in proposer_report(admg_mixed)["measurements"]}
    for ids, (attn, mlp) in zip(tiny_prompt_ids, tiny_reference):
        m = measured[prompt_key(ids)]
        np.testing.assert_allclose(m["attention_similarity"], attn, atol=1e-4)
        np.testing.assert_allclose(m["mlp_similarity"], mlp, atol=1e-4)


def test_prefix_cache_hit_is_measured_over_the_whole_prompt(admg_mixed, tiny_prompt_ids):
    """A repeated prompt is served from the prefix cache (only its last token is computed),
    yet its statistics are those of the whole prompt."""
    ids = (tiny_prompt_ids[1] * 6)[:300]  # longer than a KV block: only full blocks are cached
    hits_before = _prefix_cache_hits(admg_mixed)
    for _ in range(2):
        generate(admg_mixed, [ids], SamplingParams(max_tokens=4, temperature=0))
    assert _prefix_cache_hits(admg_mixed) > hits_before
    runs = [m for m in proposer_report(admg_mixed)["measurements"] if m["prompt_key"] == prompt_key(ids)]
    assert len(runs) >= 2
    np.testing.assert_allclose(runs[-1]["attention_similarity"], runs[-2]["attention_similarity"], atol=1e-6)


def _prefix_cache_hits(llm) -> float:
    names = {m.name: m for m in llm.get_metrics()}
    assert "vllm:prefix_cache_hits" in names, sorted(names)
    return names["vllm:prefix_cache_hits"].value


def test_mixed_sampling_parameters_in_one_batch(admg_mixed, plain_tiny, tiny_prompt_ids):
    """Greedy rows stay exact beside sampled rows, stop strings and different max_tokens."""
    tokenizer = plain_tiny.get_tokenizer()
    stop_text = tokenizer.decode(token_ids(generate(plain_tiny, tiny_prompt_ids[:1]))[0][5:7])
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        # No seed here: vLLM 0.32's CPU runner crashes on a seeded request whose prefill is
        # chunked ("CPU Generator does not use offset"), with or without speculation.
        SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, stop=[stop_text]),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": ids} for ids in tiny_prompt_ids]
    ours = admg_mixed.generate(prompts, params, use_tqdm=False)
    plain = plain_tiny.generate(prompts, params, use_tqdm=False)
    for p, a, b in zip(params, ours, plain):
        assert len(a.outputs[0].token_ids) <= p.max_tokens
        if p.temperature == 0:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].text == b.outputs[0].text
    assert ours[2].outputs[0].finish_reason == "length" and len(ours[2].outputs[0].token_ids) == 7


def test_aborted_and_finished_requests_leave_no_state(admg_mixed, tiny_prompt_ids):
    engine = admg_mixed.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, ids in enumerate(tiny_prompt_ids[:3]):
        engine.add_request(f"abort-me-{i}", {"prompt_token_ids": ids}, params)
    for _ in range(6):
        engine.step()
    live = proposer_report(admg_mixed)["live_requests"]
    assert any("abort-me" in r for r in live)  # drafting is under way
    engine.abort_request([f"abort-me-{i}" for i in range(3)])
    # The engine core's next step tells the runner, and the masks go with vLLM's own state in
    # that step, with no new request needed. The core runs it on its own, soon after the abort.
    deadline = time.monotonic() + 10
    while (live := proposer_report(admg_mixed)["live_requests"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live == []


def test_a_wait_for_requests_is_not_charged_to_the_next_step(admg_mixed, tiny_prompt_ids):
    """Between requests the engine idles. The step that ends the wait must not be timed from
    the step before it, or a server's step-cost fit charges every wait to the next prompt's
    tokens (and, through them, to verification), and stops drafting."""
    wait = 1.5
    generate(admg_mixed, tiny_prompt_ids[:1])
    timed_before = proposer_report(admg_mixed)["steps_timed"]
    time.sleep(wait)
    generate(admg_mixed, tiny_prompt_ids[1:2])
    report = proposer_report(admg_mixed)
    seconds = [step[4] for step in report["steps"]]  # (prompt, logit rows, sampled, drafts, seconds, context)
    assert seconds and max(seconds) < wait / 2, max(seconds)  # a tiny model's step takes milliseconds
    # The serving benchmark cuts a run's steps by this count: one per step kept.
    assert 0 < report["steps_timed"] - timed_before <= len(seconds) <= report["steps_timed"]
    # The proposer's own time is counted apart, every step.
    assert report["propose_calls"] >= len(seconds) and report["propose_seconds"] > 0
    # ... and its thread's CPU time beside it, which cannot exceed it (a clock tick of slack).
    assert 0 < report["propose_cpu_seconds"] <= report["propose_seconds"] + 0.01, report
    # ... and split by part, the parts adding up to it (what is outside them: a few calls).
    parts = report["part_seconds"]
    assert set(parts) == set(PROPOSER_PARTS) and min(parts.values()) > 0, parts
    assert 0.9 * report["propose_seconds"] <= sum(parts.values()) <= report["propose_seconds"], parts


def test_compiled_target_engine(tiny_model_path, tiny_prompt_ids, plain_ids):
    """vLLM's default (compiled) engine: the target runs its compiled graph, the draft runs the
    same modules eagerly beside it. Skipping nothing, every draft must be accepted."""
    llm = make_llm(
        tiny_model_path,
        enforce_eager=False,
        speculative_config=SKIP_NOTHING,
    )
    try:
        from vllm.config import CompilationMode

        assert llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        assert token_ids(generate(llm, tiny_prompt_ids)) == plain_ids
        counters = spec_counters(llm)
        assert counters["num_draft_tokens"] > 0
        assert counters["num_accepted_tokens"] == counters["num_draft_tokens"]
    finally:
        close_llm(llm)


def test_seeded_request_with_chunked_prefill(admg_mixed, tiny_prompt_ids):
    """A seeded request whose prompt is prefilled in chunks crashed vLLM 0.32's CPU runner
    (patches/cpu_seeded_prefill.py). With the fix its sample does not depend on how the prompt
    was chunked: alone, and behind other prompts that shift its chunk boundaries."""
    long_prompt = sum(tiny_prompt_ids[:4], [])
    assert len(long_prompt) > 2 * 64  # the engine's chunk budget: at least three chunks
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = generate(admg_mixed, [long_prompt], seeded)
    behind = admg_mixed.generate(
        [{"prompt_token_ids": ids} for ids in (tiny_prompt_ids[4], tiny_prompt_ids[2], long_prompt)],
        [greedy, greedy, seeded],
        use_tqdm=False,
    )
    assert token_ids(alone) == token_ids(behind[-1:])
    other_seed = generate(
        admg_mixed, [long_prompt], SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    )
    assert token_ids(other_seed) != token_ids(alone)


def test_default_hybrid_is_lossless(tiny_model_path, tiny_prompt_ids, plain_ids):
    """The default set-up: lookup drafts from the row's own context or from earlier answers,
    self-drafts where lookup is unsure, and the controller deciding how much of each pays.
    Still plain decoding's output, in a batch and alone. Step costs are pinned to Qwen-1.5B's on
    this CPU at batch 8 (benchmarks/diagnostics/step_costs.py), where a self-draft step costs most of a
    target step."""
    llm = make_llm(tiny_model_path, speculative_config={"method": "self-admg", "num_speculative_tokens": 3})
    try:
        pin_step_costs(llm, t0=0.14, t_row=0.014, t_verify=0.012, self_step=0.12)
        assert token_ids(generate(llm, tiny_prompt_ids)) == plain_ids
        # Alone, a row's end is its batch's: the first prompt repeats itself three times, and
        # its lookup drafts pay. (In the closed batch above they need not: it ends with its
        # last row, and a step is saved only if every row advances.)
        alone = [token_ids(generate(llm, [ids]))[0] for ids in tiny_prompt_ids]
        assert alone == plain_ids
        report = proposer_report(llm)
        assert report["lookup_tokens"] > 0
        # Of the lookup tokens verified, some were accepted, and the planner expected some.
        assert 0 < report["lookup_accepted"] <= report["lookup_tokens"]
        assert 0 < report["lookup_expected"] <= report["lookup_tokens"]
        assert 0 < report["lookup_estimated"] <= report["lookup_tokens"]
        assert spec_counters(llm)["num_draft_tokens"] >= report["lookup_tokens"]
        # Asked again by the same tenant, its earlier answer offers surer drafts than the row's
        # own context (requests without a salt share no history by default).
        salted = [{"prompt_token_ids": tiny_prompt_ids[0], "cache_salt": "tenant"}]
        for _ in range(2):
            assert token_ids(llm.generate(salted, GREEDY, use_tqdm=False)) == plain_ids[:1]
        assert proposer_report(llm)["history_tokens"] > report["history_tokens"]
    finally:
        close_llm(llm)
