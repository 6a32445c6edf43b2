"""Lookup drafts: continue the context the way its earlier occurrences continued.

Code and summaries copy from their context (identifiers, quoted sentences), and answers to
similar requests repeat each other (boilerplate, a summary's phrasing); such a draft costs no
forward pass at all. The proposer takes these drafts when they are likely enough and drafts
with the model itself otherwise (`vllm_selfspec.control` decides how much of each pays).

The rule is suffix decoding's (Oliaro et al., 2024; vLLM's `suffix` method, arctic-inference's
`SuffixDecodingCache` with a single path), computed here with numpy and no suffix tree:
  * every match length m = 1..max_match of the context's last tokens is considered;
  * the draft follows, token by token, the most frequent continuation of the earlier
    occurrences of those m tokens (ties: the most recent occurrence, which follows local
    repetition in code);
  * token j's probability is the share of occurrences, counting the current one, that continue
    with the draft's first j tokens: one earlier occurrence gives 1/2, two that agree 2/3;
  * the draft stops below `min_prob`, is at most m tokens long, and of all m the draft with the
    largest sum of probabilities wins (ties: the longer match).
The probabilities are what the controller prices drafts by (after calibration, since a single
earlier occurrence says 1/2 for a copied sentence and for a code fragment alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from collections import OrderedDict

import numpy as np

from vllm_selfspec.control.acceptance import DraftSource

SEPARATOR = -1  # between outputs in a history: no continuation crosses it


@dataclass(frozen=True)
class LookupDraft:
    tokens: np.ndarray  # int64
    probs: tuple[float, ...] = ()  # per token: share of occurrences continuing this far
    match: int = 0  # how many of the context's last tokens the occurrences matched

    @property
    def score(self) -> float:
        return sum(self.probs)

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = LookupDraft(np.zeros(0, dtype=np.int64))


def suffix_draft(context: np.ndarray, max_tokens: int, corpus: np.ndarray | None = None,
                 max_match: int = 24, min_prob: float = 0.1) -> LookupDraft:
    """The best draft of up to `max_tokens` tokens for `context`, from the earlier occurrences of
    its last tokens in `context` itself (corpus None) or in `corpus` (earlier outputs joined by
    SEPARATOR). Costs one vectorised pass over the corpus, then a few small ones."""
    n = len(context)
    own = corpus is None
    corpus = context if own else corpus
    end = n if own else len(corpus)  # continuations stop here
    limit = n - 1 if own else len(corpus) - 1  # an occurrence needs a token after it
    if n == 0 or limit <= 0 or max_tokens <= 0 or max_match <= 0:
        return NO_DRAFT
    ends = np.flatnonzero(corpus[:limit] == context[-1])
    if not len(ends):
        return NO_DRAFT
    # lengths[i]: how many of the context's last tokens match the corpus, ending at ends[i].
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for k in range(1, min(max_match, n)):
        pos = ends[alive] - k
        alive, pos = alive[pos >= 0], pos[pos >= 0]
        alive = alive[corpus[pos] == context[n - 1 - k]]
        if not len(alive):
            break
        lengths[alive] += 1
    best = NO_DRAFT
    # The occurrences change only at the distinct lengths, and the longest m of a run allows
    # the longest draft with the same probabilities, so only those m are tried (ascending, so
    # that a tie goes to the longer match).
    for m in np.unique(lengths):
        occurrences = ends[lengths >= m]
        total = len(occurrences) + 1  # the current occurrence counts: it has no continuation yet
        tokens, probs = [], []
        for j in range(min(max_tokens, int(m))):
            occurrences = occurrences[occurrences + 1 + j < end]
            following = corpus[occurrences + 1 + j]
            occurrences, following = occurrences[following >= 0], following[following >= 0]
            if not len(occurrences):
                break
            # Most frequent next token; among equals the most recent (first in reversed order).
            values, first_reversed, counts = np.unique(following[::-1], return_index=True, return_counts=True)
            pick = np.lexsort((first_reversed, -counts))[0]
            if counts[pick] / total < min_prob:
                break
            tokens.append(int(values[pick]))
            probs.append(float(counts[pick] / total))
            occurrences = occurrences[following == values[pick]]
        if tokens and sum(probs) >= best.score:
            best = LookupDraft(np.asarray(tokens, dtype=np.int64), tuple(probs), int(m))
    return best


class OutputHistory:
    """Earlier requests' outputs, for drafts that the row's own context does not offer.

    One token array, outputs separated by SEPARATOR, the oldest outputs dropped beyond
    `max_tokens`; drafts come from `suffix_draft` over it, so frequent continuations win.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = np.full(1, SEPARATOR, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, output: np.ndarray) -> None:
        joined = np.concatenate([self.tokens, np.asarray(output, dtype=np.int64), [SEPARATOR]])
        if len(joined) > self.max_tokens:  # drop whole outputs, oldest first
            cut = len(joined) - self.max_tokens
            cut += int(np.argmax(joined[cut:] == SEPARATOR))
            joined = joined[cut:]
        self.tokens = joined

    def draft(self, context: np.ndarray, max_tokens: int, max_match: int) -> LookupDraft:
        return suffix_draft(context, max_tokens, self.tokens, max_match)

    def drop_oldest(self) -> None:
        """Drop the oldest output (the history then may hold none: just its separator)."""
        if len(self.tokens) > 1:
            self.tokens = self.tokens[1 + int(np.argmax(self.tokens[1:] == SEPARATOR)):]


class TenantHistories:
    """Earlier outputs, one pool per tenant: a request drafts only from the outputs of requests
    with its own `cache_salt` (None: the shared pool of requests without one, as in vLLM's
    prefix cache). All pools together hold at most `max_tokens` token ids (8 bytes each,
    separators included): the least recently used tenant's oldest outputs go first."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.pools: OrderedDict[str | None, OutputHistory] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.pools.values())

    def pool(self, tenant: str | None) -> OutputHistory | None:
        return self.pools.get(tenant)

    def add(self, tenant: str | None, output: np.ndarray) -> None:
        pool = self.pools.pop(tenant, None) or OutputHistory(self.max_tokens)
        self.pools[tenant] = pool  # the most recently used last
        pool.add(output)
        total = len(self)
        while total > self.max_tokens:
            oldest_tenant, oldest = next(iter(self.pools.items()))
            total -= len(oldest)
            oldest.drop_oldest()
            if len(oldest) > 1:
                total += len(oldest)
            else:  # no output left: the pool goes, separator and all
                del self.pools[oldest_tenant]


def lookup_draft(context: np.ndarray, max_tokens: int, max_match: int,
                 history: OutputHistory | None) -> tuple[DraftSource, LookupDraft]:
    """The better of the context's own draft and the history's, by score (own on ties), with
    its source."""
    own = suffix_draft(context, max_tokens, max_match=max_match)
    if history is not None:
        earlier = history.draft(context, max_tokens, max_match)
        if earlier.score > own.score:
            return DraftSource.HISTORY, earlier
    return DraftSource.LOOKUP, own
