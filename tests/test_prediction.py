# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The prediction cursor: followed as the output grows, found again after an edit, and the
usage OpenAI reports counted from the prediction and the output alone."""

from __future__ import annotations

import pytest

from vllm_selfspec.sources.prediction import prediction_usage
from vllm_selfspec.sources.prediction_cursor import REJOIN_TOKENS, PredictionCursor

FILE = list(range(100, 140))  # a known text: 40 distinct tokens


def test_an_output_that_copies_its_prediction_is_drafted_all_the_way():
    cursor = PredictionCursor(FILE)
    assert list(cursor.draft(4)) == FILE[:4]  # before the first output token
    cursor.follow(FILE[:10])
    assert list(cursor.draft(8)) == FILE[10:18]
    cursor.follow(FILE)
    assert len(cursor.draft(8)) == 0  # the prediction is used up
    assert prediction_usage(FILE, FILE) == (40, 0)


def test_an_edit_in_the_middle_resumes_drafting_where_the_output_rejoins():
    edited = FILE[:15] + [7, 8, 9] + FILE[20:]  # five tokens replaced by three
    cursor = PredictionCursor(FILE)
    cursor.follow(edited[:16])  # the first edited token: lost
    assert len(cursor.draft(4)) == 0
    cursor.follow(edited[: 18 + REJOIN_TOKENS])  # the edit, then REJOIN_TOKENS of the original
    assert list(cursor.draft(4)) == FILE[20 + REJOIN_TOKENS : 24 + REJOIN_TOKENS]
    assert prediction_usage(FILE, edited) == (35, 5)  # the 15 before the edit and the 20 after it


def test_the_run_counts_the_tokens_followed_since_the_cursor_last_stood():
    """What the planner prices a prediction's draft by (its match bucket): 0 where the output
    departs, REJOIN_TOKENS where it rejoins (the tokens that found the way back), one more per
    token followed."""
    edited = FILE[:15] + [7, 8, 9] + FILE[20:]
    cursor = PredictionCursor(FILE)
    assert cursor.run == 0
    cursor.follow(edited[:10])
    assert cursor.run == 10
    cursor.follow(edited[:16])  # departs
    assert cursor.run == 0
    cursor.follow(edited[: 18 + REJOIN_TOKENS])  # rejoins
    assert cursor.run == REJOIN_TOKENS
    cursor.follow(edited[: 18 + REJOIN_TOKENS + 5])
    assert cursor.run == REJOIN_TOKENS + 5


def test_a_rows_prediction_draft_carries_its_run_as_its_match_length():
    """The offer the planner prices: the run, not a fixed bin for every prediction token."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.control import DraftSource
    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.row_lookup import RowLookup

    edited = FILE[:15] + [7, 8, 9] + FILE[20:]  # rejoins after the edit, then follows 2 more
    context = np.array([5, 6, *edited[: 20 + REJOIN_TOKENS]], dtype=np.int32)
    step = SimpleNamespace(
        prediction=lambda row, limit: FILE[:limit],
        token_ids=context[None],
        prompt_lengths=lambda rows: np.full(len(rows), 2, dtype=np.int64),
        context_lengths=lambda rows: [len(context)] * len(rows),
    )
    lookup = RowLookup(make_options({"lookup": False}), FailSafe())
    ((source, draft),) = lookup.find(step, [SimpleNamespace(req_id="a", index=0)], [4], look_up=False)
    want = (DraftSource.PREDICTION, FILE[22 + REJOIN_TOKENS : 26 + REJOIN_TOKENS], REJOIN_TOKENS + 2)
    assert (source, draft.tokens.tolist(), draft.match) == want


def test_a_prediction_left_at_every_fourth_token_gives_way_to_the_contexts_longer_match():
    """A hostile prediction (three equal tokens and another, repeated, beside an output of that
    token) rejoins at every token but is left at the next: the context's own repeats match
    longer, and draft instead. A prediction followed since its first token drafts as it is."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.control import DraftSource
    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.row_lookup import RowLookup

    def found(prediction, output, prompt=(5, 6)):
        context = np.asarray([*prompt, *output])
        step = SimpleNamespace(
            prediction=lambda row, limit: prediction[:limit],
            output=lambda row: output,
            context=lambda row: context,
            token_ids=context[None].astype(np.int32),  # (as vLLM keeps them: looked up in one call)
            context_lengths=lambda rows: [len(context)] * len(rows),
            prompt_lengths=lambda rows: np.full(len(rows), len(prompt), dtype=np.int64),
        )
        lookup = RowLookup(make_options({}), FailSafe())
        ((source, draft),) = lookup.find(step, [SimpleNamespace(req_id="a", index=0)], [4], look_up=True)
        return source, draft.tokens.tolist()

    assert found([7, 7, 7, 9] * 64, [7] * 40) == (DraftSource.LOOKUP, [7, 7, 7, 7])
    followed = FILE[:3] + FILE[:3] + FILE  # the prompt's repeats would match too
    assert found(followed, followed[:8], prompt=FILE[:10]) == (DraftSource.PREDICTION, followed[8:12])


def batch_step(token_ids, lengths, prompts, predictions: dict):
    """A step as `RowLookup.find` reads it: the batch's token ids as vLLM keeps them, and each
    row's context, prompt, output and prediction."""
    from types import SimpleNamespace

    import numpy as np

    return SimpleNamespace(
        prediction=lambda row, limit: predictions.get(row, [])[:limit],
        output=lambda row: token_ids[row, min(prompts[row], lengths[row]) : lengths[row]],
        context=lambda row: token_ids[row, : lengths[row]],
        prompt=lambda row: token_ids[row, : prompts[row]],
        token_ids=token_ids,
        context_lengths=lambda at: lengths[at].tolist(),
        prompt_lengths=lambda at: np.minimum(prompts[at], lengths[at]).astype(np.int64),
    )


def find_each_row_alone(lookup, step, rows, budgets):
    """`lookup.find` where the batch's lookup at once raises: each row is looked up alone."""
    import pytest

    from vllm_selfspec.sources import row_lookup

    def raising(*args, **kwargs):
        raise RuntimeError("a batch's lookup at once that fails")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(row_lookup, "context_drafts", raising)
        return lookup.find(step, rows, budgets, look_up=True)


def test_rows_looked_up_at_once_draft_what_each_row_alone_drafts(caplog):
    """`RowLookup.find` looks up the rows of each history (here: of none) in one call over the
    batch's token ids (a single row without one alone); a step whose call raises looks each row
    up alone, and says so once. Over random
    batches (predictions on some rows, capped drafts, rows without budget), the drafts at once
    are those of each row alone, and no row was looked up alone on the way."""
    import logging
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.row_lookup import RowLookup

    rng = np.random.default_rng(3)
    options = make_options({"experimental": {"max_draft_unless_copying": 3, "lookup_max_match": 6}})
    compared, batches = 0, 60
    caplog.set_level(logging.DEBUG, logger="vllm.selfspec")
    for _ in range(batches):
        batch, width = int(rng.integers(1, 9)), 200
        token_ids = rng.integers(0, int(rng.integers(3, 30)), (batch + 1, width)).astype(np.int32)
        lengths, prompts = rng.integers(1, width + 1, batch + 1), rng.integers(1, 80, batch + 1)
        predictions = {i: token_ids[i, : width // 2].tolist() for i in range(batch + 1) if rng.random() < 0.5}
        rows = [SimpleNamespace(req_id=f"r{i}", index=int(i)) for i in rng.permutation(batch + 1)[:batch]]
        budgets = rng.integers(0, 9, batch).tolist()
        at_once, alone = RowLookup(options, FailSafe()), RowLookup(options, FailSafe())
        looked_up_alone = []
        at_once._row = lambda *row, lookup=at_once._row, seen=looked_up_alone: seen.append(row) or lookup(*row)
        made = (token_ids, lengths, prompts, predictions)
        got = at_once.find(batch_step(*made), rows, list(budgets), look_up=True)
        want = find_each_row_alone(alone, batch_step(*made), rows, list(budgets))
        assert not at_once.quarantine.requests and not alone.quarantine.requests
        for (source, draft), (want_source, want_draft) in zip(got, want):
            assert (source, draft.tokens.tolist(), draft.probs, draft.match) == (
                want_source,
                want_draft.tokens.tolist(),
                want_draft.probs,
                want_draft.match,
            )
            compared += len(draft) > 0
        assert at_once.rows_looked_up == alone.rows_looked_up
        assert len(looked_up_alone) == (at_once.rows_looked_up == 1)  # (one row alone, more at once)
        assert not at_once.batch_failed and alone.batch_failed == (alone.rows_looked_up > 1)
    assert compared > 100
    said = [r.levelno for r in caplog.records if "looked up alone" in r.getMessage()]
    assert said and set(said) == {logging.WARNING}  # (once per proposer)
    caplog.clear()
    find_each_row_alone(alone, batch_step(*made), rows, list(budgets))
    assert [r.levelno for r in caplog.records if "looked up alone" in r.getMessage()] == [logging.DEBUG]


def test_rows_with_a_history_at_once_draft_what_each_row_alone_drafts_and_a_faulty_history_goes_once():
    """The rows of a tenant with a history are looked up in one call, their own contexts and the
    history together, and draft what each row alone drafts (`lookup_draft`: the history's draft
    where it scores higher). Should the history itself raise, the row that finds it so drops it
    and drafts from its own context, and so do the rows after it: one fault, not one a row (a
    shared pool's rows would otherwise switch drafting off for everyone)."""
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.lookup import OutputHistory
    from vllm_selfspec.sources.row_lookup import RowLookup

    rng = np.random.default_rng(4)
    options = make_options({"lookup_history_unsalted": True, "experimental": {"max_draft_unless_copying": 3}})
    sources = set()
    for _ in range(40):
        batch, width, vocabulary = int(rng.integers(2, 9)), 120, int(rng.integers(3, 20))
        token_ids = rng.integers(0, vocabulary, (batch, width)).astype(np.int32)
        lengths, prompts = rng.integers(1, width + 1, batch), rng.integers(1, 40, batch)
        rows = [SimpleNamespace(req_id=f"r{i}", index=i) for i in range(batch)]
        budgets = rng.integers(1, 9, batch).tolist()
        outputs = [rng.integers(0, vocabulary, int(rng.integers(1, 80))) for _ in range(4)]
        made = (token_ids, lengths, prompts, {})

        def lookup_with_history(rows=rows, outputs=outputs):
            lookup = RowLookup(options, FailSafe())
            lookup.tenants = {row.req_id: None for row in rows}  # (unsalted: the shared pool)
            for output in outputs:
                lookup.history.add(None, output)
            return lookup

        at_once, alone = lookup_with_history(), lookup_with_history()
        got = at_once.find(batch_step(*made), rows, list(budgets), look_up=True)
        want = find_each_row_alone(alone, batch_step(*made), rows, list(budgets))
        for (source, draft), (want_source, want_draft) in zip(got, want):
            assert (source, draft.tokens.tolist(), draft.probs, draft.match) == (
                want_source, want_draft.tokens.tolist(), want_draft.probs, want_draft.match,
            )  # fmt: skip
            if len(draft):
                sources.add(source)

        faulty = lookup_with_history()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(OutputHistory, "draft", lambda *args: 1 / 0)
            got = find_each_row_alone(faulty, batch_step(*made), rows, list(budgets))
        own = RowLookup(options, FailSafe()).find(batch_step(*made), rows, list(budgets), look_up=True)
        assert faulty.fail_safe.faults == 1 and faulty.history.tenants == 0 and not faulty.quarantine.requests
        assert [(s, d.tokens.tolist()) for s, d in got] == [(s, d.tokens.tolist()) for s, d in own]
    assert sources == {"lookup", "history"}, sources


def test_only_a_draft_that_copies_drafts_past_the_cap_on_other_drafts():
    """At K = 8 with `max_draft_unless_copying` 4, a lookup of a 12-token match drafts 4 tokens,
    while a prediction the output follows, or a lookup matching all the last 24 tokens a lookup
    compares, drafts all 8; with the cap off (0, the default), or with adaptive off (always K),
    every lookup drafts all 8; self-drafts get the capped budget."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.row_lookup import RowLookup

    capped = {"experimental": {"max_draft_unless_copying": 4}}

    def drafted(options, prediction=(), followed=12):
        output = FILE[:followed]
        context = np.asarray([*FILE, *output])  # the prompt holds the whole file: lookup continues it
        step = SimpleNamespace(
            prediction=lambda row, limit: list(prediction)[:limit],
            output=lambda row: output,
            context=lambda row: context,
            token_ids=context[None].astype(np.int32),
            context_lengths=lambda rows: [len(context)] * len(rows),
            prompt_lengths=lambda rows: np.full(len(rows), len(FILE), dtype=np.int64),
        )
        lookup = RowLookup(make_options(options), FailSafe())
        ((_, draft),) = lookup.find(step, [SimpleNamespace(req_id="a", index=0)], [8], look_up=True)
        return len(draft)

    assert drafted(capped) == 4
    assert drafted(capped, followed=30) == 8  # a copy
    assert drafted(capped, prediction=FILE) == 8
    assert drafted({}) == 8
    assert drafted({**capped, "adaptive": False}) == 8
    assert make_options(capped).uncopied_budget(8) == 4 and make_options(capped).uncopied_budget(3) == 3
    assert make_options({}).uncopied_budget(8) == 8


def test_a_prediction_wrong_from_its_first_token_drafts_nothing_and_counts_nothing_used():
    cursor = PredictionCursor(FILE)
    output = list(range(500, 530))
    cursor.follow(output)
    assert len(cursor.draft(4)) == 0
    assert prediction_usage(FILE, output) == (0, 40)


def test_a_prediction_longer_than_the_answer_leaves_its_tail_rejected():
    assert prediction_usage(FILE, FILE[:10]) == (10, 30)
    assert prediction_usage([], FILE) == (0, 0)  # empty content: no effect


def test_the_rejoin_prefers_the_copy_after_the_edit_to_an_earlier_one():
    repeated = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7]  # "1 2 3" twice
    cursor = PredictionCursor(repeated)
    cursor.follow([1, 2, 3, 4, 5, 9, 1, 2, 3])  # departs at the second copy, then rejoins
    assert list(cursor.draft(2)) == [6, 7]  # after the second copy, not the first


def test_usage_is_counted_one_token_at_a_time_or_all_at_once_alike():
    edited = FILE[:15] + [7, 8, 9] + FILE[20:]
    stepwise = PredictionCursor(FILE)
    for end in range(0, len(edited) + 1, 3):  # verification emits several tokens a step
        stepwise.follow(edited[:end])
    stepwise.follow(edited)
    assert stepwise.used == prediction_usage(FILE, edited).accepted_prediction_tokens


def test_the_openai_shape_is_read_and_anything_else_named_in_the_error():
    from vllm_selfspec.sources.prediction import PredictionError, prediction_text

    assert prediction_text({"type": "content", "content": "def f():"}) == "def f():"
    parts = [{"type": "text", "text": "def "}, {"type": "text", "text": "f():"}]
    assert prediction_text({"type": "content", "content": parts}) == "def f():"
    assert prediction_text({"type": "content", "content": ""}) == ""
    for bad, field in (
        ("def f():", "prediction must be"),
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content"),
        ({"type": "content", "content": "x", "extra": 1}, "prediction must be"),
    ):
        with pytest.raises(PredictionError, match=field):
            prediction_text(bad)


@pytest.mark.engine
def test_an_engine_drafts_from_predictions_and_no_output_changes(tiny_model_path, tiny_prompt_ids, plain_tiny):
    """Offline, in one engine: the exact answer, a wrong one and one longer than the answer as
    predictions (token ids, and text through `with_prediction`), greedy and seeded at
    temperature 1: every output is plain decoding's, and the exact predictions are drafted and
    accepted. A server without self-admg (`plain_tiny`) drops a prediction."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_selfspec import with_prediction
    from vllm_selfspec.sources.prediction import PREDICTION_KEY, AdmittedPrediction

    from conftest import close_llm, make_llm, proposer_report, token_ids

    prompts = [{"prompt_token_ids": ids} for ids in tiny_prompt_ids[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = token_ids(plain_tiny.generate(prompts, greedy, use_tqdm=False))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)
    plain_seeded = token_ids(plain_tiny.generate(prompts, seeded, use_tqdm=False))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)

    def _with(params, ids):  # the token ids as the server's front end admits them
        copy = params.clone()
        copy.extra_args = {PREDICTION_KEY: AdmittedPrediction(ids=tuple(ids))}
        return copy

    spec = {"method": "self-admg", "num_speculative_tokens": 4, "adaptive": False}
    llm = make_llm(tiny_model_path, speculative_config=spec)
    try:
        for predictions in (plain, [[3] * 40] * 3, [out + out for out in plain]):
            params = [_with(greedy, ids) for ids in predictions]
            assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == plain
        report = proposer_report(llm)
        # The exact and the doubled answers: nearly every draft token of the 2 x 3 requests.
        assert report["prediction_accepted"] >= 2 * 3 * 16, report
        texts = [with_prediction(greedy, tokenizer.decode(out)) for out in plain]
        assert token_ids(llm.generate(prompts, texts, use_tqdm=False)) == plain
        assert proposer_report(llm)["prediction_tokens"] > report["prediction_tokens"]  # not dropped
        # Seeded rows beside rows whose exact predictions are verified in the same steps.
        mixed = [seeded, _with(greedy, plain[1]), _with(seeded, plain_seeded[2])]
        outputs = token_ids(llm.generate(prompts, mixed, use_tqdm=False))
        assert outputs == [plain_seeded[0], plain[1], plain_seeded[2]]
    finally:
        close_llm(llm)
    ignored = token_ids(plain_tiny.generate(prompts, [_with(greedy, out) for out in plain], use_tqdm=False))
    assert ignored == plain


def fake_serving(self_admg=True, max_prediction_tokens=8):
    from types import SimpleNamespace

    from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, PROPOSER_PATH

    spec = SimpleNamespace(method="custom_class", model=PROPOSER_PATH if self_admg else "other")
    config = SimpleNamespace(
        speculative_config=spec,
        additional_config={ADDITIONAL_CONFIG_KEY: {"max_prediction_tokens": max_prediction_tokens}},
        model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
    )
    # Bytes, as a byte-level tokenizer reads them: a lone surrogate cannot be encoded.
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: list(text.encode("utf-8")))
    return SimpleNamespace(
        engine_client=SimpleNamespace(vllm_config=config),
        renderer=SimpleNamespace(tokenizer=tokenizer),
    )


def test_the_front_end_tokenizes_a_prediction_into_the_requests_xargs_or_names_what_is_wrong():
    import asyncio
    from types import SimpleNamespace

    from vllm_selfspec.sources.prediction import PREDICTION_KEY, AdmittedPrediction
    from vllm_selfspec.vllm_integration.predicted_outputs import _take_prediction

    def request(prediction, n=1, xargs=None):
        return SimpleNamespace(model_extra={"prediction": prediction}, n=n, vllm_xargs=xargs)

    def take(request, serving=None):
        return asyncio.run(_take_prediction(serving or fake_serving(), request))

    ok = request({"type": "content", "content": "abc"}, xargs={"other": 1})
    assert take(ok) is None
    assert ok.vllm_xargs == {"other": 1, PREDICTION_KEY: AdmittedPrediction(ids=(97, 98, 99))}
    assert repr(ok.vllm_xargs[PREDICTION_KEY]) == "<prediction of 3 tokens>"  # what a request log shows
    assert take(request({"type": "content", "content": "x" * 9}))[0] == "prediction"  # 9 tokens
    too_long = take(request({"type": "content", "content": "x" * (32 * 8 + 1)}))  # before tokenizing
    assert too_long[0] == "prediction" and "characters" in too_long[1]
    surrogate = take(request({"type": "content", "content": "\ud800"}))  # the tokenizer fails
    assert surrogate[0] == "prediction" and "could not be tokenized" in surrogate[1]
    assert take(request({"type": "content", "content": "x"}, n=2))[0] == "n"
    assert take(request("abc"))[0] == "prediction"
    several = request({"type": "content", "content": "x"})
    several.prompt = ["first prompt", "second prompt"]  # one prediction would serve both
    assert take(several)[0] == "prompt"
    several.prompt = [1, 2, 3]  # one prompt, as token ids
    assert take(several) is None
    for forged in ([1, 2], "text", None):
        assert take(request(None, xargs={PREDICTION_KEY: forged}))[0] == "vllm_xargs"
    empty = request({"type": "content", "content": ""})
    assert take(empty) is None and empty.vllm_xargs == {PREDICTION_KEY: AdmittedPrediction(ids=())}
    no_tokenizer = fake_serving()
    no_tokenizer.renderer.tokenizer = None  # `vllm serve --skip-tokenizer-init`: a 400, not a 500
    error = take(request({"type": "content", "content": "abc"}), no_tokenizer)
    assert error[0] == "prediction" and "--skip-tokenizer-init" in error[1]
    elsewhere = request({"type": "content", "content": "abc"}, xargs={PREDICTION_KEY: [1]})
    assert take(elsewhere, fake_serving(self_admg=False)) is None  # another method: as plain vLLM
    assert elsewhere.vllm_xargs == {PREDICTION_KEY: [1]}


def test_only_a_streams_final_usage_chunk_gets_the_prediction_counts():
    import json

    from vllm_selfspec.sources.prediction import PredictionUsage
    from vllm_selfspec.vllm_integration.predicted_outputs import _final_usage, _with_details

    assert _final_usage('data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n') is None
    assert _final_usage("data: [DONE]\n\n") is None
    usage = {"completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 1}}
    final = _final_usage(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
    rewritten = json.loads(_with_details(final, PredictionUsage(2, 1))[len("data: ") :])
    details = rewritten["usage"]["completion_tokens_details"]
    assert details == {"reasoning_tokens": 1, "accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1}


def test_a_prediction_token_is_counted_used_once_however_often_the_output_rejoins_there():
    output = [1, 2, 3, 99] * 4  # rejoins the prediction's first three tokens again and again
    assert prediction_usage(list(range(1, 11)), output) == (3, 7)


def test_following_a_long_output_through_a_long_prediction_stays_cheap():
    import time

    rng = __import__("numpy").random.default_rng(0)
    prediction = rng.integers(0, 50_000, 8192).tolist()
    output = rng.integers(0, 50_000, 8192).tolist()  # lost at every token: a rejoin attempt each
    start = time.perf_counter()
    prediction_usage(prediction, output)
    assert time.perf_counter() - start < 1.0  # a binary search per lost token, not a scan


def test_the_input_processor_admits_only_the_front_ends_predictions():
    """Every request passes here, whatever endpoint it came through: extra args that a client
    wrote under the reserved key are a 400 naming it, never a draft; an offline prediction's
    text passes the front end's check; a server without self-admg serves extra args as vLLM does."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, PROPOSER_PATH
    from vllm_selfspec.sources.prediction import PREDICTION_KEY, AdmittedPrediction
    from vllm_selfspec.vllm_integration.predicted_outputs import _with_prediction_ids

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", model=PROPOSER_PATH),
        additional_config={ADDITIONAL_CONFIG_KEY: {"max_prediction_tokens": 4}},
        model_config=SimpleNamespace(get_vocab_size=lambda: 100),
    )
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [ord(c) - 90 for c in text])
    processor = SimpleNamespace(vllm_config=config, get_tokenizer=lambda: tokenizer)
    admitted = {"other": 1, PREDICTION_KEY: AdmittedPrediction(ids=(1, 2))}
    assert _with_prediction_ids(processor, admitted) == {"other": 1, PREDICTION_KEY: [1, 2]}
    assert _with_prediction_ids(processor, {PREDICTION_KEY: AdmittedPrediction(text="abc")}) == {
        PREDICTION_KEY: [7, 8, 9]
    }
    assert _with_prediction_ids(processor, {"other": 1, PREDICTION_KEY: AdmittedPrediction(ids=())}) == {"other": 1}
    for forged in ([1, 2], "12", None, {"ids": [1]}):
        with pytest.raises(VLLMValidationError, match="reserved"):
            _with_prediction_ids(processor, {PREDICTION_KEY: forged})
    for text in ("abcde", "\x01", "x" * (32 * 4 + 1)):  # past the cap, the vocabulary, the characters
        with pytest.raises(VLLMValidationError):
            _with_prediction_ids(processor, {PREDICTION_KEY: AdmittedPrediction(text=text)})
    plain = SimpleNamespace(vllm_config=SimpleNamespace(**{**vars(config), "speculative_config": None}))
    assert _with_prediction_ids(plain, {"other": 1, PREDICTION_KEY: AdmittedPrediction(ids=(1,))}) == {"other": 1}
    assert _with_prediction_ids(plain, {PREDICTION_KEY: [1]}) == {PREDICTION_KEY: [1]}  # as vLLM serves it


def test_a_prediction_whose_grams_all_match_the_output_costs_no_more_than_a_normal_one():
    """The hostile shape: three equal tokens and another, repeated, beside an output of that
    token repeated, so that the output's last three tokens occur at every fourth place of the
    prediction and the cursor loses and finds it at every token. Each rejoin is a few binary
    searches, whatever the number of places: a scan of them took milliseconds a token."""
    import time

    def per_token(prediction, output) -> float:
        cursor = PredictionCursor(prediction)
        start = time.perf_counter()
        for end in range(1, len(output) + 1):
            cursor.follow(output[:end])
        return (time.perf_counter() - start) / len(output)

    hostile = per_token(([7, 7, 7, 9] * 2048)[:8192], __import__("numpy").full(2000, 7))
    assert hostile < 200e-6  # seconds a token: a scan of 2,048 places costs ~10 ms here


def scanned_rejoin(prediction: list[int], tail: list[int], lost_at: int) -> int | None:
    """The rejoin rule by a scan of every place: just after the first copy of `tail` ending at
    or after `lost_at`, else after the last one before it."""
    ends = [e for e in range(len(tail), len(prediction) + 1) if prediction[e - len(tail) : e] == tail]
    ahead = [e for e in ends if e >= lost_at]
    return ahead[0] if ahead else (ends[-1] if ends else None)


def test_the_indexed_rejoin_lands_where_a_scan_of_every_place_would():
    import numpy as np

    from vllm_selfspec.sources.prediction_cursor import _rejoin

    rng = np.random.default_rng(0)
    for _ in range(2000):
        vocabulary = int(rng.integers(2, 6))  # few distinct tokens: grams recur everywhere
        prediction = rng.integers(0, vocabulary, int(rng.integers(0, 40))).tolist()
        cursor = PredictionCursor(prediction)
        lost_at = int(rng.integers(0, len(prediction) + 2))
        tail = rng.integers(0, vocabulary + 1, REJOIN_TOKENS)  # sometimes a token it lacks
        found = _rejoin(tail, lost_at, cursor._distinct, cursor._keys, cursor._ends)
        assert (None if found < 0 else found) == scanned_rejoin(prediction, tail.tolist(), lost_at)


def test_the_compiled_cursor_follows_as_the_rule_token_by_token_would():
    """`PredictionCursor.follow` (compiled, indexed) against the rule in the module docstring
    in plain Python with a scan for each rejoin, on random outputs fed in random pieces: the
    same place, run, departures and tokens used after every piece."""
    import numpy as np

    rng = np.random.default_rng(1)
    departures = 0
    for _ in range(500):
        vocabulary = int(rng.integers(2, 8))
        prediction = rng.integers(0, vocabulary, int(rng.integers(1, 60))).tolist()
        output = [t if rng.random() < 0.8 else int(rng.integers(0, vocabulary + 1)) for t in prediction]
        output += rng.integers(0, vocabulary + 1, int(rng.integers(0, 6))).tolist()  # (past the prediction's end)
        cursor = PredictionCursor(prediction)
        position, run, lost_at, gone, used, followed = 0, 0, 0, 0, set(), 0  # (the reference's)
        while followed < len(output):
            seen = min(len(output), followed + int(rng.integers(1, 9)))
            cursor.follow(np.asarray(output[:seen], dtype=np.int32))  # (as vLLM's rows hold them)
            for i in range(followed, seen):
                if position is not None and position < len(prediction) and prediction[position] == output[i]:
                    used.add(position)
                    position, run = position + 1, run + 1
                    continue
                if position is not None:
                    lost_at, gone = position, gone + 1
                tail = output[max(0, i + 1 - REJOIN_TOKENS) : i + 1]
                position = scanned_rejoin(prediction, tail, lost_at) if len(tail) == REJOIN_TOKENS else None
                run = 0 if position is None else REJOIN_TOKENS
                if position is not None:
                    used.update(range(position - REJOIN_TOKENS, position))
            followed = seen
            assert (cursor.position, cursor.run, cursor.departures, cursor.used) == (position, run, gone, len(used))
        departures += gone
    assert departures > 300


def test_a_steps_predictions_followed_at_once_are_each_cursor_followed_alone():
    """`RequestPredictions` (every live request's cursor in pooled arrays, a step's rows
    followed in one compiled call) against a `PredictionCursor` per request: over random steps
    of requests that come and go (their slots taken again, the pools compacted and grown),
    outputs that follow, leave and rejoin their predictions, budgets of 0 to 8, and rows whose
    place in the batch is not their place in the step (a partial prefill's row samples nothing),
    each row's draft, match and departures are the cursor's."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.sources.prediction_cursor import PredictionCursor
    from vllm_selfspec.sources.request_predictions import RequestPredictions
    from vllm_selfspec.sources.step_drafts import StepDrafts
    from vllm_selfspec.vllm_integration.runner_state import StepRows

    rng = np.random.default_rng(11)
    predictions = RequestPredictions(max_tokens=300)
    live: dict[str, dict] = {}  # each request's prediction, output and reference cursor
    compared = compactions = 0
    for step_index in range(400):
        while len(live) < 6 or rng.random() < 0.1:
            prediction = rng.integers(0, 6, int(rng.integers(0, 300))).tolist()
            live[f"r{step_index}-{len(live)}"] = {"prediction": prediction, "output": [], "prompt": 3}
        for request in live.values():  # (each output follows its prediction, with edits)
            for _ in range(int(rng.integers(1, 4))):
                at = len(request["output"])
                follows = at < len(request["prediction"]) and rng.random() < 0.85
                request["output"].append(request["prediction"][at] if follows else int(rng.integers(0, 6)))
        req_ids = list(live)
        width = max(3 + len(live[r]["output"]) for r in req_ids)
        batch = rng.permutation(len(req_ids) + 1)  # each row's place in the batch, and one more
        token_ids = rng.integers(0, 6, (len(req_ids) + 1, width)).astype(np.int32)
        by_place = {int(b): r for b, r in zip(batch, req_ids)}
        for b, r in by_place.items():
            token_ids[b, 3 : 3 + len(live[r]["output"])] = live[r]["output"]
        step = SimpleNamespace(
            prediction=lambda place, limit, by_place=by_place: live[by_place[place]]["prediction"][:limit] or None,
            token_ids=token_ids,
            prompt_lengths=lambda at: np.full(len(at), 3, dtype=np.int64),
            context_lengths=lambda at, by_place=by_place: [3 + len(live[by_place[b]]["output"]) for b in at],
        )
        rows = StepRows.of([SimpleNamespace(req_id=r, index=int(b)) for b, r in zip(batch, req_ids)])
        budgets = rng.integers(0, 9, len(rows))
        drafting = [i for i in range(len(rows)) if budgets[i]]
        slots = predictions.slots(step, rows, drafting, failed := [])
        assert not failed
        predicted = [(i, s) for i, s in zip(drafting, slots) if s >= 0]
        drafts = StepDrafts.empty(len(rows), 8)
        at = np.array([i for i, _ in predicted], dtype=np.int64)
        departures = predictions.follow(
            step, rows.index[at], np.array([s for _, s in predicted], dtype=np.int64), budgets[at], drafts, at
        )
        for (i, _), departed in zip(predicted, departures.tolist()):
            request = live[req_ids[i]]
            cursor = request.setdefault("cursor", PredictionCursor(request["prediction"]))
            cursor.follow(request["output"])
            want = cursor.draft(int(budgets[i])).tolist()
            got = drafts.tokens[i, : drafts.lengths[i]].tolist()
            assert (got, departed) == (want, cursor.departures)
            assert drafts.match[i] == (cursor.run if want else 0)
            compared += len(want) > 0
        for r in req_ids:  # (requests end)
            if rng.random() < 0.08 or len(live[r]["output"]) > 400:
                used = predictions.tokens.used
                predictions.forget(r)
                compactions += predictions.tokens.used < used
                del live[r]
    assert compared > 1000 and compactions > 0, (compared, compactions)


def test_a_fault_in_the_steps_predictions_is_blamed_on_its_row_alone():
    """Should following a step's predictions at once raise, each row is followed alone: the
    row whose cursor raises is quarantined and drafts nothing, the others draft as they would
    have."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_selfspec.operations.fail_safe import FailSafe
    from vllm_selfspec.options import make_options
    from vllm_selfspec.sources.row_lookup import RowLookup

    token_ids = np.array([[5, 6, *FILE[:10]]] * 3, dtype=np.int32)
    step = SimpleNamespace(
        prediction=lambda row, limit: FILE[:limit],
        token_ids=token_ids,
        prompt=lambda row: token_ids[row, :2],
        prompt_lengths=lambda rows: np.full(len(rows), 2, dtype=np.int64),
        context_lengths=lambda rows: [12] * len(rows),
    )
    rows = [SimpleNamespace(req_id=f"r{i}", index=i) for i in range(3)]

    def found(poisoned: str | None):
        lookup = RowLookup(make_options({"lookup": False}), FailSafe())
        follow = lookup.predictions.follow

        def raising(step, batch_rows, slots, *rest):
            if poisoned is not None and lookup.predictions.slot_of[poisoned] in slots.tolist():
                raise RuntimeError("a cursor that faults")
            return follow(step, batch_rows, slots, *rest)

        lookup.predictions.follow = raising
        drafts = lookup.find(step, rows, [4, 4, 4], look_up=False)
        return [draft.tokens.tolist() for _, draft in drafts], set(lookup.quarantine.requests)

    clean, quarantined = found(None)
    assert clean == [FILE[10:14]] * 3 and not quarantined
    assert found("r1") == ([FILE[10:14], [], FILE[10:14]], {"r1"})
