"""Prompt-lookup drafts: the continuation of an earlier occurrence of the context's last n-gram.

Code and summaries copy from their context (identifiers, quoted sentences), and such a draft
costs no forward pass at all. The proposer takes these drafts when the context offers one and
drafts with the model itself otherwise (`vllm_selfspec.controller` decides how much of each
pays). Same idea as vLLM's `ngram` method (Saxena's prompt lookup decoding); the difference is
that the *most recent* occurrence is used, which follows local repetition in code better.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


def prompt_lookup(context: np.ndarray, max_ngram: int, max_tokens: int, min_ngram: int = 2) -> np.ndarray:
    """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
    longest n-gram (min_ngram <= n <= max_ngram) ending `context`; empty when there is none."""
    n = len(context)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        # Windows that start at 0..n-1-size: every earlier occurrence, never the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(context[:n - 1], size)
        hits = np.flatnonzero((windows == context[n - size:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + size
            return context[start:start + max_tokens]
    return context[:0]


class OutputHistory:
    """Continuations from earlier requests' outputs, for rows whose own context has no match.

    Answers to similar requests repeat each other (boilerplate code, a summary's phrasing), as
    vLLM's `suffix` method exploits. Every n-gram (min_ngram..max_ngram tokens) that ends inside
    a finished output maps to the tokens that followed it; the most recent output wins, and the
    oldest entries are dropped beyond `max_entries`.
    """

    def __init__(self, max_ngram: int, max_entries: int, continuation: int = 8, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_entries, self.continuation = max_entries, continuation
        self._next: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: np.ndarray, output_start: int) -> None:
        """Index a finished request: `tokens` is prompt and output, the output from
        `output_start` on (the n-gram before an output token may reach into the prompt)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        for end in range(max(output_start, self.min_ngram), len(tokens)):
            following = tokens[end:end + self.continuation].copy()
            for size in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tokens[end - size:end].tobytes()
                self._next[key] = following
                self._next.move_to_end(key)
        while len(self._next) > self.max_entries:
            self._next.popitem(last=False)

    def lookup(self, context: np.ndarray, max_tokens: int) -> np.ndarray:
        """Up to `max_tokens` tokens that followed the longest n-gram ending `context` in an
        earlier output; empty when there is none."""
        context = np.asarray(context, dtype=np.int64)
        for size in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            following = self._next.get(context[len(context) - size:].tobytes())
            if following is not None:
                return following[:max_tokens]
        return context[:0]
