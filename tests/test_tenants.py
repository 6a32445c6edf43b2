"""Lookup history stays within a tenant: a request drafts only from earlier outputs of
requests with its own `cache_salt` (requests without one share one pool, as they share vLLM's
prefix cache), and an output a stop string ended is never kept."""

import pytest

from conftest import close_llm, make_llm, proposer_report

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
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
                       use_tqdm=False)
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
