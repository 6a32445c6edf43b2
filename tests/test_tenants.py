"""Lookup history stays within a tenant: a request drafts only from earlier outputs of
requests with its own `cache_salt` (requests without one share one pool, as they share vLLM's
prefix cache), and an output a stop string ended is never kept."""

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
    # Requests without a salt share one pool with each other.
    other = tiny_prompt_ids[1]
    shared = generate(llm, other)
    assert history_tokens_for(llm, other + shared[:8], salt=None) > 0


def test_an_output_a_stop_string_ended_is_not_kept(llm, tiny_model_path, tiny_prompt_ids):
    from transformers import AutoTokenizer

    prompt = tiny_prompt_ids[0]
    answer = generate(llm, prompt, salt="stop-check")
    stop = AutoTokenizer.from_pretrained(tiny_model_path).decode(answer[20:22])
    generate(llm, prompt, salt="bob", stop=[stop]) if stop.strip() else pytest.skip("no stop text")
    assert history_tokens_for(llm, prompt + answer[:8], salt="bob") == 0


def pool_lengths(llm) -> dict:
    """Tokens held per tenant's pool of earlier outputs (None: the shared pool), once the
    requests that finished have been handed back (the runner drops a finished request's state in
    the next step, so one more request runs first)."""
    generate(llm, [1, 2, 3], salt="flush", max_tokens=1)

    def lengths(worker):  # nested, so pickled by value into the worker
        history = worker.model_runner.drafter.history
        return {tenant: len(pool) for tenant, pool in history.pools.items()}

    return llm.collective_rpc(lengths)[0]


def test_a_tenant_admitted_beside_a_request_at_max_model_len_stays_closed(llm, tiny_prompt_ids):
    """vLLM skips the proposer in every step where some request is within K tokens of
    max_model_len, the step that admits other requests included. A salted request admitted in
    such a step must still draft only from its own tenant's outputs, and its output must not
    land in the shared pool."""
    from vllm import SamplingParams

    prompt = tiny_prompt_ids[2]
    shared = generate(llm, prompt)  # the shared pool now continues this prompt
    k = SPEC["num_speculative_tokens"]
    at_edge_len = ENGINE_DEFAULTS["max_model_len"] - k + 1  # the proposer is skipped while it runs
    at_edge = {"prompt_token_ids": (prompt * at_edge_len)[:at_edge_len], "cache_salt": "edge"}
    salted = {"prompt_token_ids": prompt + shared[:8], "cache_salt": "carol"}
    shared_before = pool_lengths(llm).get(None, 0)
    assert shared_before > 0
    before = proposer_report(llm)["history_tokens"]
    params = [
        SamplingParams(temperature=0, max_tokens=ENGINE_DEFAULTS["max_model_len"] - at_edge_len, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    ]
    outputs = llm.generate([at_edge, salted], params, use_tqdm=False)
    assert len(outputs[1].outputs[0].token_ids) == 48
    # carol has no earlier outputs: any history draft would have come from the shared pool.
    assert proposer_report(llm)["history_tokens"] - before == 0
    pools = pool_lengths(llm)
    assert pools.get(None, 0) == shared_before  # neither request's output joined the shared pool
    assert pools.get("carol", 0) > 0  # carol's own output is kept for carol
