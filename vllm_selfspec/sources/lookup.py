# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Lookup drafts: continue the context the way its earlier occurrences continued.

Code and summaries copy from their context (identifiers, quoted sentences), and answers to
similar requests repeat each other (boilerplate, a summary's phrasing); such a draft costs no
forward pass at all. The proposer takes these drafts when they are likely enough and drafts
with the model itself otherwise (`vllm_selfspec.control` decides how much of each pays).

The rule is suffix decoding's (Oliaro et al., 2024; vLLM's `suffix` method, arctic-inference's
`SuffixDecodingCache` with a single path), computed here with no suffix tree, from the
occurrences of the context's last token (a scan back through the context, an index of the
history), compiled by numba (every row looks up every step), its work bounded by caps on the
occurrences it examines (below):
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

import functools
import itertools
import operator
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from vllm_selfspec.compiled import compiled
from vllm_selfspec.control.acceptance import DraftSource
from vllm_selfspec.scheduler_note import salt_digest

SEPARATOR = -1  # between outputs in a history: no continuation crosses it


@dataclass(frozen=True)
class LookupDraft:
    tokens: np.ndarray  # int64
    probs: tuple[float, ...] = ()  # per token: share of occurrences continuing this far
    match: int = 0  # how many of the context's last tokens the occurrences matched

    @property
    def score(self) -> float:
        """Its probabilities summed in order, as the compiled lookups sum them (`sum` compensates
        its rounding from Python 3.12 on, which could tip a tie between two drafts)."""
        return functools.reduce(operator.add, self.probs, 0.0)

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = LookupDraft(np.zeros(0, dtype=np.int64))


def suffix_draft(
    context: np.ndarray,
    max_tokens: int,
    corpus: np.ndarray | None = None,
    max_match: int = 24,
    min_prob: float = 0.1,
    index: TokenIndex | None = None,
) -> LookupDraft:
    """The best draft of up to `max_tokens` tokens for `context`, from the earlier occurrences of
    its last tokens in `context` itself (corpus None) or in `corpus` (earlier outputs joined by
    SEPARATOR). The occurrences of the last token are found by a scan back through the corpus,
    or, given the corpus's `index`, by two binary searches; then work grows with those found."""
    # One type signature, the one compiled at start-up (warm_up): any other would be compiled
    # in the middle of a step.
    context = np.ascontiguousarray(context, dtype=np.int64)
    corpus = context if corpus is None else np.ascontiguousarray(corpus, dtype=np.int64)
    args = (int(max_tokens), int(max_match), float(min_prob))
    if index is None:
        tokens, probs, match = _suffix_draft(context, corpus, *args)
    else:
        tokens, probs, match = _indexed_suffix_draft(context, corpus, index.searched(), *args)
    # (a view of the lookup's scratch: copied, so that a draft kept holds its tokens alone)
    return LookupDraft(tokens.copy(), tuple(probs.tolist()), match) if len(tokens) else NO_DRAFT


@dataclass(frozen=True)
class TokenIndex:
    """A corpus's positions sorted by the token they hold (ascending positions among equal
    tokens), separators left out: where a token occurs, in two binary searches rather than a
    scan of the corpus. Kept up to date as the corpus grows at its end and loses its start:
    - two parts, `base` and `recent` ((tokens, positions) each): an output is merged into the
      small recent part, which is merged into the base once it holds an eighth of it, so that
      adding an output costs about an eighth of a merge of the whole index (every position in
      the recent part is past every one in the base);
    - positions count from the corpus's first token ever: those below `offset` went with the
      oldest outputs and are skipped by every search, until they are a quarter of the index and
      a compaction drops them (dropping an output costs no pass)."""

    base: tuple[np.ndarray, np.ndarray]  # int64 tokens, sorted; int64 positions
    recent: tuple[np.ndarray, np.ndarray]
    offset: int = 0  # tokens dropped from the corpus's start so far
    dropped_since_compaction: int = 0  # (separators too: at least the dead entries)

    @staticmethod
    def empty() -> TokenIndex:
        nothing = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        return TokenIndex(nothing, nothing)

    def __len__(self) -> int:
        return len(self.base[0]) + len(self.recent[0])

    def appended(self, tokens: np.ndarray, at: int) -> TokenIndex:
        """The index with `tokens` added at corpus positions `at`, `at` + 1, ... (past every
        position indexed)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        recent = _index_appended(*self.recent, tokens, int(at) + self.offset)
        base = self.base
        if 8 * len(recent[0]) > len(base[0]):
            base, recent = _index_appended(*base, recent[0], 0, recent[1]), TokenIndex.empty().recent
        return TokenIndex(base, recent, self.offset, self.dropped_since_compaction)

    def dropped(self, cut: int) -> TokenIndex:
        """The index once the corpus's first `cut` tokens are gone."""
        offset, dead = self.offset + cut, self.dropped_since_compaction + cut
        if 4 * dead <= len(self):
            return TokenIndex(self.base, self.recent, offset, dead)
        kept = tuple(
            (tokens[positions >= offset], positions[positions >= offset])
            for tokens, positions in (self.base, self.recent)
        )
        return TokenIndex(*kept, offset, 0)

    def searched(self) -> tuple:
        """What `_indexed_occurrences` takes."""
        return (*self.base, *self.recent, self.offset)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, corpus positions) of the entries not dropped, by token, then position."""
        tokens, positions = (np.concatenate(pair) for pair in zip(self.base, self.recent))
        kept = positions >= self.offset
        order = np.lexsort((positions[kept], tokens[kept]))
        return tokens[kept][order], positions[kept][order] - self.offset


# Bounds on one lookup's work, whatever the context or history. A context of one repeated token
# has an occurrence of its last token at every position, and following all of them costs time
# that grows with the context, on every step of every request in the batch. Ordinary contexts
# have far fewer occurrences than these caps, so their drafts are unchanged; past them, the most
# recent occurrences are measured and the longest matches among those followed, which are the
# ones a draft's probabilities rest on.
MAX_OCCURRENCES_SCANNED = 4096  # the most recent occurrences of the last token whose match is measured
MAX_OCCURRENCES_FOLLOWED = 256  # of those, the longest matches (most recent among equals) followed
PLACE_BITS = 8  # a followed occurrence's place, in the low bits of its sort key
PLACE_MASK = (1 << PLACE_BITS) - 1
assert MAX_OCCURRENCES_FOLLOWED <= 1 << PLACE_BITS


# The scan back counts a block's occurrences first, in a loop the compiler vectorises (over a
# slice: indexing by a position that might be negative would keep it from that), and reads
# positions one by one only in the blocks that hold some, until it has read as many as it
# counted. A rare last token, whose scan runs to the start of a long context, then costs a
# fraction of a token-by-token scan.
SCAN_BLOCK = 128


@compiled
def _count_in(corpus, start, end, token):
    """How many of corpus[start:end] are `token`."""
    block, count = corpus[start:end], 0
    for i in range(block.shape[0]):
        if block[i] == token:
            count += 1
    return count


@compiled
def _recent_occurrences(corpus, limit, token, cap):
    """Positions before `limit` holding `token`, the most recent `cap` of them, in corpus order."""
    limit = min(limit, len(corpus))  # (compiled code reads past an array's end unchecked)
    found = np.empty(max(0, min(cap, limit)), dtype=np.int64)  # (filled from its end: corpus order)
    count, end = 0, limit
    while end > 0 and count < cap:
        start = max(0, end - SCAN_BLOCK)
        hits, position = _count_in(corpus, start, end, token), end - 1
        while hits and count < cap:
            if corpus[position] == token:
                count += 1
                found[len(found) - count] = position
                hits -= 1
            position -= 1
        end = start
    return found[len(found) - count :]


@compiled
def _longest_matches(ends, lengths, cap):
    """The `cap` occurrences with the longest matches (the most recent among equals), in corpus
    order. Counted by length rather than sorted: a context that repeats one token thousands of
    times has as many occurrences, every one matching at length, and this runs on its every step."""
    longest = 0
    for i in range(len(lengths)):
        longest = max(longest, lengths[i])
    at_length = np.zeros(longest + 1, dtype=np.int64)
    for i in range(len(lengths)):
        at_length[lengths[i]] += 1
    # Every occurrence longer than `shortest` is kept, and the most recent `of_shortest` at it.
    kept, shortest = 0, longest
    while shortest > 0 and kept + at_length[shortest] < cap:
        kept += at_length[shortest]
        shortest -= 1
    of_shortest, first, taken = cap - kept, len(lengths), 0
    for i in range(len(lengths) - 1, -1, -1):
        if lengths[i] == shortest:
            if taken == of_shortest:
                break
            taken += 1
            first = i
    chosen_ends, chosen_lengths, n = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), 0
    for i in range(len(lengths)):
        if lengths[i] > shortest or (lengths[i] == shortest and i >= first):
            chosen_ends[n], chosen_lengths[n] = ends[i], lengths[i]
            n += 1
    return chosen_ends[:n], chosen_lengths[:n]


@compiled
def _index_appended(tokens, positions, added, at, added_positions=None):
    """`TokenIndex.appended`: `added`'s tokens sorted (stable: ascending positions among equal
    tokens), separators left out, merged in after the equal tokens already indexed; at
    positions `at` + their index in `added`, or `added_positions` (ascending by token then)."""
    if added_positions is None:
        order = np.argsort(added, kind="mergesort")
    else:
        order = np.arange(len(added))
    kept = 0
    for j in range(len(order)):
        if added[order[j]] != SEPARATOR:
            order[kept] = order[j]
            kept += 1
    n = len(tokens)
    merged_tokens, merged_positions = np.empty(n + kept, np.int64), np.empty(n + kept, np.int64)
    i = j = 0
    for k in range(n + kept):
        if j == kept or (i < n and tokens[i] <= added[order[j]]):
            merged_tokens[k], merged_positions[k] = tokens[i], positions[i]
            i += 1
        else:
            where = at + order[j] if added_positions is None else added_positions[order[j]]
            merged_tokens[k], merged_positions[k] = added[order[j]], where
            j += 1
    return merged_tokens, merged_positions


@compiled
def _occurrences_in(tokens, positions, offset, limit, token):
    """The positions of `token` in one part of a `TokenIndex` not dropped and before `limit`
    (ascending)."""
    run = positions[np.searchsorted(tokens, token, side="left") : np.searchsorted(tokens, token, side="right")]
    first = np.searchsorted(run, offset, side="left")  # (those dropped skipped)
    return run[first : np.searchsorted(run, limit + offset, side="left")]


@compiled
def _indexed_occurrences(base_tokens, base_positions, recent_tokens, recent_positions, offset, limit, token, cap):
    """`_recent_occurrences` by a `TokenIndex`: the same positions, found by binary search."""
    recent = _occurrences_in(recent_tokens, recent_positions, offset, limit, token)
    if len(recent) >= cap:
        return recent[len(recent) - cap :] - offset
    base = _occurrences_in(base_tokens, base_positions, offset, limit, token)
    base = base[max(0, len(base) - (cap - len(recent))) :]
    return np.concatenate((base, recent)) - offset


# Every lookup runs on the step's critical path, for every row, over up to the whole history:
# compiled, a history lookup costs a fraction of what the same rule costs in numpy calls. The
# loops below are the rule in the module docstring, step by step.
@compiled
def _suffix_draft(context, corpus, max_tokens, max_match, min_prob):
    """(draft tokens, their probabilities, match length) of `suffix_draft`; `corpus` may be
    `context` itself."""
    n, limit = len(context), len(corpus) - 1  # (an occurrence needs a token after it)
    if n == 0 or limit <= 0 or max_tokens <= 0 or max_match <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), 0
    ends = _recent_occurrences(corpus, limit, context[n - 1], MAX_OCCURRENCES_SCANNED)
    return _follow_occurrences(ends, context, corpus, max_tokens, max_match, min_prob)


@compiled
def _indexed_suffix_draft(context, corpus, index, max_tokens, max_match, min_prob):
    """`_suffix_draft` with the occurrences of the last token found by the corpus's index
    (`index`: `TokenIndex.searched`)."""
    n, limit = len(context), len(corpus) - 1
    if n == 0 or limit <= 0 or max_tokens <= 0 or max_match <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), 0
    ends = _indexed_occurrences(*index, limit, context[n - 1], MAX_OCCURRENCES_SCANNED)
    return _follow_occurrences(ends, context, corpus, max_tokens, max_match, min_prob)


@compiled
def _sort_small(keys, n):
    """keys[:n] sorted in place: by insertion while few (up to MOST_SORTED), else numba's sort."""
    if n > MOST_SORTED:
        keys[:n].sort()
        return
    for i in range(1, n):
        key, j = keys[i], i - 1
        while j >= 0 and keys[j] > key:
            keys[j + 1] = keys[j]
            j -= 1
        keys[j + 1] = key


# Up to this many next tokens, the most frequent is found by sorting them (fast while few: the
# usual case); past it, by counting them in a small hash table (`_tally`), in time that grows
# with the tokens where a sort's grows faster: a token that repeats through its context (a list's
# separator, a table's border) has its continuations counted at every match length. Token ids
# chosen to collide in the table would make each count a long probe: past MOST_PROBES slots the
# count gives up and the tokens are sorted, so no input costs much more than the sort.
MOST_SORTED = 32
TALLY_SLOTS = 2 * MAX_OCCURRENCES_FOLLOWED  # a power of two, at least twice the tokens counted
MOST_PROBES = 8
assert TALLY_SLOTS & (TALLY_SLOTS - 1) == 0


@compiled
def _tally(keys, kept, tally):
    """`_most_frequent` by counting: each next token's count and latest place in an open-addressed
    table (`tally`: rows token, count, latest place, slots used; its token row -1 where free,
    and left so). (-1, -1) where a token's probe passed MOST_PROBES slots."""
    mask, used, overflowed = tally.shape[1] - 1, 0, False
    for r in range(kept):
        token, place = keys[r] >> PLACE_BITS, keys[r] & PLACE_MASK
        slot, probes = (token ^ (token >> 9)) & mask, 0
        while tally[0, slot] != -1 and tally[0, slot] != token:
            slot, probes = (slot + 1) & mask, probes + 1
        if probes > MOST_PROBES:
            overflowed = True
            break
        if tally[0, slot] == -1:
            tally[0, slot], tally[1, slot] = token, 0
            tally[3, used] = slot
            used += 1
        tally[1, slot] += 1
        tally[2, slot] = place  # (places rise with r: the latest)
    pick, pick_count, pick_last = -1, 0, -1
    for u in range(used):
        slot = tally[3, u]
        count, last = tally[1, slot], tally[2, slot]
        if count > pick_count or (count == pick_count and last > pick_last):
            pick, pick_count, pick_last = tally[0, slot], count, last
        tally[0, slot] = -1
    return (-1, -1) if overflowed else (pick, pick_count)


@compiled
def _most_frequent(keys, kept, tally):
    """(token, occurrences) of the most frequent next token in keys[:kept] (counted in `tally`
    if many, else or should the count give up, sorted in place); among equals, the one whose
    latest occurrence is the most recent (a run's last key is its latest occurrence)."""
    if kept > MOST_SORTED:
        pick, pick_count = _tally(keys, kept, tally)
        if pick_count >= 0:
            return pick, pick_count
    _sort_small(keys, kept)
    pick, pick_count, pick_last = -1, 0, -1
    run = 0
    for r in range(kept):
        run += 1
        if r + 1 == kept or keys[r + 1] >> PLACE_BITS != keys[r] >> PLACE_BITS:
            last = keys[r] & PLACE_MASK
            if run > pick_count or (run == pick_count and last > pick_last):
                pick, pick_count, pick_last = keys[r] >> PLACE_BITS, run, last
            run = 0
    return pick, pick_count


@compiled
def _follow(occurrences, following, steps, total, corpus, min_prob, keys, tally, tokens, probs):
    """Follow occurrences[:following] (corpus order) token by token, up to `steps` tokens, into
    `tokens` and `probs`: each the most frequent next token, while its share of `total` is at
    least `min_prob`; how many were taken. `occurrences`, `keys` and `tally` are scratch."""
    end = len(corpus)  # (continuations stop at the corpus's end)
    taken = 0
    for j in range(steps):
        # The occurrences' next tokens (none past the end or across a separator).
        kept = 0
        for i in range(following):
            if occurrences[i] + 1 + j < end and corpus[occurrences[i] + 1 + j] >= 0:
                keys[kept] = (corpus[occurrences[i] + 1 + j] << PLACE_BITS) | i
                kept += 1
        if kept == 0:
            break
        pick, pick_count = _most_frequent(keys, kept, tally)
        if pick_count / total < min_prob:
            break
        tokens[j], probs[j] = pick, pick_count / total
        taken = j + 1
        followed = 0
        for i in range(following):
            if occurrences[i] + 1 + j < end and corpus[occurrences[i] + 1 + j] == pick:
                occurrences[followed] = occurrences[i]
                followed += 1
        following = followed
    return taken


@compiled
def _follow_occurrences(ends, context, corpus, max_tokens, max_match, min_prob):
    """The draft from `ends`, the most recent occurrences of the context's last token, in
    corpus order (the rule's matching and following). Every row looks up every step: the
    following works in scratch made once a call, not in arrays made per token."""
    n = len(context)
    longest = min(max_match, n)
    if len(ends) == 0 or longest < 1 or max_tokens < 1:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), 0
    # Scratch, cut from one buffer of integers and one of floats (a typical row's lookup costs
    # less than the dozen allocations it would otherwise make): per occurrence scanned its match
    # length, and per one followed its position and its next token as a sort key, the token's
    # bits above its place among those followed (shifts: a division per key cost more than the
    # rest of the lookup), so that sorted keys group the occurrences by next token, the latest
    # last. The keys are distinct, so any sort orders them alike. (A token id must be below
    # 2**55 to fit: vocabularies are far smaller.) Then the occurrences by match length, the
    # draft followed and the best so far, and the `_tally` table if many are followed.
    scanned, steps_most = len(ends), min(max_tokens, longest)
    most_followed = min(scanned, MAX_OCCURRENCES_FOLLOWED)  # (past it, the longest matches only)
    tally_slots = TALLY_SLOTS if most_followed > MOST_SORTED else 1
    ints = np.empty(scanned + 2 * most_followed + longest + 1 + 2 * steps_most + 4 * tally_slots, dtype=np.int64)
    floats = np.empty(2 * steps_most)
    lengths, occurrences = ints[:scanned], ints[scanned : scanned + most_followed]
    keys = ints[scanned + most_followed : scanned + 2 * most_followed]
    cut = scanned + 2 * most_followed
    at_length, cut = ints[cut : cut + longest + 1], cut + longest + 1
    tokens, best_tokens = ints[cut : cut + steps_most], ints[cut + steps_most : cut + 2 * steps_most]
    tally = ints[cut + 2 * steps_most :].reshape((4, tally_slots))
    tally[0] = -1
    probs, best_probs = floats[:steps_most], floats[steps_most:]
    at_length[:] = 0
    for i in range(scanned):
        k = 1
        while k < longest and ends[i] - k >= 0 and corpus[ends[i] - k] == context[n - 1 - k]:
            k += 1
        lengths[i] = k
    if scanned > MAX_OCCURRENCES_FOLLOWED:
        ends, lengths = _longest_matches(ends, lengths, MAX_OCCURRENCES_FOLLOWED)
    counted = len(ends)
    occurrences, keys = occurrences[:counted], keys[:counted]
    for i in range(counted):
        at_length[lengths[i]] += 1  # (occurrences by match length)
    best_taken, best_match, best_score = 0, 0, 0.0
    # The occurrences change only at the distinct lengths, and the longest m of a run allows the
    # longest draft with the same probabilities, so only those m are tried. Longest first, so
    # that a tie goes to the longer match, and so that a shorter match is skipped when even
    # every token at its highest probability could not beat the best draft so far: its
    # occurrences are more (they include the longer matches'), each following costs more, and
    # its drafts are shorter. (Rounding only ever rises with its terms, so the bound's sum is
    # at least the draft's, to the last bit.)
    matching = 0
    for m in range(longest, 0, -1):
        matching += at_length[m]  # (the occurrences matching at least m tokens)
        if at_length[m] == 0:
            continue
        steps = min(max_tokens, m)
        highest, bound = matching / (matching + 1), 0.0
        for _ in range(steps):
            bound += highest
        if bound <= best_score:
            continue
        followed = 0
        for i in range(counted):
            if lengths[i] >= m:
                occurrences[followed] = ends[i]
                followed += 1
        total = followed + 1  # the current occurrence counts: it has no continuation yet
        taken = _follow(occurrences, followed, steps, total, corpus, min_prob, keys, tally, tokens, probs)
        if taken:
            score = 0.0
            for j in range(taken):
                score += probs[j]
            if score > best_score:
                best_tokens[:taken], best_probs[:taken] = tokens[:taken], probs[:taken]
                best_taken, best_match, best_score = taken, m, score
    return best_tokens[:best_taken], best_probs[:best_taken], best_match


@compiled
def _draft_sum(probs):
    """A draft's score, as `LookupDraft.score` sums it: its probabilities in order."""
    total = 0.0
    for p in probs:
        total += p
    return total


@compiled
def _own_or_pool_draft(context, pool, pool_index, pooled, max_tokens, max_match, min_prob):
    """`lookup_draft`'s choice: (tokens, probabilities, match, whether from the pool) of the
    context's own draft, or of the `pool`'s (`OutputHistory.tokens`, its index searched) where
    that scores higher."""
    tokens, probs, found = _suffix_draft(context, context, max_tokens, max_match, min_prob)
    if pooled:
        in_pool, pool_probs, pool_found = _indexed_suffix_draft(
            context, pool, pool_index, max_tokens, max_match, min_prob
        )
        if _draft_sum(pool_probs) > _draft_sum(probs):
            return in_pool, pool_probs, pool_found, True
    return tokens, probs, found, False


@compiled
def _context_drafts(
    token_ids, rows, context_lengths, budgets, full_budgets, max_match, min_prob, at,
    tokens, probs, lengths, match, sources, has_probs, source, pool, pool_index, pooled, pool_source,
):  # fmt: skip
    """`lookup_draft` of each row's own context, and of one `pool` of earlier outputs if
    `pooled` (the rows' tenant's): per row, its row of `token_ids` (`rows`), its context's
    length, its budget and its full budget; a draft that copies (its match is `max_match` long)
    is looked up again with the full budget. Each draft is written over the draft at `at[r]` of
    `tokens`, `probs`, `lengths`, `match`, `sources`, `has_probs` (a step's drafts,
    `step_drafts.StepDrafts`) where it matches more, or there is none; past a draft, zeros up to
    the largest full budget. Every index is checked before anything is read or written: the
    kernel reads vLLM's arrays in place."""
    n_rows, drafts = len(rows), len(lengths)
    if not (len(context_lengths) == len(budgets) == len(full_budgets) == len(at) == n_rows):
        raise IndexError("the rows' inputs differ in length")
    if not (tokens.shape == probs.shape and tokens.shape[0] == len(match) == len(sources) == len(has_probs) == drafts):
        raise IndexError("the step's drafts' arrays differ in shape")
    width = 1
    for r in range(n_rows):
        width = max(width, full_budgets[r])
    for r in range(n_rows):
        if not 0 <= at[r] < drafts or width > tokens.shape[1] or not 0 <= rows[r] < token_ids.shape[0]:
            raise IndexError("a draft row outside the step's drafts, or a row outside the batch")
        if budgets[r] > width:
            raise IndexError("a budget past the drafts' width")
    args = (pool, pool_index, pooled)
    for r in range(n_rows):
        row, length, budget, full_budget = rows[r], context_lengths[r], budgets[r], full_budgets[r]
        context = token_ids[row, : max(0, min(length, token_ids.shape[1]))]
        drafted, shares, found, from_pool = _own_or_pool_draft(context, *args, budget, max_match, min_prob)
        if budget < full_budget and found >= max_match:
            drafted, shares, found, from_pool = _own_or_pool_draft(context, *args, full_budget, max_match, min_prob)
        n, i = len(drafted), at[r]
        if n == 0 or (lengths[i] != 0 and found <= match[i]):
            continue
        tokens[i, :n], probs[i, :n] = drafted, shares
        tokens[i, n:width], probs[i, n:width] = 0, 0.0
        lengths[i], match[i], has_probs[i] = n, found, True
        sources[i] = pool_source if from_pool else source


# (no copy of what is one already; contiguous, the layout the kernel is compiled for at start)
_as_ints = functools.partial(np.ascontiguousarray, dtype=np.int64)

# `_context_drafts`' pool arguments where the rows have none (one signature with and without)
WITHOUT_POOL = (np.full(1, SEPARATOR, dtype=np.int64), TokenIndex.empty().searched(), False)


class ContextDrafts(NamedTuple):
    """Drafts of many rows at once (`context_drafts`), a row each: its tokens and their
    probabilities (0 past its draft), its length, its match length and its source."""

    tokens: np.ndarray  # int64, rows x the largest budget
    probs: np.ndarray  # float64
    lengths: np.ndarray  # int64
    match: np.ndarray  # int64
    sources: np.ndarray  # int64: `source` or `pool_source`


def context_drafts(
    token_ids: np.ndarray,
    rows: np.ndarray | list[int],
    lengths: np.ndarray | list[int],
    budgets: np.ndarray | list[int],
    *,
    full_budgets: np.ndarray | list[int] | None = None,
    max_match: int = 24,
    min_prob: float = 0.1,
    into=None,
    at: np.ndarray | None = None,
    source: int = 0,
    pool: OutputHistory | None = None,
    pool_source: int = 0,
) -> ContextDrafts | None:
    """`suffix_draft(token_ids[row, :length], budget)` of many rows at once, or with `pool`
    `lookup_draft`'s (the batch's token ids as vLLM keeps them, read in place), in one compiled
    call: a call's own cost is most of a lookup's. A draft that copies (it matches `max_match`
    tokens) is looked up again for the row's `full_budgets` (default: its budget). `into`: a
    step's drafts (`step_drafts.StepDrafts`), each row's written over the draft at `at[r]` where
    it matches more or there is none, from `source` (an index into `acceptance.SOURCES`); else
    returned.
    `pool`: the rows' tenant's earlier outputs, whose draft each row takes where it scores higher
    than its own context's (`lookup_draft`), from `pool_source`."""
    rows, lengths, budgets = _as_ints(rows), _as_ints(lengths), _as_ints(budgets)
    full_budgets = budgets if full_budgets is None else _as_ints(full_budgets)
    returned = into is None
    if returned:  # (drafts of their own, a row each)
        n, width = len(rows), max(int(full_budgets.max(initial=0)), 1)
        into = SimpleNamespace(
            tokens=np.zeros((n, width), dtype=np.int64),
            probs=np.zeros((n, width)),
            lengths=np.zeros(n, dtype=np.int64),
            match=np.zeros(n, dtype=np.int64),
            sources=np.zeros(n, dtype=np.int64),
            has_probs=np.zeros(n, dtype=bool),
        )
        at = np.arange(n)
    _context_drafts(
        token_ids, rows, lengths, budgets, full_budgets, int(max_match), float(min_prob), _as_ints(at),
        into.tokens, into.probs, into.lengths, into.match, into.sources, into.has_probs, int(source),
        *((pool.tokens, pool.index.searched(), True) if pool is not None else WITHOUT_POOL), int(pool_source),
    )  # fmt: skip
    if not returned:
        return None
    return ContextDrafts(into.tokens, into.probs, into.lengths, into.match, into.sources)


def warm_up() -> None:
    """Compile the lookup (or load it from numba's cache): seconds the first time on a machine,
    which belong to the engine's start, not to its first request's step."""
    suffix_draft(np.zeros(2, dtype=np.int64), 1)
    history = OutputHistory(8)
    history.add(np.zeros(2, dtype=np.int64))
    for dtype in (np.int32, np.int64):  # (vLLM's token ids are int32; int64 where a caller's are)
        context_drafts(np.zeros((1, 2), dtype=dtype), [0], [2], [1])
        context_drafts(np.zeros((1, 2), dtype=dtype), [0], [2], [1], pool=history)
    history.draft(np.zeros(2, dtype=np.int64), 1, 2)


class OutputHistory:
    """Earlier requests' outputs, for drafts that the row's own context does not offer.

    One token array, outputs separated by SEPARATOR, the oldest outputs dropped beyond
    `max_tokens`; drafts come from `suffix_draft` over it, so frequent continuations win. Each
    output owns the separator before it; their sizes are kept, so that dropping the oldest
    outputs costs one slice however many go, never a scan of the history. Its `TokenIndex` is
    kept beside it, so that every row's lookup in every step finds the occurrences of its last
    token without a scan of the history (each output added costs a merge instead).
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = np.full(1, SEPARATOR, dtype=np.int64)
        self.index = TokenIndex.empty()
        self._sizes: deque[int] = deque()  # per output, oldest first: its tokens and its separator

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, output: np.ndarray) -> None:
        output = np.asarray(output, dtype=np.int64)
        index = self.index.appended(output, len(self.tokens))
        tokens = np.concatenate([self.tokens, output, [SEPARATOR]])
        self.index, self.tokens = index, tokens  # (both or neither, should either raise)
        self._sizes.append(len(output) + 1)
        self.drop(len(self.tokens) - self.max_tokens)

    def draft(self, context: np.ndarray, max_tokens: int, max_match: int) -> LookupDraft:
        return suffix_draft(context, max_tokens, self.tokens, max_match, index=self.index)

    def drop(self, tokens: int) -> int:
        """Drop the oldest whole outputs until at least `tokens` token ids are gone, or none is
        left (just the leading separator); how many went."""
        cut = 0
        while cut < tokens and self._sizes:
            cut += self._sizes.popleft()
        if cut:
            self.tokens = self.tokens[cut:]
            self.index = self.index.dropped(cut)
        return cut


# A request whose tenant is not known: it neither drafts from any pool nor adds to one (fail
# closed: an unknown tenant is nobody's, not the shared pool's).
UNKNOWN_TENANT = object()
_NO_POOL = object()  # a tenant whose requests get no pool: unknown, or unsalted where sharing is off


class TenantHistories:
    """Earlier outputs, one pool per tenant: a request drafts only from the outputs of requests
    with its own `cache_salt`. A request without one (tenant None) gets no pool unless
    `share_unsalted` (then every unsalted request shares one, as they share vLLM's prefix
    cache); UNKNOWN_TENANT never gets one. Salts are kept as fixed-size digests, so a long salt
    costs no more than a short one.

    Bounded twice: all pools together hold at most `max_tokens` token ids (8 bytes each,
    separators included, and about 22 more each for their index), and at most `max_tenants`
    pools exist. When either bound is passed, room is made in a segmented least-recently-used
    order (SLRU, the usual defence of a cache against one-off scans): first the newcomers'
    pools (tenants with one output so far), then the returning tenants' (two or more). A flood
    of one-shot salts therefore only churns the newcomers, and a tenant that keeps coming back
    keeps its history. Returning tenants hold at most `RETURNING_SHARE` of the pools, so that a
    newcomer can still come back and stay. Adding costs a copy of the tenant's own pool and a
    merge into its index."""

    RETURNING_SHARE = 0.75

    def __init__(self, max_tokens: int, max_tenants: int = 256, share_unsalted: bool = False):
        self.max_tokens = max_tokens
        self.max_tenants = max(1, max_tenants)
        self.share_unsalted = share_unsalted
        # Least recently added to first, in each segment.
        self.newcomers: OrderedDict[bytes | None, OutputHistory] = OrderedDict()
        self.returning: OrderedDict[bytes | None, OutputHistory] = OrderedDict()
        self._total = 0  # len() of every pool together

    def __len__(self) -> int:
        return self._total

    @property
    def tenants(self) -> int:
        return len(self.newcomers) + len(self.returning)

    def key(self, tenant):
        """The pool's key for a tenant: the digest of its salt (bytes, as the scheduler's note
        carries it: `scheduler_note.SchedulerNote`; a salt given as a string is digested here),
        None for the shared unsalted pool, or `_NO_POOL`."""
        if tenant is not UNKNOWN_TENANT and not isinstance(tenant, bytes):
            tenant = salt_digest(tenant)  # a salt given as a string ("" is no salt, as in vLLM)
        if tenant is UNKNOWN_TENANT or (tenant is None and not self.share_unsalted):
            return _NO_POOL
        return tenant

    def pool(self, tenant) -> OutputHistory | None:
        key = self.key(tenant)
        if key is _NO_POOL:
            return None
        found = self.returning.get(key)
        return found if found is not None else self.newcomers.get(key)

    def add(self, tenant, output) -> None:
        """An output (token ids) for the tenant's pool, if it has one."""
        key = self.key(tenant)
        if key is _NO_POOL:
            return
        pool = self.returning.pop(key, None)
        if pool is None:
            pool = self.newcomers.pop(key, None)
        counted = 0 if pool is None else len(pool)  # a new pool is not in the total yet
        segment = self.newcomers if pool is None else self.returning
        if pool is None:
            pool = OutputHistory(self.max_tokens)
        segment[key] = pool  # the most recently used last
        pool.add(output)
        self._total += len(pool) - counted
        while len(self.returning) > max(1, int(self.RETURNING_SHARE * self.max_tenants)):
            demoted, demoted_pool = self.returning.popitem(last=False)
            self.newcomers[demoted] = demoted_pool  # the most recent newcomer: it may come back
        while self.tenants > self.max_tenants:
            victim = self._victim(key)
            self._drop_tokens(victim, self._total)  # all of its outputs: the pool goes
        while self._total > self.max_tokens and self.tenants:
            self._drop_tokens(self._victim(key), self._total - self.max_tokens)

    def forget(self, tenant) -> None:
        """Drop one tenant's pool."""
        key = self.key(tenant)
        for segment in (self.newcomers, self.returning):
            if key is not _NO_POOL and key in segment:
                self._total -= len(segment.pop(key))

    def clear(self) -> None:
        """Forget every output (vLLM reset its prefix cache, or went to sleep)."""
        self.newcomers.clear()
        self.returning.clear()
        self._total = 0

    def _victim(self, spared):
        """The key of the pool to take room from: the least recently used other newcomer; else
        `spared` (the pool just added to) if it is a newcomer, so that one newcomer's long
        output cannot push out the returning tenants; else the least recently used other
        returning tenant; else `spared`."""
        for key in itertools.islice(self.newcomers, 2):
            if key != spared:
                return key
        if spared in self.newcomers:
            return spared
        for key in itertools.islice(self.returning, 2):
            if key != spared:
                return key
        return spared

    def _drop_tokens(self, key, tokens: int) -> None:
        """Drop the oldest whole outputs of `key`'s pool until `tokens` token ids are gone; a
        pool left with no output goes, separator and all."""
        segment = self.newcomers if key in self.newcomers else self.returning
        pool = segment[key]
        self._total -= pool.drop(tokens)
        if len(pool) <= 1:
            self._total -= len(pool)
            del segment[key]


def lookup_draft(
    context: np.ndarray, max_tokens: int, max_match: int, history: OutputHistory | None
) -> tuple[DraftSource, LookupDraft]:
    """The better of the context's own draft and the history's, by score (own on ties), with
    its source."""
    own = suffix_draft(context, max_tokens, max_match=max_match)
    if history is not None:
        earlier = history.draft(context, max_tokens, max_match)
        if earlier.score > own.score:
            return DraftSource.HISTORY, earlier
    return DraftSource.LOOKUP, own
