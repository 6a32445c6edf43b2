# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Predicted outputs (OpenAI's `prediction`): a request's own guess of its answer, such as the
file it asks to edit, followed as the answer is written. Pure: no vLLM.

A `PredictionCursor` stands where the output is in its prediction: each output token that
equals the prediction's token at the cursor moves it on (a token the output used); any other
token loses it, and the cursor looks for where the output rejoins the prediction: a place whose
preceding `REJOIN_TOKENS` tokens equal the output's last ones, the first at or after where the
cursor was lost (an edit in the middle of a file resumes after the edit, not at an earlier copy
of the same lines), else the last before it. While it stands somewhere, the prediction's next
tokens are the row's draft.

The same cursor counts the usage OpenAI reports (`prediction_usage`), from the prediction and
the output alone, so the counts are the same whatever the batch and whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

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


# Output tokens that must equal the prediction's before the cursor rejoins it: one or two
# tokens (a space, a bracket) recur everywhere in code and prose; three seldom recur by chance.
REJOIN_TOKENS = 3


class PredictionCursor:
    """Where an output stands in its prediction. Work per output token is bounded whatever the
    prediction holds: constant where the output follows it, and a few binary searches of an
    index built once (O(log P)) where the cursor looks for the way back, however often the
    output's last tokens recur in the prediction. Memory is a few arrays of its length."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.position: int | None = 0  # the prediction's token the output's next token should be
        self.lost_at = 0  # where the cursor last stood before the output departed
        self.departures = 0  # times the output departed from the prediction
        self.seen = 0  # output tokens followed so far
        # Output tokens that equalled the prediction's in a row where the cursor stands (those
        # that found the way back count): the longer, the likelier the next draft holds, as a
        # lookup's match length says (`control.acceptance.token_bins`).
        self.run = 0
        self.credited = np.zeros(len(self.tokens), dtype=bool)  # prediction tokens the output used
        # The index: every REJOIN_TOKENS-gram as one exact key (its tokens renumbered densely, so
        # that the key fits 64 bits whatever the vocabulary), sorted by key, then by position.
        self._distinct = np.unique(self.tokens)
        keys = _gram_keys(np.searchsorted(self._distinct, self.tokens), base=len(self._distinct))
        order = np.argsort(keys, kind="stable")
        self._keys, self._ends = keys[order], np.arange(REJOIN_TOKENS, len(self.tokens) + 1)[order]

    @property
    def used(self) -> int:
        return int(self.credited.sum())

    def follow(self, output: Sequence[int] | np.ndarray) -> None:
        """Move along the output's tokens not followed yet (`output`: the whole output so far)."""
        # Only the new tokens and the few before them that a rejoin compares are read, so that
        # a step costs the same early in a long output as late.
        start = max(0, self.seen - REJOIN_TOKENS + 1)
        new = np.asarray(output[start:], dtype=np.int64)
        for i in range(self.seen - start, len(new)):
            at = self.position
            if at is not None and at < len(self.tokens) and self.tokens[at] == new[i]:
                self.credited[at] = True
                self.position, self.run = at + 1, self.run + 1
                continue
            if at is not None:
                self.lost_at, self.position, self.departures = at, None, self.departures + 1
            self.position = self._rejoin(new[max(0, i + 1 - REJOIN_TOKENS) : i + 1])
            self.run = 0 if self.position is None else REJOIN_TOKENS
            if self.position is not None:  # the tokens that found the way back were used too
                self.credited[self.position - REJOIN_TOKENS : self.position] = True
        self.seen = start + len(new)

    def draft(self, max_tokens: int) -> np.ndarray:
        """The prediction's next tokens where the cursor stands (none where it is lost)."""
        if self.position is None or max_tokens <= 0:
            return self.tokens[:0]
        return self.tokens[self.position : self.position + max_tokens]

    def _rejoin(self, tail: np.ndarray) -> int | None:
        """Just after a place where the prediction's tokens equal `tail` (the output's last
        REJOIN_TOKENS): the first at or after `lost_at`, else the last before it; None if none.
        Four binary searches, however many places match."""
        if len(tail) < REJOIN_TOKENS or not len(self._keys):
            return None
        dense = np.minimum(np.searchsorted(self._distinct, tail), len(self._distinct) - 1)
        if (self._distinct[dense] != tail).any():
            return None  # a token the prediction never holds
        base = len(self._distinct)
        key = 0
        for token in dense.tolist():  # as _gram_keys makes it, without arrays for one gram
            key = key * base + token
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        if lo == hi:
            return None
        ahead = lo + np.searchsorted(self._ends[lo:hi], self.lost_at, "left")  # places ascend
        return int(self._ends[ahead] if ahead < hi else self._ends[hi - 1])


def _gram_keys(dense: np.ndarray, base: int) -> np.ndarray:
    """One int64 key per REJOIN_TOKENS-gram of `dense` (tokens renumbered 0..base-1): equal keys
    are equal grams (a prediction is capped far below the 2**21 distinct tokens that would
    overflow)."""
    if len(dense) < REJOIN_TOKENS:
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(dense.astype(np.int64), REJOIN_TOKENS)
    keys = np.zeros(len(windows), dtype=np.int64)
    for j in range(REJOIN_TOKENS):
        keys = keys * np.int64(base) + windows[:, j]
    return keys


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
    cursor = PredictionCursor(prediction)
    cursor.follow(output)
    return PredictionUsage(cursor.used, len(cursor.tokens) - cursor.used)
