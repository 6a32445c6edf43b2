"""Prompt-lookup drafts: the continuation of an earlier occurrence of the context's last n-gram.

Code and summaries copy from their context (identifiers, quoted sentences), and such a draft
costs no forward pass at all. The proposer takes these drafts when the context offers one and
drafts with the model itself otherwise (`vllm_selfspec.controller` decides how much of each
pays). Same idea as vLLM's `ngram` method (Saxena's prompt lookup decoding); the difference is
that the *most recent* occurrence is used, which follows local repetition in code better.
"""

from __future__ import annotations

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
