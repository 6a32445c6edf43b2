# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Predicted outputs (OpenAI's `prediction`): a request's own guess of its answer, such as the
file it asks to edit, followed as the answer is written. Pure: no vLLM.

Here: the prediction read from a request and admitted (bounded, tokenized, checked), and the
usage OpenAI reports, counted by the `prediction_cursor.PredictionCursor` that follows the
output through its prediction, from the prediction and the output alone, so the counts are the
same whatever the batch and whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Where a request's prediction travels in its `SamplingParams.extra_args`: an
# `AdmittedPrediction` from the front end to vLLM's input processor, then its token ids.
PREDICTION_KEY = "self_admg_prediction"


class PredictionError(ValueError):
    """A `prediction` that is not OpenAI's shape; the message names the field."""


def prediction_text(value) -> str:
    """The text of OpenAI's `prediction`: {"type": "content", "content": a string, or an array
    of text parts {"type": "text", "text": ...}, joined as they are}."""
    if not isinstance(value, dict) or set(value) - {"type", "content"}:
        raise PredictionError('prediction must be {"type": "content", "content": ...}')
    if value.get("type") != "content":
        raise PredictionError('prediction.type must be "content"')
    content = value.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "".join(part["text"] for part in content)
    raise PredictionError('prediction.content must be a string or an array of {"type": "text", "text": ...} parts')


def _is_text_part(part) -> bool:
    is_part = isinstance(part, dict) and set(part) == {"type", "text"}
    return is_part and part["type"] == "text" and isinstance(part["text"], str)


def with_prediction(params, content):
    """A copy of `params` (vLLM's `SamplingParams`) whose request carries `content` (a string,
    or OpenAI's array of text parts) as its prediction, for `LLM.generate`; vLLM's input
    processor tokenizes it with the prompt's tokenizer. Served by self-admg engines only."""
    text = prediction_text({"type": "content", "content": content})
    if params.n > 1:
        raise PredictionError("a prediction is served with n = 1 only")
    copy = params.clone()
    copy.extra_args = {**(params.extra_args or {}), PREDICTION_KEY: AdmittedPrediction(text=text)}
    return copy


@dataclass(frozen=True, repr=False)
class AdmittedPrediction:
    """A prediction that the front end took from a request: its token ids, checked, or (offline,
    `with_prediction`) its text, which vLLM's input processor passes through `admitted`. No JSON
    decodes to one, so ids or text that a client put in its extra args are never taken for a
    prediction; its repr gives its length alone, so that no request log holds a client's text."""

    ids: tuple[int, ...] | None = None
    text: str | None = None

    def __repr__(self) -> str:
        size = f"{len(self.ids)} tokens" if self.ids is not None else f"{len(self.text or '')} characters"
        return f"<prediction of {size}>"


# Tokens of real text average a few characters; no tokenizer makes them longer than this.
MAX_CHARACTERS_PER_TOKEN = 32


def admitted(text: str, *, encode, limit: int, vocab_size: int) -> AdmittedPrediction:
    """The one check every prediction passes before the engine sees it: its length in characters
    before any tokenizer time is spent, then its ids (`encode(text)`) within `limit` and the
    model's vocabulary. A PredictionError names what is wrong, a tokenizer's failure included."""
    if not isinstance(text, str):
        raise PredictionError("prediction.content must be text")
    if len(text) > MAX_CHARACTERS_PER_TOKEN * limit:
        raise PredictionError(f"prediction.content is {len(text)} characters; this server takes at most {limit} tokens")
    try:
        ids = list(encode(text)) if text else []
    except Exception as err:  # a lone surrogate, say: the client's text, not the server, is wrong
        raise PredictionError(f"prediction.content could not be tokenized ({type(err).__name__})") from None
    if len(ids) > limit:
        raise PredictionError(f"prediction.content is {len(ids)} tokens; this server takes at most {limit}")
    if not in_vocabulary(ids, vocab_size):
        raise PredictionError("prediction.content tokenizes to ids outside the model's vocabulary")
    return AdmittedPrediction(ids=tuple(ids))


class PredictionUsage(NamedTuple):
    """OpenAI's `completion_tokens_details` for a request with a prediction: of the prediction's
    tokens, those the output used in order (where the cursor stood, or rejoined), and the rest."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


def in_vocabulary(ids, vocab_size: int) -> bool:
    """Whether `ids` is a list of token ids of a vocabulary of `vocab_size` (a prediction that
    came from a client is checked before a draft is made of it: an id past the vocabulary would
    fault the model's embedding)."""
    return isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab_size for t in ids)


def total_usage(prediction: Sequence[int], outputs: Sequence[Sequence[int]]) -> PredictionUsage:
    """The usage of one prediction over a request's choices, summed."""
    counts = [prediction_usage(prediction, output) for output in outputs]
    return PredictionUsage(*(sum(column) for column in zip(*counts))) if counts else PredictionUsage(0, 0)


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> PredictionUsage:
    # (imported here: the cursor is compiled by numba, which a vLLM worker must not import before
    # vLLM has set the worker up, and this module is loaded with the plugin in every process)
    from vllm_selfspec.sources.prediction_cursor import PredictionCursor

    cursor = PredictionCursor(prediction)
    cursor.follow(output)
    return PredictionUsage(cursor.used, len(cursor.tokens) - cursor.used)
