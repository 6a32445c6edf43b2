# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The lookup's bounds on its own work, whatever the context: pure functions, no engine."""

import numpy as np

from vllm_selfspec.sources.lookup import (
    MAX_OCCURRENCES_FOLLOWED,
    MAX_OCCURRENCES_SCANNED,
    SCAN_BLOCK,
    _longest_matches,
    _recent_occurrences,
    suffix_draft,
)

# What benchmarks/NOTES.md (entry 27) measured: hostile contexts at 0.12-0.33 ms per lookup,
# against 11 ms per row at 4k tokens and 108 ms at 32k unbounded. Larger caps make every row of
# every step pay more; raising them needs a new measurement (benchmarks.diagnostics.lookup_bound).
MEASURED_SCANNED = 4096
MEASURED_FOLLOWED = 256

FAR = [1, 2, 3, 4, 5, 6, 7]  # the far occurrence of the context's tail, matched in full
FAR_NEXT = [50, 51, 52, 53]  # what followed it


def far_match_context(recent: int) -> np.ndarray:
    """The tail FAR once at the start, followed by FAR_NEXT, then `recent` later occurrences of
    its last token that match it by that token only (each preceded by 0, followed by 0), then
    the tail again: the far occurrence is the (recent + 1)-th most recent."""
    return np.array(FAR + FAR_NEXT + [0, FAR[-1]] * recent + FAR, dtype=np.int64)


def test_a_match_beyond_the_scanned_occurrences_is_not_followed():
    """Only the MAX_OCCURRENCES_SCANNED most recent occurrences of the last token are measured:
    a long match just inside them wins the draft (one earlier occurrence: 1/2 a token over four
    tokens beats one token at ~1 from the short matches), the same match one occurrence further
    back is not seen at all, and the draft follows the recent short matches."""
    within = suffix_draft(far_match_context(MAX_OCCURRENCES_SCANNED - 1), max_tokens=len(FAR_NEXT))
    assert (within.tokens.tolist(), within.probs, within.match) == (FAR_NEXT, (0.5,) * len(FAR_NEXT), len(FAR))
    beyond = suffix_draft(far_match_context(MAX_OCCURRENCES_SCANNED), max_tokens=len(FAR_NEXT))
    assert (beyond.tokens.tolist(), beyond.match) == ([0], 1)
    # What the short matches give: the most recent MAX_OCCURRENCES_FOLLOWED of them, all but the
    # last (followed by the tail) continuing with 0.
    assert beyond.probs == ((MAX_OCCURRENCES_FOLLOWED - 1) / (MAX_OCCURRENCES_FOLLOWED + 1),)


def test_the_followed_occurrences_are_the_longest_matches_not_the_most_recent():
    """Past MAX_OCCURRENCES_FOLLOWED occurrences, the ones followed are those with the longest
    matches: the far match, older than every short one, is still followed."""
    draft = suffix_draft(far_match_context(MAX_OCCURRENCES_FOLLOWED), max_tokens=len(FAR_NEXT))
    assert (draft.tokens.tolist(), draft.match) == (FAR_NEXT, len(FAR))


def test_the_longest_matches_are_chosen_as_a_sort_would_choose_them():
    """`_longest_matches` counts the occurrences by match length instead of sorting them: the
    same `cap` occurrences as a sort by length, the most recent first among equals, in corpus
    order, whether few lengths tie at the cut or every occurrence has the same length."""
    rng = np.random.default_rng(5)
    for case in range(2000):
        n = int(rng.integers(2, 600))
        cap = int(rng.integers(1, n))
        ends = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int64)
        lengths = rng.integers(1, int(rng.integers(2, 30)), n).astype(np.int64)
        if case % 4 == 0:
            lengths[:] = lengths[0]  # (one repeated token: every match as long)
        by_sort = sorted(range(n), key=lambda i: (-lengths[i], -i))[:cap]
        want = sorted(by_sort)
        got_ends, got_lengths = _longest_matches(ends, lengths, cap)
        assert got_ends.tolist() == ends[want].tolist() and got_lengths.tolist() == lengths[want].tolist()


def test_recent_occurrences_scans_back_only_as_far_as_the_cap():
    """A context of one repeated token holds an occurrence at every position: the scan returns
    the cap's most recent ones, in corpus order, and no more however long the context."""
    corpus = np.full(200_000, 7, dtype=np.int64)
    limit = len(corpus) - 1
    found = _recent_occurrences(corpus, limit, 7, MAX_OCCURRENCES_SCANNED)
    assert found.tolist() == list(range(limit - MAX_OCCURRENCES_SCANNED, limit))
    assert _recent_occurrences(corpus, 10, 7, MAX_OCCURRENCES_SCANNED).tolist() == list(range(10))


def test_recent_occurrences_are_every_occurrence_before_the_limit_newest_kept():
    """The scan, block by block, against the rule it implements: the positions before `limit`
    holding the token, the `cap` most recent of them. Rare and common tokens, limits inside
    and across blocks, both of vLLM's token dtypes."""
    rng = np.random.default_rng(0)
    for case in range(400):
        length = int(rng.integers(1, 2000))
        corpus = rng.integers(0, int(rng.choice([2, 7, 50, 5000])), length).astype(rng.choice([np.int32, np.int64]))
        limit, token, cap = int(rng.integers(1, length + 1)), int(rng.choice(corpus)), int(rng.integers(1, 300))
        want = np.flatnonzero(corpus[:limit] == token)[-cap:]
        assert _recent_occurrences(corpus, limit, token, cap).tolist() == want.tolist(), case
    # The token alone at the blocks' edges, every limit and cap about them, and limits past the end.
    edges = [0, 1, SCAN_BLOCK - 1, SCAN_BLOCK, 2 * SCAN_BLOCK - 1, 2 * SCAN_BLOCK]
    for dtype in (np.int32, np.int64):
        # (a view of a longer array that holds the token past the view's end, where a scan that
        # read past it would find it)
        corpus = np.full(3 * SCAN_BLOCK, 9, dtype=dtype)[: 2 * SCAN_BLOCK + 2]
        corpus[:] = 0
        corpus[edges] = 9
        for limit in range(0, len(corpus) + 3):  # (past the end: read as the end)
            for cap in range(0, len(edges) + 1):
                found = np.flatnonzero(corpus[:limit] == 9)
                want = found[len(found) - min(cap, len(found)) :]
                got = _recent_occurrences(corpus, limit, dtype(9), cap)
                assert got.tolist() == want.tolist(), (dtype, limit, cap)


def test_the_lookup_caps_stay_within_what_was_measured():
    """The caps are what keeps a hostile context's lookup a fraction of a millisecond per row;
    the draft tests above hold for any caps, so this is what fails if they are raised."""
    assert MAX_OCCURRENCES_SCANNED <= MEASURED_SCANNED
    assert MAX_OCCURRENCES_FOLLOWED <= MEASURED_FOLLOWED
    assert MAX_OCCURRENCES_FOLLOWED <= MAX_OCCURRENCES_SCANNED
