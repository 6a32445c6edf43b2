# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""OpenAI's `prediction` on vLLM's /v1/chat/completions and /v1/completions, served by self-admg.

vLLM 0.32 keeps an unknown request field and ignores it. For a self-admg engine, the serving
layer's `create_chat_completion` and `create_completion` now read `prediction` before anything
is sent: a wrong shape, `n` > 1, text too long for `max_prediction_tokens` (bounded in
characters before any tokenizer time is spent) or text the tokenizer cannot read is a 400
naming the field. Otherwise its text is tokenized once, by the prompt's own tokenizer, on a
worker thread rather than the event loop, and travels as an `AdmittedPrediction` in the
request's `vllm_xargs`. No JSON decodes to one: every other way in (responses, the batch chat
endpoint, the scale-out token endpoint, any client's extra args) that carries the reserved key
is a 400 naming it, checked on those entry points and, for every request whatever its way in,
by vLLM's input processor, which alone turns an admitted prediction into the token ids the
workers draft from (`vllm_selfspec.sources.prediction`); verification keeps the output exact.

The response's `usage.completion_tokens_details` gets `accepted_prediction_tokens` and
`rejected_prediction_tokens`, counted from the prediction and each choice's output alone
(`prediction.prediction_usage`), off the event loop, in a stream's final usage chunk when the
client asks for usage. A request log shows a prediction's length, never its text.

On a server whose speculative method is not self-admg, a prediction is ignored with one warning
and extra args pass as they are, as vLLM serves them: the answer is the same, only not sooner.

Offline, `LLM.generate` takes a prediction through `vllm_selfspec.with_prediction(params, text)`,
whose text the input processor puts through the same check.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import json
import logging
import sys

from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, make_options
from vllm_selfspec.sources.prediction import (
    PREDICTION_KEY,
    AdmittedPrediction,
    PredictionError,
    PredictionUsage,
    admitted,
    prediction_text,
    total_usage,
)
from vllm_selfspec.vllm_integration.patching import original, patch
from vllm_selfspec.vllm_integration.scheduler_lookahead import is_self_admg_config

logger = logging.getLogger("vllm.selfspec")
_warned_ignored = False


CHAT_SERVING = "vllm.entrypoints.openai.chat_completion.serving"
COMPLETION_SERVING = "vllm.entrypoints.openai.completion.serving"
# Entry points that take no `prediction` but pass a client's extra args to the engine: each
# refuses the reserved key before scheduling; the input processor refuses it in any case.
OTHER_ENTRY_POINTS = (
    ("vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses", "create_responses"),
    ("vllm.entrypoints.openai.chat_completion.batch_serving", "OpenAIServingChatBatch", "create_batch_chat_completion"),
    ("vllm.entrypoints.scale_out.token_in_token_out.serving", "ServingTokens", "serve_tokens"),
)
REQUEST_LOGGER = "vllm.entrypoints.serve.utils.request_logger"


def apply() -> None:
    """The input processor in every process that has one; the OpenAI serving layer only in a
    process that serves HTTP (engine and worker processes never do, and importing the server's
    modules there would only cost time and risk)."""
    from vllm.v1.engine.input_processor import InputProcessor

    patch(
        InputProcessor,
        "process_inputs",
        _tokenizing_prediction(InputProcessor),
        "admit only the front end's predictions; tokenize an offline one",
    )
    apply_to_serving()


API_SERVER = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` imports first


def apply_to_serving() -> None:
    """Patch the OpenAI serving layer in a process that serves HTTP: one that has imported it,
    or `vllm serve`'s, which imports it only once the engine runs (once only)."""
    if API_SERVER in sys.modules:
        for module in (CHAT_SERVING, COMPLETION_SERVING, REQUEST_LOGGER):
            importlib.import_module(module)
    if CHAT_SERVING not in sys.modules or COMPLETION_SERVING not in sys.modules:
        return
    OpenAIServingChat = sys.modules[CHAT_SERVING].OpenAIServingChat  # noqa: N806 (vLLM's class names)
    OpenAIServingCompletion = sys.modules[COMPLETION_SERVING].OpenAIServingCompletion  # noqa: N806
    creators = ((OpenAIServingChat, "create_chat_completion"), (OpenAIServingCompletion, "create_completion"))
    for serving, create in creators:
        patch(serving, create, _taking_prediction(serving, create), "take OpenAI's `prediction` for self-admg")
    patch(
        OpenAIServingChat,
        "chat_completion_full_generator",
        _full_chat_with_usage(OpenAIServingChat),
        "report prediction tokens in usage",
    )
    for serving, stream in (
        (OpenAIServingChat, "chat_completion_stream_generator"),
        (OpenAIServingCompletion, "completion_stream_generator"),
    ):
        patch(serving, stream, _stream_with_usage(serving, stream), "report prediction tokens in a stream's usage")
    patch(
        OpenAIServingCompletion,
        "request_output_to_completion_response",
        _completion_with_usage(OpenAIServingCompletion),
        "report prediction tokens in usage",
    )
    _refuse_reserved_keys_elsewhere()
    _redact_logged_bodies()


def _refuse_reserved_keys_elsewhere() -> None:
    for module, name, create in OTHER_ENTRY_POINTS:
        try:
            serving = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # not in this build: the input processor still refuses
            continue
        patch(serving, create, _refusing_reserved_keys(serving, create), "refuse self-admg's reserved extra args key")


def _redact_logged_bodies() -> None:
    """`--enable-log-requests` at debug level logs each request's JSON body: a prediction's text
    is logged as its length (the engine's parameters already log as `AdmittedPrediction`)."""
    if REQUEST_LOGGER not in sys.modules:
        return
    RequestLogger = sys.modules[REQUEST_LOGGER].RequestLogger  # noqa: N806

    def log_request_body(self, request):
        prediction = (getattr(request, "model_extra", None) or {}).get("prediction")
        if prediction is not None:
            request = request.model_copy(update={"prediction": f"<prediction of {len(str(prediction))} characters>"})
        return original(RequestLogger, "log_request_body")(self, request)

    patch(RequestLogger, "log_request_body", log_request_body, "log a prediction's length, not its text")


# ---- the request --------------------------------------------------------------------------------


def _taking_prediction(serving, name):
    """`create_chat_completion` or `create_completion`, with the request's prediction checked
    first and a whole response's prediction counts made off the event loop."""

    async def create(self, request, raw_request=None):
        error = await _take_prediction(self, request)
        if error is not None:
            return self.create_error_response(error[1], param=error[0])
        uncounted = []
        token = _uncounted.set(uncounted)
        try:
            response = await original(serving, name)(self, request, raw_request)
        finally:
            _uncounted.reset(token)
        for usage, prediction, outputs in uncounted:
            _set_details(usage, await _counted(prediction, outputs))
        return response

    return create


async def _take_prediction(serving, request) -> tuple[str, str] | None:
    """Check the request's prediction and put it in its `vllm_xargs`, tokenized off the event
    loop; (field, message) of a 400, or None."""
    xargs = getattr(request, "vllm_xargs", None) or {}
    value = (getattr(request, "model_extra", None) or {}).get("prediction")
    config = serving.engine_client.vllm_config
    if not is_self_admg_config(config.speculative_config):  # as plain vLLM serves it
        if value is not None:
            _warn_ignored()
        return None
    refused = _reserved_key_in(xargs, "vllm_xargs")
    if refused is not None or value is None:
        return refused
    try:
        text = prediction_text(value)
    except PredictionError as err:
        return "prediction", str(err)
    if (getattr(request, "n", 1) or 1) > 1:
        return "n", "`prediction` is served with n = 1 only"
    if _prompts(request) > 1:
        return "prompt", "`prediction` is served with one prompt a request only"
    tokenizer = serving.renderer.tokenizer  # None where the server skipped it: ids cannot be made
    if tokenizer is None and text:
        return "prediction", "this server runs without a tokenizer (--skip-tokenizer-init): it cannot read a prediction"
    check = functools.partial(_admitted, text, tokenizer, config)
    try:
        # Empty content tokenizes to no ids: nothing is drafted, and usage reports 0 and 0 as
        # OpenAI's does (the input processor drops the empty ids before the engine).
        prediction = await asyncio.get_running_loop().run_in_executor(None, check)
    except PredictionError as err:
        return "prediction", str(err)
    request.vllm_xargs = {**xargs, PREDICTION_KEY: prediction}
    return None


def _admitted(text: str, tokenizer, vllm_config) -> AdmittedPrediction:
    return admitted(
        text,
        encode=lambda t: tokenizer.encode(t, add_special_tokens=False),
        limit=max_prediction_tokens(vllm_config),
        vocab_size=vllm_config.model_config.get_vocab_size(),
    )


def _reserved_key_in(extra, field: str) -> tuple[str, str] | None:
    """A 400's (field, message) if a client's extra args hold the key a prediction travels
    under: only the front end puts one there."""
    forged = isinstance(extra, dict) and PREDICTION_KEY in extra
    if forged and not isinstance(extra[PREDICTION_KEY], AdmittedPrediction):
        return field, f"{field}.{PREDICTION_KEY} is reserved for self-admg: send `prediction` instead"
    return None


def _prompts(request) -> int:
    """How many prompts a completions request sends (chat requests send one)."""
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def max_prediction_tokens(vllm_config) -> int:
    return make_options((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})).max_prediction_tokens


def _warn_ignored() -> None:
    global _warned_ignored
    if not _warned_ignored:
        _warned_ignored = True
        logger.warning(
            "a request sent `prediction`, which only the self-admg speculative method serves: it is "
            "ignored, and the answer is the same (logged once)"
        )


def _refusing_reserved_keys(serving, name):
    """An entry point that takes no `prediction` of its own: a client's reserved extra args key
    is a 400 before anything is scheduled, as is a `prediction` field, which would otherwise be
    ignored without a word."""

    async def create(self, request, *args, **kwargs):
        params = getattr(request, "sampling_params", None)  # the token endpoint sends vLLM's own
        if not is_self_admg_config(self.engine_client.vllm_config.speculative_config):
            error = None  # as plain vLLM serves it
        elif params is not None:
            error = _reserved_key_in(getattr(params, "extra_args", None), "sampling_params.extra_args")
        else:
            error = _reserved_key_in(getattr(request, "vllm_xargs", None), "vllm_xargs")
        if error is None and "prediction" in (getattr(request, "model_extra", None) or {}):
            error = "prediction", "`prediction` is served on /v1/chat/completions and /v1/completions only"
        if error is not None:
            return self.create_error_response(error[1], param=error[0])
        return await original(serving, name)(self, request, *args, **kwargs)

    return create


def _tokenizing_prediction(processor):
    def process_inputs(self, *args, **kwargs):
        request = original(processor, "process_inputs")(self, *args, **kwargs)
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if PREDICTION_KEY in extra:
            params.extra_args = _with_prediction_ids(self, extra)
        return request

    return process_inputs


def _with_prediction_ids(processor, extra: dict) -> dict:
    """extra_args with the prediction as its checked token ids (an offline prediction's text
    tokenized), or without it where self-admg does not run. Every request passes here, whatever
    entry point it came through: a prediction that the front end did not admit is a 400."""
    from vllm.exceptions import VLLMValidationError

    config = processor.vllm_config
    prediction = extra[PREDICTION_KEY]
    rest = {k: v for k, v in extra.items() if k != PREDICTION_KEY}
    if not is_self_admg_config(config.speculative_config):  # as plain vLLM serves it
        if not isinstance(prediction, AdmittedPrediction):
            return extra
        _warn_ignored()
        return rest
    refused = _reserved_key_in(extra, "vllm_xargs")
    if refused is not None:
        raise VLLMValidationError(refused[1], parameter=refused[0])
    if prediction.ids is None:
        try:
            prediction = _admitted(prediction.text, processor.get_tokenizer(), config)
        except PredictionError as err:
            raise VLLMValidationError(str(err), parameter="prediction") from None
    return {**rest, PREDICTION_KEY: list(prediction.ids)} if prediction.ids else rest


# ---- the usage ----------------------------------------------------------------------------------
# Counted on a worker thread, not on the event loop that serves every other request: a count
# follows the whole output through its prediction (bounded, `prediction_cursor.PredictionCursor`,
# but the longer both are, the longer it takes). The cursor is compiled by numba, loaded at the
# first count, not at start-up: numba loaded before a CPU worker that shares this process is set
# up makes that worker fail its start.


def _prediction_of(request) -> list[int] | None:
    prediction = (getattr(request, "vllm_xargs", None) or {}).get(PREDICTION_KEY)
    return list(prediction.ids) if isinstance(prediction, AdmittedPrediction) else None


async def _counted(prediction, outputs_token_ids) -> PredictionUsage:
    return await asyncio.get_running_loop().run_in_executor(None, total_usage, prediction, outputs_token_ids)


def _set_details(usage, counts: PredictionUsage) -> None:
    """Set the prediction counts in `usage`, keeping what is there."""
    from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo

    details = usage.completion_tokens_details
    usage.completion_tokens_details = CompletionTokenUsageInfo(
        reasoning_tokens=getattr(details, "reasoning_tokens", 0) or 0, **counts._asdict()
    )


def _full_chat_with_usage(serving):
    async def full(self, request, result_generator, *args, **kwargs):
        prediction = _prediction_of(request)
        if prediction is None:
            return await original(serving, "chat_completion_full_generator")(
                self, request, result_generator, *args, **kwargs
            )
        last = []

        async def tapped():
            async for result in result_generator:
                last[:] = [result]
                yield result

        response = await original(serving, "chat_completion_full_generator")(self, request, tapped(), *args, **kwargs)
        if last and getattr(response, "usage", None) is not None:
            _set_details(response.usage, await _counted(prediction, [o.token_ids for o in last[0].outputs]))
        return response

    return full


# The responses a request's `create_completion` built, whose usage it counts before it returns
# (vLLM builds them in a plain function, where nothing can be awaited).
_uncounted: contextvars.ContextVar[list | None] = contextvars.ContextVar("self_admg_uncounted", default=None)


def _completion_with_usage(serving):
    def to_response(self, final_res_batch, request, *args, **kwargs):
        response = original(serving, "request_output_to_completion_response")(
            self, final_res_batch, request, *args, **kwargs
        )
        prediction = _prediction_of(request)
        if prediction is not None and getattr(response, "usage", None) is not None:
            outputs = [o.token_ids for res in final_res_batch for o in res.outputs]
            uncounted = _uncounted.get()
            if uncounted is None:  # called from elsewhere than `create_completion`
                _set_details(response.usage, total_usage(prediction, outputs))
            else:
                uncounted.append((response.usage, prediction, outputs))
        return response

    return to_response


def _stream_with_usage(serving, name):
    """A stream's final usage chunk (the one with no choices) gets the prediction counts, from
    the token ids its deltas carried, per choice."""

    @functools.wraps(original(serving, name))
    async def stream(self, request, *args, **kwargs):
        prediction = _prediction_of(request)
        if prediction is None:
            async for chunk in original(serving, name)(self, request, *args, **kwargs):
                yield chunk
            return
        index = 1 if name == "completion_stream_generator" else 0  # (after engine_inputs)
        args = list(args)
        outputs: dict[tuple, list[int]] = {}

        async def tapped(results):
            async for item in results:
                key, result = item if isinstance(item, tuple) else (0, item)
                for output in result.outputs:
                    outputs.setdefault((key, output.index), []).extend(output.token_ids)
                yield item

        args[index] = tapped(args[index])
        async for chunk in original(serving, name)(self, request, *args, **kwargs):
            data = _final_usage(chunk)
            if data is not None:
                chunk = _with_details(data, await _counted(prediction, list(outputs.values())))
            yield chunk

    return stream


def _final_usage(chunk: str) -> dict | None:
    """A stream chunk's data if it is the final usage chunk (no choices, a usage), else None."""
    if not chunk.startswith("data: {") or '"usage"' not in chunk:
        return None
    data = json.loads(chunk[len("data: ") :])
    return None if data.get("choices") or not data.get("usage") else data


def _with_details(data: dict, counts: PredictionUsage) -> str:
    details = data["usage"].get("completion_tokens_details") or {}
    data["usage"]["completion_tokens_details"] = {**details, **counts._asdict()}
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
