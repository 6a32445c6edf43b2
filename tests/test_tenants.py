# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Lookup history stays within a tenant: a request drafts only from earlier outputs of
requests with its own `cache_salt`; requests without one draft from their own context only,
unless the operator opts in to one shared pool; an output a stop string ended is never kept;
and the history is forgotten whenever vLLM resets its prefix cache or sleeps."""

import pytest

from conftest import ENGINE_DEFAULTS, close_llm, make_llm, proposer_report

pytestmark = pytest.mark.engine

# Every lookup draft taken as offered (no cost control), self-drafts elsewhere.
SPEC = {"method": "self-admg", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    engine = make_llm(tiny_model_path, speculative_config=SPEC, enable_prefix_caching=True)
    yield engine
    close_llm(engine)


def generate(llm, prompt_ids, salt=None, max_tokens=48, **params):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": list(prompt_ids)}
    if salt is not None:
        prompt["cache_salt"] = salt
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params), use_tqdm=False
    )
    return list(out[0].outputs[0].token_ids)


def history_tokens_for(llm, prompt_ids, salt) -> int:
    before = proposer_report(llm)["history_tokens"]
    generate(llm, prompt_ids, salt, max_tokens=32)
    return proposer_report(llm)["history_tokens"] - before


def test_history_drafts_come_only_from_the_same_tenant(llm, tiny_prompt_ids):
    prompt = tiny_prompt_ids[3]
    answer = generate(llm, prompt, salt="alice")
    # Another request that continues what alice was just sent.
    continuation = prompt + answer[:8]
    assert history_tokens_for(llm, continuation, salt="mallory") == 0
    assert history_tokens_for(llm, continuation, salt=None) == 0
    assert history_tokens_for(llm, continuation, salt="alice") > 0


def test_an_unsalted_request_drafts_from_no_other_requests_answer_by_default(llm, tiny_prompt_ids):
    """Closed by default: without a tenant, a request neither reads nor writes history another
    request can reach. Control: the same two requests under one salt do draft from history."""
    prompt = tiny_prompt_ids[1]
    pool_lengths(llm, [])  # (its own request's tenant is counted from here on)
    tenants_before = proposer_report(llm)["history_tenants"]
    answer = generate(llm, prompt)
    assert history_tokens_for(llm, prompt + answer[:8], salt=None) == 0
    generate(llm, prompt, salt="")  # an empty salt is no salt, as vLLM hashes it: no pool either
    assert history_tokens_for(llm, prompt + answer[:8], salt="") == 0
    pool_lengths(llm, [])  # (hands the finished requests back)
    assert proposer_report(llm)["history_tenants"] == tenants_before  # no pool for the unsalted
    generate(llm, prompt, salt="erin")
    assert history_tokens_for(llm, prompt + answer[:8], salt="erin") > 0


def test_unsalted_requests_share_one_pool_when_the_operator_opts_in(tiny_model_path, tiny_prompt_ids):
    engine = make_llm(tiny_model_path, speculative_config={**SPEC, "lookup_history_unsalted": True})
    try:
        prompt = tiny_prompt_ids[1]
        answer = generate(engine, prompt)
        assert history_tokens_for(engine, prompt + answer[:8], salt=None) > 0
    finally:
        close_llm(engine)


def test_an_output_a_stop_string_ended_is_not_kept(llm, tiny_model_path, tiny_prompt_ids):
    from transformers import AutoTokenizer

    prompt = tiny_prompt_ids[0]
    answer = generate(llm, prompt, salt="stop-check")
    stop = AutoTokenizer.from_pretrained(tiny_model_path).decode(answer[20:22])
    assert stop.strip(), "the tiny model's answer has no text to stop at"
    generate(llm, prompt, salt="bob", stop=[stop])
    assert history_tokens_for(llm, prompt + answer[:8], salt="bob") == 0
    # Control: the same request without the stop string is kept, and drafted from.
    generate(llm, prompt, salt="bob-control")
    assert history_tokens_for(llm, prompt + answer[:8], salt="bob-control") > 0


def pool_lengths(llm, tenants) -> dict:
    """Tokens held in each of these tenants' pools of earlier outputs (0: none), once the
    requests that finished have been handed back (the runner drops a finished request's state in
    the next step, so one more request runs first)."""
    generate(llm, [1, 2, 3], salt="flush", max_tokens=1)

    def lengths(worker, tenants=tuple(tenants)):  # nested, so pickled by value into the worker
        history = worker.model_runner.drafter.lookup.history
        return {tenant: len(history.pool(tenant) or ()) for tenant in tenants}

    return llm.collective_rpc(lengths)[0]


@pytest.mark.parametrize("purge", ["reset_prefix_cache", "sleep"])
def test_history_is_forgotten_when_vllm_resets_its_prefix_cache_or_sleeps(llm, tiny_prompt_ids, purge):
    prompt = tiny_prompt_ids[4]
    answer = generate(llm, prompt, salt="frank")
    assert pool_lengths(llm, ["frank"])["frank"] > 0  # control: kept until vLLM forgets
    if purge == "sleep":  # the workers' own sleep (vLLM's engine-level sleep also resets the prefix cache)
        llm.collective_rpc("sleep", kwargs={"level": 1})
    else:
        assert llm.reset_prefix_cache()
    assert pool_lengths(llm, ["frank"])["frank"] == 0
    assert history_tokens_for(llm, prompt + answer[:8], salt="frank") == 0


def test_a_tenant_admitted_beside_a_request_at_max_model_len_stays_closed(llm, tiny_prompt_ids):
    """vLLM skips the proposer in every step where some request is within K tokens of
    max_model_len, the step that admits other requests included. A salted request admitted in
    such a step must still draft only from its own tenant's outputs, and its output must not
    land in the shared pool."""
    from vllm import SamplingParams

    prompt = tiny_prompt_ids[2]
    shared = generate(llm, prompt, salt="dave")  # dave's pool now continues this prompt
    k = SPEC["num_speculative_tokens"]
    at_edge_len = ENGINE_DEFAULTS["max_model_len"] - k + 1  # the proposer is skipped while it runs
    at_edge = {"prompt_token_ids": (prompt * at_edge_len)[:at_edge_len], "cache_salt": "edge"}
    salted = {"prompt_token_ids": prompt + shared[:8], "cache_salt": "carol"}
    shared_before = pool_lengths(llm, ["dave"])["dave"]
    assert shared_before > 0
    before = proposer_report(llm)["history_tokens"]
    params = [
        SamplingParams(temperature=0, max_tokens=ENGINE_DEFAULTS["max_model_len"] - at_edge_len, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    ]
    outputs = llm.generate([at_edge, salted], params, use_tqdm=False)
    assert len(outputs[1].outputs[0].token_ids) == 48
    # carol has no earlier outputs: any history draft would have come from another's pool.
    assert proposer_report(llm)["history_tokens"] - before == 0
    pools = pool_lengths(llm, ["dave", "carol"])
    assert pools["dave"] == shared_before  # neither request's output joined another's pool
    assert pools["carol"] > 0  # carol's own output is kept for carol
