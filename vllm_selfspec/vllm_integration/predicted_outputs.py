# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""OpenAI's `prediction` on vLLM's /v1/chat/completions and /v1/completions, served by self-admg.

vLLM 0.32 keeps an unknown request field and ignores it. For a self-admg engine, the serving
layer's `create_chat_completion` and `create_completion` now read `prediction` before anything
is sent: a wrong shape, a prediction longer than `max_prediction_tokens`, or `prediction` with
`n` > 1 is a 400 naming the field; otherwise its text is tokenized once, by the prompt's own
tokenizer, and its token ids travel to the workers in the request's `SamplingParams.extra_args`
(through vLLM's own `vllm_xargs`, which a client may not use to send ids of its own). The
proposer drafts from them (`vllm_selfspec.prediction`); verification keeps the output exact.

The response's `usage.completion_tokens_details` gets `accepted_prediction_tokens` and
`rejected_prediction_tokens`, counted from the prediction and each choice's output alone
(`prediction.prediction_usage`), in a stream's final usage chunk when the client asks for usage.

On a server whose speculative method is not self-admg, a prediction is ignored with one warning,
as vLLM ignores any field it does not know: the answer is the same, only not sooner.

Offline, `LLM.generate` takes a prediction through `vllm_selfspec.with_prediction(params, text)`,
whose text `InputProcessor.process_inputs` (where vLLM tokenizes prompts) tokenizes.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import sys

from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, make_options
from vllm_selfspec.prediction import (
    PREDICTION_KEY,
    PREDICTION_TEXT_KEY,
    PredictionError,
    in_vocabulary,
    prediction_text,
    total_usage,
)
from vllm_selfspec.vllm_integration.patching import original, patch
from vllm_selfspec.vllm_integration.scheduler_lookahead import is_self_admg_config

logger = logging.getLogger("vllm.selfspec")
_warned_ignored = False


CHAT_SERVING = "vllm.entrypoints.openai.chat_completion.serving"
COMPLETION_SERVING = "vllm.entrypoints.openai.completion.serving"


def apply() -> None:
    """The input processor in every process that has one; the OpenAI serving layer only in a
    process that serves HTTP (engine and worker processes never do, and importing the server's
    modules there would only cost time and risk)."""
    from vllm.v1.engine.input_processor import InputProcessor

    patch(InputProcessor, "process_inputs", _tokenizing_prediction(InputProcessor), "tokenize an offline prediction")
    apply_to_serving()


API_SERVER = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` imports first


def apply_to_serving() -> None:
    """Patch the OpenAI serving layer in a process that serves HTTP: one that has imported it,
    or `vllm serve`'s, which imports it only once the engine runs (once only)."""
    if API_SERVER in sys.modules:
        importlib.import_module(CHAT_SERVING)
        importlib.import_module(COMPLETION_SERVING)
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


# ---- the request --------------------------------------------------------------------------------


def _taking_prediction(serving, name):
    async def create(self, request, raw_request=None):
        error = _take_prediction(self, request)
        if error is not None:
            return self.create_error_response(error[1], param=error[0])
        return await original(serving, name)(self, request, raw_request)

    return create


def _take_prediction(serving, request) -> tuple[str, str] | None:
    """Validate and tokenize the request's prediction into its `vllm_xargs`; (field, message)
    of a 400, or None."""
    xargs = getattr(request, "vllm_xargs", None) or {}
    for key in (PREDICTION_KEY, PREDICTION_TEXT_KEY):
        if key in xargs:
            return "vllm_xargs", f"vllm_xargs.{key} is reserved for self-admg: send `prediction` instead"
    value = (getattr(request, "model_extra", None) or {}).get("prediction")
    if value is None:
        return None
    config = serving.engine_client.vllm_config
    if not is_self_admg_config(config.speculative_config):
        _warn_ignored()
        return None
    try:
        text = prediction_text(value)
    except PredictionError as err:
        return "prediction", str(err)
    if (request.n or 1) > 1:
        return "n", "`prediction` is served with n = 1 only"
    if _prompts(request) > 1:
        return "prompt", "`prediction` is served with one prompt a request only"
    # Empty content tokenizes to no ids: nothing is drafted, and usage reports 0 and 0 as
    # OpenAI's does (the input processor drops the empty ids before the engine).
    limit = max_prediction_tokens(config)
    if len(text) > MAX_CHARACTERS_PER_TOKEN * limit:  # refused before the tokenizer spends time on it
        return "prediction", f"prediction.content is {len(text)} characters; this server takes at most {limit} tokens"
    tokenizer = serving.renderer.tokenizer  # None where the server skipped it: ids cannot be made
    if tokenizer is None and text:
        return "prediction", "this server runs without a tokenizer (--skip-tokenizer-init): it cannot read a prediction"
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    if len(ids) > limit:
        return "prediction", f"prediction.content is {len(ids)} tokens; this server takes at most {limit}"
    request.vllm_xargs = {**xargs, PREDICTION_KEY: list(ids)}
    return None


# Tokens of real text average a few characters; no tokenizer makes them longer than this.
MAX_CHARACTERS_PER_TOKEN = 32


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


def _tokenizing_prediction(processor):
    def process_inputs(self, *args, **kwargs):
        request = original(processor, "process_inputs")(self, *args, **kwargs)
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if PREDICTION_TEXT_KEY in extra or PREDICTION_KEY in extra:
            params.extra_args = _tokenized(self, extra)
        return request

    return process_inputs


def _tokenized(processor, extra: dict) -> dict:
    """extra_args with the prediction as bounded token ids (its text tokenized), or without it
    where self-admg does not run."""
    from vllm.exceptions import VLLMValidationError

    config = processor.vllm_config
    rest = {k: v for k, v in extra.items() if k not in (PREDICTION_KEY, PREDICTION_TEXT_KEY)}
    if not is_self_admg_config(config.speculative_config):
        _warn_ignored()
        return rest
    ids = extra.get(PREDICTION_KEY)
    if PREDICTION_TEXT_KEY in extra:
        ids = processor.get_tokenizer().encode(extra[PREDICTION_TEXT_KEY], add_special_tokens=False)
    limit, vocab = max_prediction_tokens(config), config.model_config.get_vocab_size()
    if not in_vocabulary(ids, vocab) or len(ids) > limit:
        raise VLLMValidationError(
            f"a prediction is at most {limit} token ids of this model's vocabulary", parameter="prediction"
        )
    return {**rest, PREDICTION_KEY: ids} if ids else rest


# ---- the usage ----------------------------------------------------------------------------------


def _prediction_of(request) -> list[int] | None:
    return (getattr(request, "vllm_xargs", None) or {}).get(PREDICTION_KEY)


def _details(usage, outputs_token_ids, prediction) -> None:
    """Set the prediction counts in `usage` (summed over the choices), keeping what is there."""
    from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo

    details = usage.completion_tokens_details
    usage.completion_tokens_details = CompletionTokenUsageInfo(
        reasoning_tokens=getattr(details, "reasoning_tokens", 0) or 0,
        **total_usage(prediction, outputs_token_ids)._asdict(),
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
            _details(response.usage, [o.token_ids for o in last[0].outputs], prediction)
        return response

    return full


def _completion_with_usage(serving):
    def to_response(self, final_res_batch, request, *args, **kwargs):
        response = original(serving, "request_output_to_completion_response")(
            self, final_res_batch, request, *args, **kwargs
        )
        prediction = _prediction_of(request)
        if prediction is not None and getattr(response, "usage", None) is not None:
            _details(response.usage, [o.token_ids for res in final_res_batch for o in res.outputs], prediction)
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
            yield _with_details(chunk, list(outputs.values()), prediction)

    return stream


def _with_details(chunk: str, outputs_token_ids: list[list[int]], prediction: list[int]) -> str:
    if not chunk.startswith("data: {") or '"usage"' not in chunk:
        return chunk
    data = json.loads(chunk[len("data: ") :])
    if data.get("choices") or not data.get("usage"):
        return chunk
    details = data["usage"].get("completion_tokens_details") or {}
    data["usage"]["completion_tokens_details"] = {**details, **total_usage(prediction, outputs_token_ids)._asdict()}
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
