# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""`vllm serve` with self-admg, end to end through the official openai client on loopback: a
plain server and a self-admg server run side by side on the tiny model, and every greedy
response must be identical. Also: streaming, chat, stop strings, max_tokens, logprobs, seeds,
mixed temperatures in flight, client disconnects, bad requests, a bounded load test, the
proposer's counters on /metrics without dev mode, and the default options with tenants, stop
strings, dropped streams and a fault."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from benchmarks import serve_load

pytestmark = pytest.mark.engine

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True, "return_token_ids": True})


def server_flags(logs) -> list[str]:
    (logs / "chat.jinja").write_text(CHAT_TEMPLATE)
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-num-batched-tokens",
        "128",
        "--chat-template",
        str(logs / "chat.jinja"),
    ]


@pytest.fixture(scope="module")
def servers(tiny_model_path, mixed_options, tmp_path_factory):
    """(plain, self-admg), started at once. Chunked prefill with a 128-token budget, so long
    prompts and busy batches split prefills. The self-admg server logs at debug level (the
    per-request skip counts); it runs as in production, without vLLM's dev mode, and its
    proposer's counters are read where an operator reads them, on /metrics."""
    logs = tmp_path_factory.mktemp("serve")
    common = server_flags(logs)
    plain = serve_load.VllmServer(tiny_model_path, *common, log_path=logs / "plain.log")
    admg = serve_load.VllmServer(
        tiny_model_path,
        *common,
        "--speculative-config",
        json.dumps(mixed_options),
        "--enable-scale-out",  # the token endpoint, a way in for a client's extra args
        "--enable-log-requests",  # a request log that must not hold a prediction's text
        log_path=logs / "self-admg.log",
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    try:
        plain.start(), admg.start()
        plain.wait_until_healthy(), admg.wait_until_healthy()
        yield plain, admg
    finally:
        for server in (plain, admg):
            if hasattr(server, "process"):
                server.stop()


def complete(server, prompt, **kwargs):
    return server.client().completions.create(model=server.model, prompt=prompt, **kwargs)


def chat(server, content, **kwargs):
    return server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kwargs
    )


def completion_ids(response) -> list[int]:
    return response.choices[0].model_extra["token_ids"]


def test_greedy_completions_match_plain_server(servers, tiny_prompts):
    plain, admg = servers
    for prompt in tiny_prompts:
        a, b = complete(admg, prompt, **GREEDY), complete(plain, prompt, **GREEDY)
        assert completion_ids(a) == completion_ids(b) and a.choices[0].text == b.choices[0].text
        assert a.usage.completion_tokens == 24 and a.choices[0].finish_reason == "length"
    # The workers publish once a second.
    assert wait_until(lambda: self_admg_metric(admg, "probes_total") >= len(tiny_prompts))
    assert self_admg_metric(admg, "draft_tokens_total") > 0


def self_admg_metric(server, name: str) -> float:
    """A self-admg counter or gauge on the server's /metrics, summed over its labels."""
    return server.metrics().get(f"vllm:self_admg_{name}", 0.0)


def test_operators_read_the_proposer_on_metrics_without_dev_mode(servers):
    """Every counter an operator watches is on /metrics; vLLM's dev-mode routes are not mounted
    (they would let anyone reset or drive the engine, whatever --api-key says)."""
    import httpx

    _, admg = servers
    names = set(admg.metrics())
    for name in (
        "faults_total",
        "steps_skipped_for_faults_total",
        "drafting_disabled",
        "draft_tokens_total",
        "lookup_tokens_accepted_total",
        "draft_tokens_withheld_total",
        "probes_total",
        "probe_seconds_total",
        "proposer_steps_total",
        "proposer_seconds_total",
        "requests_holding_state",
    ):
        assert f"vllm:self_admg_{name}" in names, name
    assert wait_until(lambda: self_admg_metric(admg, "proposer_steps_total") > 0)
    assert self_admg_metric(admg, "drafting_disabled") == 0
    assert httpx.post(admg.url("/collective_rpc"), json={"method": "self_admg_state"}, timeout=10).status_code == 404
    text = httpx.get(admg.url("/metrics"), timeout=10).text
    assert 'vllm:self_admg_draft_tokens_total{engine="0",rank="0",source="self"}' in text


def test_chat_and_streaming_match_plain_server(servers):
    plain, admg = servers
    expected = chat(plain, "for i in range(10):", **GREEDY).choices[0].message.content
    assert chat(admg, "for i in range(10):", **GREEDY).choices[0].message.content == expected
    stream = chat(admg, "for i in range(10):", stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected

    prompt = "The quick brown fox jumps over"
    expected = complete(plain, prompt, **GREEDY).choices[0].text
    stream = complete(admg, prompt, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_stop_strings_and_max_tokens(servers):
    plain, admg = servers
    prompt = "def add(a, b):\n"
    full = complete(plain, prompt, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    a = complete(admg, prompt, stop=[stop], **GREEDY)
    b = complete(plain, prompt, stop=[stop], **GREEDY)
    assert a.choices[0].text == b.choices[0].text == full[: full.index(stop)]
    assert a.choices[0].finish_reason == "stop"
    for max_tokens in (1, 2, 5):
        a = complete(admg, prompt, **{**GREEDY, "max_tokens": max_tokens})
        assert a.usage.completion_tokens == max_tokens
        assert a.choices[0].text == complete(plain, prompt, **{**GREEDY, "max_tokens": max_tokens}).choices[0].text


def test_logprobs_match_plain_server(servers):
    """vLLM computes logprobs from the target's verification logits, so they are the target's."""
    plain, admg = servers
    prompt = "import numpy as np\n"
    a = complete(admg, prompt, logprobs=3, **GREEDY).choices[0].logprobs
    b = complete(plain, prompt, logprobs=3, **GREEDY).choices[0].logprobs
    assert a.tokens == b.tokens
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-3)
    for top_a, top_b in zip(a.top_logprobs, b.top_logprobs):
        assert top_a.keys() == top_b.keys()
        assert list(top_a.values()) == pytest.approx(list(top_b.values()), abs=1e-3)


def test_seeds_are_reproducible(servers, tiny_prompts):
    """Same seed, same sample; another seed, another sample. The long prompt is prefilled in
    chunks (vLLM 0.32's CPU runner crashed on that: patches/cpu_seeded_prefill.py)."""
    _, admg = servers
    long_prompt = " ".join(tiny_prompts)  # > 128 tokens
    for prompt in ("The quick brown", long_prompt):
        sample = dict(temperature=1.0, max_tokens=24, extra_body={"ignore_eos": True})
        first = complete(admg, prompt, seed=11, **sample).choices[0].text
        assert complete(admg, prompt, seed=11, **sample).choices[0].text == first
        assert complete(admg, prompt, seed=12, **sample).choices[0].text != first
    assert admg.healthy()


def test_mixed_temperatures_in_flight(servers, tiny_prompts):
    """Greedy and sampled requests (with top-k, top-p, penalties) in one batch at once: the
    greedy ones still equal the plain server's."""
    plain, admg = servers
    sampled = dict(
        temperature=1.0,
        top_p=0.9,
        max_tokens=24,
        extra_body={"ignore_eos": True, "top_k": 20, "repetition_penalty": 1.2},
    )
    jobs = [(p, GREEDY if i % 2 == 0 else sampled) for i, p in enumerate(tiny_prompts * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(admg, job[0], **job[1]), jobs))
    for (prompt, params), result in zip(jobs, results):
        assert result.usage.completion_tokens == 24
        if params is GREEDY:
            assert completion_ids(result) == completion_ids(complete(plain, prompt, **GREEDY))


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not (ok := predicate()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return ok


def test_client_disconnect_frees_its_request(servers):
    """A client that goes away mid-stream: vLLM aborts the request, and its skip mask goes
    with vLLM's own state (no request running, none holding a mask, KV cache free)."""
    _, admg = servers
    stream = complete(
        admg, "The quick brown", stream=True, temperature=0, max_tokens=480, extra_body={"ignore_eos": True}
    )
    assert next(stream).choices[0].text is not None  # under way: 480 tokens to go
    stream.close()
    assert wait_until(lambda: admg.metrics()["vllm:num_requests_running"] == 0)
    assert wait_until(lambda: self_admg_metric(admg, "requests_holding_state") == 0)
    assert admg.metrics()["vllm:kv_cache_usage_perc"] == 0
    assert admg.healthy()


def test_bad_requests_get_400_and_the_engine_lives_on(servers, tiny_prompts):
    _, admg = servers
    too_long = " ".join(tiny_prompts * 6)  # far beyond max_model_len=512
    with pytest.raises(openai.BadRequestError) as err:
        complete(admg, too_long, max_tokens=8)
    assert err.value.status_code == 400 and "context length" in str(err.value).lower()
    with pytest.raises(openai.BadRequestError):
        complete(admg, "hello", max_tokens=8, temperature=-1)
    assert admg.healthy()
    assert complete(admg, "The quick brown", **GREEDY).usage.completion_tokens == 24


def test_load_side_by_side(servers, tiny_prompts):
    """500 requests from 16 clients under a hard time limit on each server, after 500 of
    warm-up: no failures, resident memory flat, acceptance counted on /metrics, healthy after."""
    args = serve_load.parse_args(
        ["--requests", "500", "--concurrency", "16", "--max-tokens", "16", "--warmup", "500", "--time-limit", "600"]
    )
    rows = []
    for name, server in zip(("plain", "self-admg"), servers):
        row, load = serve_load.load_one_server(server, name, tiny_prompts, args)
        assert load.failures == [], load.failures[:5]
        assert row["healthy_after"]
        rows.append(row)
    print("\n" + serve_load.markdown_table(rows))
    # The plain server is the control: it still grows by 1-3% here as vLLM's allocators settle
    # (the soak in docs/results.md). Self-admg may grow as much, and no more: a leak per step or
    # request (8,000 steps here) would add tens of MB on top.
    growth = {row["server"]: row["rss_end_gb"] - row["rss_after_warmup_gb"] for row in rows}
    rss = rows[0]["rss_after_warmup_gb"]
    assert growth["plain"] < 0.06 * rss, f"plain: RSS grew by {growth['plain']:.3f} GB"
    assert growth["self-admg"] < growth["plain"] + 0.02 * rss, f"RSS growth, GB: {growth}"
    assert rows[1]["mean_acceptance_length"] and rows[1]["mean_acceptance_length"] > 1
    metrics = servers[1].metrics()
    drafted, accepted = (metrics[f"vllm:spec_decode_num_{name}_tokens_total"] for name in ("draft", "accepted"))
    assert drafted >= accepted > 0


def self_admg_server(model, tmp_path_factory, name: str, *method_flags: str, env: dict):
    """A self-admg server for a module's tests (a generator for a fixture to yield from)."""
    logs = tmp_path_factory.mktemp(name)
    server = serve_load.VllmServer(model, *server_flags(logs), *method_flags, log_path=logs / "self-admg.log", env=env)
    try:
        server.start()
        server.wait_until_healthy()
        yield server
    finally:
        if hasattr(server, "process"):
            server.stop()


@pytest.fixture(scope="module")
def faulty_server(tiny_model_path, mixed_options, tmp_path_factory):
    """A self-admg server whose every draft step raises: it must answer like the plain one."""
    yield from self_admg_server(
        tiny_model_path,
        tmp_path_factory,
        "serve-faults",
        "--speculative-config",
        json.dumps(mixed_options),
        env={"VLLM_SELFSPEC_INJECT_FAULT": "draft@every"},
    )


def test_injected_fault_in_every_draft_keeps_the_server_answering(servers, faulty_server, tiny_prompts):
    plain, _ = servers
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: complete(faulty_server, p, **GREEDY), tiny_prompts * 2))
    expected = [completion_ids(complete(plain, p, **GREEDY)) for p in tiny_prompts * 2]
    assert [completion_ids(r) for r in responses] == expected
    assert wait_until(lambda: self_admg_metric(faulty_server, "drafting_disabled") == 1)
    assert self_admg_metric(faulty_server, "faults_total") >= 1
    assert faulty_server.healthy()
    assert faulty_server.log().count("self-admg switched off after") == 1  # one ERROR line, ever


@pytest.fixture(scope="module")
def default_server(tiny_model_path, tmp_path_factory):
    """Self-admg as `vllm serve MODEL --speculative-model self-admg` gives it (lookup, tenant
    history, the controller), without dev mode, with one injected fault on the way."""
    yield from self_admg_server(
        tiny_model_path,
        tmp_path_factory,
        "serve-default",
        "--speculative-model",
        "self-admg",
        env={"VLLM_SELFSPEC_INJECT_FAULT": "lookup@40"},
    )


def test_default_options_serve_tenants_stop_strings_aborts_and_a_fault_like_plain(
    servers, default_server, tiny_prompts
):
    """Two tenants and requests without a salt, in one batch and again (so that history has
    earlier outputs to draft from), stop strings, streams the client drops: every answer is
    the plain server's, a fault costs only a step's drafts, and the server is healthy after."""
    plain, _ = servers

    def ask(server, job):
        prompt, salt, stop = job
        extra = {**GREEDY["extra_body"], **({"cache_salt": salt} if salt else {})}
        response = complete(
            server, prompt, **{**GREEDY, "max_tokens": 48, "extra_body": extra}, **({"stop": [stop]} if stop else {})
        )
        return response.choices[0].text, response.choices[0].finish_reason

    stops = {p: complete(plain, p, **GREEDY).choices[0].text[6:9] for p in tiny_prompts}
    jobs = [
        (p, salt, stop)
        for p in tiny_prompts
        for salt in (None, "alice", "bob")
        for stop in (None, stops[p] if stops[p].strip() else None)
    ]
    for _ in range(2):
        dropped = [
            complete(
                default_server,
                p,
                stream=True,
                temperature=0,
                max_tokens=400,
                extra_body={"ignore_eos": True, "cache_salt": "mallory"},
            )
            for p in tiny_prompts[:2]
        ]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda job: ask(default_server, job), jobs))
        for stream in dropped:
            assert next(stream).choices[0].text is not None
            stream.close()
        assert answers == [ask(plain, job) for job in jobs]
    assert default_server.healthy()
    assert wait_until(lambda: default_server.metrics()["vllm:num_requests_running"] == 0)
    assert wait_until(lambda: self_admg_metric(default_server, "faults_total") == 1)
    assert self_admg_metric(default_server, "drafting_disabled") == 0
    assert self_admg_metric(default_server, "draft_tokens_total") > 0
    assert (
        complete(default_server, tiny_prompts[0], **GREEDY).choices[0].text
        == complete(plain, tiny_prompts[0], **GREEDY).choices[0].text
    )


def test_logs_show_skip_counts_and_acceptance(servers):
    """What a user reads: per-request skipped-sublayer counts at debug level, and vLLM's own
    spec-decode acceptance lines (logged every 10 s while requests run)."""
    _, admg = servers
    log = admg.log()
    assert "self-admg request" in log and "MLP sublayers of 4 layers" in log
    assert "SpecDecoding metrics" in log


# ---- predicted outputs (OpenAI's `prediction`) ------------------------------------------------


def predicted(server, content, prediction, endpoint="chat", **kwargs):
    body = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    params = {**GREEDY, **kwargs, "extra_body": {**GREEDY["extra_body"], **body}}
    return (chat if endpoint == "chat" else complete)(server, content, **params)


def output_ids(response) -> list[int]:
    return response.choices[0].model_extra["token_ids"]


def prediction_drafts(server) -> float:
    """Draft tokens the server's workers took from predictions, on /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=10).text)
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == "vllm:self_admg_draft_tokens_total" and sample.labels.get("source") == "prediction"
    )


def prediction_details(response) -> tuple[int, int]:
    details = response.usage.completion_tokens_details  # (fields of the openai client's own type)
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens


def test_a_prediction_changes_no_answer_and_usage_reports_what_it_was_worth(servers, tiny_prompts, tiny_model_path):
    """The answer with a prediction is the answer without one, whether the prediction is the
    answer itself, wrong from its first token, or longer than the answer; on both endpoints.
    Usage counts, of the prediction's tokens (as the server's tokenizer makes them), those the
    output used in order, and the rest (`prediction.prediction_usage`)."""
    from transformers import AutoTokenizer

    from vllm_selfspec.sources.prediction import prediction_usage

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    plain, admg = servers
    before = prediction_drafts(admg)
    for endpoint, prompt in (("chat", tiny_prompts[0]), ("completions", tiny_prompts[4])):
        answer = predicted(plain, prompt, None, endpoint)
        text = answer.choices[0].message.content if endpoint == "chat" else answer.choices[0].text
        for prediction in (text, "~" * 60, text + text):
            response = predicted(admg, prompt, prediction, endpoint)
            assert output_ids(response) == output_ids(answer), (endpoint, prediction)
            ids = tokenizer.encode(prediction, add_special_tokens=False)
            assert prediction_details(response) == prediction_usage(ids, output_ids(answer)), (endpoint, prediction)
    # Drafted from: a prediction's first tokens are drafted before any output, however the tiny
    # model's answer tokenizes again.
    assert wait_until(lambda: prediction_drafts(admg) > before)


def test_a_streamed_answer_with_a_prediction_reports_it_in_the_final_usage_chunk(servers, tiny_prompts):
    plain, admg = servers
    prompt = tiny_prompts[1]
    text = predicted(plain, prompt, None).choices[0].message.content
    chunks = list(
        admg.client().chat.completions.create(
            model=admg.model,
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            max_tokens=24,
            extra_body={"ignore_eos": True, "prediction": {"type": "content", "content": text}},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    details = usage.completion_tokens_details
    whole = prediction_details(predicted(admg, prompt, text))  # the same answer, not streamed
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == whole


def test_a_bad_prediction_gets_a_400_naming_the_field_and_the_others_decode_on(servers, tiny_prompts):
    plain, admg = servers
    content = {"type": "content", "content": "x"}
    for body, kwargs, field in (
        ({"prediction": "just text"}, {}, "prediction"),  # not {"type": "content", ...}
        ({"prediction": {"type": "content", "content": 7}}, {}, "prediction"),
        ({"prediction": {"type": "content", "content": "x " * 9000}}, {}, "prediction"),  # past the cap
        ({"prediction": content}, {"n": 2, "temperature": 1.0}, "n"),
        ({"vllm_xargs": {"self_admg_prediction": [1, 2, 3]}}, {}, "vllm_xargs"),  # ids of its own
    ):
        with pytest.raises(openai.BadRequestError) as err:
            admg.client().completions.create(
                model=admg.model, prompt="The quick brown", max_tokens=8, extra_body=body, **kwargs
            )
        assert err.value.status_code == 400 and err.value.body["param"] == field, body
    empty = predicted(admg, tiny_prompts[2], "")  # empty content: accepted, no effect
    assert output_ids(empty) == output_ids(predicted(plain, tiny_prompts[2], None))
    assert prediction_details(empty) == (0, 0)  # as OpenAI reports an empty prediction
    # A server without self-admg ignores a prediction, as vLLM ignores fields it does not know.
    assert output_ids(predicted(plain, tiny_prompts[3], "anything")) == output_ids(
        predicted(plain, tiny_prompts[3], None)
    )
    assert admg.healthy()


# Predictions a client might send to reach past the front end's check or tie up the server.
SECRET = "secret-prediction-text"
HOSTILE_PREDICTIONS = (
    ({"type": "content", "content": 7}, "prediction"),  # not text
    ({"type": "content", "content": "x" * 300_000}, "prediction"),  # bounded before tokenizing
    ({"type": "content", "content": "\ud800" + SECRET}, "prediction"),  # a lone surrogate
)
FORGED = {"self_admg_prediction": [1, 2, 3]}  # token ids of its own, or text, under the reserved key


def test_every_entry_point_refuses_what_only_the_front_end_may_send_with_a_400(servers, tiny_model_path):
    """Each way a request can carry a prediction or extra args to the engine, streamed or not:
    a hostile prediction or the reserved key is a 400 naming the field, before anything is
    scheduled; the server answers on, and its request log never holds a prediction's text."""
    import httpx

    _, admg = servers
    messages = [{"role": "user", "content": "Hello"}]
    routes = {
        "/v1/chat/completions": {"model": admg.model, "messages": messages, "max_tokens": 4},
        "/v1/completions": {"model": admg.model, "prompt": "Hello", "max_tokens": 4},
    }
    sent = []
    for path, body in routes.items():
        for stream in (False, True):
            for prediction, field in HOSTILE_PREDICTIONS:
                sent.append((path, {**body, "stream": stream, "prediction": prediction}, field))
            for forged in (FORGED, {"self_admg_prediction": SECRET}):
                sent.append((path, {**body, "stream": stream, "vllm_xargs": forged}, "vllm_xargs"))
    others = {  # entry points that take no prediction of their own
        "/v1/responses": {"model": admg.model, "input": "Hello", "max_output_tokens": 4},
        "/v1/chat/completions/batch": {"model": admg.model, "messages": [messages, messages], "max_tokens": 4},
    }
    for path, body in others.items():
        sent.append((path, {**body, "vllm_xargs": FORGED}, "vllm_xargs"))
        sent.append((path, {**body, "prediction": {"type": "content", "content": SECRET}}, "prediction"))
    tokens = {"model": admg.model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "extra_args": FORGED}}
    sent.append(("/inference/v1/generate", tokens, "sampling_params.extra_args"))
    for path, body, field in sent:
        response = httpx.post(admg.url(path), content=json.dumps(body), headers=JSON_HEADERS, timeout=60)
        assert response.status_code == 400, (path, body.get("stream"), field, response.text[:300])
        assert response.json()["error"]["param"] == field, (path, response.text[:300])
    # The token endpoint serves a request without the key, so the refusal above was for it.
    tokens["sampling_params"]["extra_args"] = {"other": 1}
    assert httpx.post(admg.url("/inference/v1/generate"), json=tokens, timeout=60).status_code == 200
    good = {**routes["/v1/completions"], "prediction": {"type": "content", "content": SECRET}}
    assert httpx.post(admg.url("/v1/completions"), json=good, timeout=60).status_code == 200
    assert admg.healthy()
    log = admg.log()
    assert "<prediction of" in log and SECRET not in log  # --enable-log-requests: lengths only


JSON_HEADERS = {"Content-Type": "application/json"}


POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
# Requests vLLM users send every day, each on the endpoint it belongs to (greedy unless it says).
EVERYDAY_REQUESTS = {
    "json schema": (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}},
    ),
    "json object": ("chat", {"response_format": {"type": "json_object"}}),
    "choice": ("completions", {"structured_outputs": {"choice": ["def add(a, b)", "for i in range", "import numpy"]}}),
    "regex": ("completions", {"structured_outputs": {"regex": "[a-z]{3,8}( [0-9]{1,3}){2}"}}),
    "top logprobs": ("chat", {"logprobs": True, "top_logprobs": 3}),
    "prompt logprobs": ("completions", {"prompt_logprobs": 2, "logprobs": 2}),
    "echo": ("completions", {"echo": True, "logprobs": 1}),
    "n = 2 sampled": ("completions", {"n": 2, "temperature": 0.8, "seed": 5}),
    "penalties": ("completions", {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}),
    "min_tokens": ("completions", {"min_tokens": 20, "ignore_eos": False}),
    "max_tokens 1": ("chat", {"max_tokens": 1}),
    "stream with usage": ("chat", {"stream": True, "stream_options": {"include_usage": True}}),
    # 13 tokens a copy: 481, and 24 out, of max_model_len 512.
    "prompt near max_model_len": ("completions", {"prompt": "def add(a, b):\n    return a + b\n" * 37}),
}
# OpenAI serves `prediction` with all but n > 1, logprobs and presence or frequency penalties.
WITH_PREDICTION = [name for name in EVERYDAY_REQUESTS if name not in ("top logprobs", "prompt logprobs", "echo")]
WITH_PREDICTION.remove("n = 2 sampled")
WITH_PREDICTION.remove("penalties")


def served(server, endpoint: str, fields: dict) -> tuple[int, dict]:
    """(status, the answer without what differs between any two servers: ids, times, and the
    prediction counts a plain server does not make); a stream's chunks are joined."""
    import httpx

    body = {"model": server.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **fields}
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Summarize the following article"}], **body}
    else:
        body = {"prompt": "import numpy as np\n", **body}
    url = server.url(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}")
    response = httpx.post(url, json=body, timeout=120)
    if response.status_code != 200:
        return response.status_code, {"error": response.json()["error"]["message"]}
    if not body.get("stream"):
        return 200, comparable(response.json())
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return 200, comparable({"text": text, "usage": usage})


def comparable(answer):
    if isinstance(answer, dict):
        # (a plain server ignores the prediction, whose counts are details of the usage)
        ignored = ("id", "created", "system_fingerprint", "completion_tokens_details")
        return {k: comparable(v) for k, v in answer.items() if k not in ignored}
    if isinstance(answer, list):
        return [comparable(v) for v in answer]
    if isinstance(answer, float):  # logprobs: the target's, from logits of another batch shape
        return pytest.approx(answer, abs=1e-3)
    return answer


@pytest.mark.parametrize("name", list(EVERYDAY_REQUESTS))
def test_what_users_send_every_day_is_served_as_plain_serves_it(servers, name):
    """The same status and answer from a plain and a self-admg server, and with the exact answer
    sent as a prediction where OpenAI serves one; identical token for token (logprobs within
    float32 rounding of another batch shape)."""
    plain, admg = servers
    endpoint, fields = EVERYDAY_REQUESTS[name]
    expected = served(plain, endpoint, fields)
    assert expected[0] == 200, expected
    assert served(admg, endpoint, fields) == expected
    if name in WITH_PREDICTION:
        choice = expected[1].get("choices", [{}])[0]
        answer = expected[1].get("text") or choice.get("text") or choice.get("message", {}).get("content")
        prediction = {"prediction": {"type": "content", "content": answer}}
        assert served(admg, endpoint, {**fields, **prediction}) == expected, "with a prediction"


def test_a_seed_gives_plain_decodings_sample_with_or_without_a_prediction(servers):
    plain, admg = servers
    sample = dict(temperature=1.0, max_tokens=24, seed=7, extra_body={"ignore_eos": True})
    expected = complete(plain, "The quick brown", **sample).choices[0].text
    assert complete(admg, "The quick brown", **sample).choices[0].text == expected
    prediction = {"prediction": {"type": "content", "content": expected}}
    with_prediction = {**sample, "extra_body": {**sample["extra_body"], **prediction}}
    assert complete(admg, "The quick brown", **with_prediction).choices[0].text == expected
