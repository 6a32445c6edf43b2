# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The draft controller and lookup drafts: pure functions, no engine."""

import dataclasses
import math

import numpy as np
import pytest

from vllm_selfspec.control import AcceptanceRate, DraftController, DraftSource, RowOffer, StepOffers
from vllm_selfspec.control.acceptance import SOURCE_INDEX, AcceptanceModel, Calibration, token_bins
from vllm_selfspec.sources.lookup import (
    NO_DRAFT,
    SEPARATOR,
    LookupDraft,
    OutputHistory,
    context_drafts,
    lookup_draft,
    suffix_draft,
)

from reference import numpy_suffix_draft


def test_lookup_follows_the_most_frequent_continuation():
    # "5 6 7" went on with "8 9" twice and, most recently, with "30".
    context = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 8, 9, 2, 5, 6, 7, 30, 3, 5, 6, 7])
    draft = suffix_draft(context, max_tokens=4)
    # Three earlier occurrences and the current one: 8 has 2 of 4; after "8 9" the two
    # occurrences part (1, 2), and the more recent one is followed.
    assert (draft.tokens.tolist(), draft.probs, draft.match) == ([8, 9, 2], (0.5, 0.5, 0.25), 3)
    assert suffix_draft(context, max_tokens=2).tokens.tolist() == [8, 9]


def test_lookup_prefers_a_long_match_and_drafts_no_longer_than_it():
    # The tail "1 2 3 4" occurred once, followed by 5; "4" alone is mostly followed by 7.
    context = np.array([1, 2, 3, 4, 5, 4, 7, 4, 7, 4, 7, 1, 2, 3, 4])
    draft = suffix_draft(context, max_tokens=4)
    assert (draft.tokens.tolist(), draft.match) == ([5, 4, 7, 4], 4)
    # With only a one-token match, one token at most.
    assert suffix_draft(np.array([1, 2, 3, 4, 9, 4]), max_tokens=4).tokens.tolist() == [9]
    assert suffix_draft(context, max_tokens=4, max_match=1).tokens.tolist() == [7]


def test_lookup_offers_nothing_without_a_confident_match():
    assert len(suffix_draft(np.array([1, 2, 3, 4]), 3)) == 0
    assert len(suffix_draft(np.array([5]), 3)) == 0
    assert len(suffix_draft(np.array([], dtype=np.int64), 3)) == 0
    # "0" was followed by twelve different tokens: none reaches a probability of 0.1.
    scattered = np.array([x for k in range(1, 13) for x in (0, k)] + [0])
    assert len(suffix_draft(scattered, 3)) == 0
    assert suffix_draft(scattered, 3, min_prob=0.05).probs == (1 / 13,)
    # The continuation may run up to the context's end, never past it.
    assert suffix_draft(np.array([1, 2, 1, 2]), 5).tokens.tolist() == [1, 2]


def test_the_compiled_lookup_drafts_what_the_rule_in_numpy_drafts():
    """Small vocabularies make long matches, ties and separators common: every branch of the rule."""
    rng = np.random.default_rng(0)
    drafts = long_matches = 0
    for _ in range(1500):
        corpus = rng.integers(0, rng.integers(2, 8), rng.integers(0, 60))
        corpus[rng.random(len(corpus)) < 0.05] = SEPARATOR
        # As vLLM holds them: int32 rows of a wider array.
        length = int(rng.integers(0, 40))
        rows = np.zeros((2, 40), dtype=np.int32)
        rows[0, :length] = rng.integers(0, 5, length)
        if rng.random() < 0.5:  # a repeated phrase with typos: long matches
            phrase = rng.integers(0, 5, rng.integers(1, 6))
            rows[0, :length] = np.where(rng.random(length) < 0.1, rows[0, :length], np.resize(phrase, length))
            corpus = np.where(rng.random(len(corpus)) < 0.8, np.resize(phrase, len(corpus)), corpus)
        context = rows[0, :length]
        k, match = int(rng.integers(-1, 6)), int(rng.integers(-1, 30))
        floor = float(rng.choice([0.0, 0.1, 0.3]))
        for source in (None, corpus):
            got = suffix_draft(context, k, source, match, floor)
            want = numpy_suffix_draft(context.astype(np.int64), k, source, match, floor)
            assert (got.tokens.tolist(), got.probs, got.match) == (want.tokens.tolist(), want.probs, want.match)
            drafts += len(got) > 0
            long_matches += got.match >= 8
    assert drafts > 1000 and long_matches > 20  # mostly drafts compared, some of long matches


def test_the_compiled_lookup_follows_many_occurrences_as_the_rule_in_numpy_does():
    """Contexts and corpora where the last token occurs 33 to 256 times (up to the followed
    cap, which the numpy rule does not apply): the compiled lookup counts their continuations
    past 32 of them (`lookup._tally`), and packs each occurrence's place into its key's low bits."""
    from vllm_selfspec.sources.lookup import MAX_OCCURRENCES_FOLLOWED

    rng = np.random.default_rng(3)
    many = drafts = 0
    for _ in range(120):
        # A frequent token (1) between others, mostly followed by the same one (2): short
        # matches, so the draft of one matching token, over every occurrence, is the best.
        def text(length: int) -> np.ndarray:
            tokens = rng.integers(3, 1000, length)
            tokens[1::3] = 1
            tokens[2::3] = np.where(rng.random(len(tokens[2::3])) < 0.7, 2, tokens[2::3])
            return tokens

        context = np.append(text(int(rng.integers(100, 700))), 1).astype(np.int32)
        corpus = text(int(rng.integers(100, 700)))
        corpus[rng.random(len(corpus)) < 0.02] = SEPARATOR
        for source in (None, corpus):
            searched = context[:-1] if source is None else source[:-1]
            occurrences = int((searched == context[-1]).sum())
            if not 32 < occurrences <= MAX_OCCURRENCES_FOLLOWED:
                continue
            got = suffix_draft(context, 8, source, 24, 0.05)
            want = numpy_suffix_draft(context.astype(np.int64), 8, source, 24, 0.05)
            assert (got.tokens.tolist(), got.probs, got.match) == (want.tokens.tolist(), want.probs, want.match)
            many += 1
            drafts += len(got) > 0
    assert many > 100 and drafts > 50, (many, drafts)


def test_the_counted_most_frequent_continuation_breaks_ties_as_the_rule_in_numpy_does():
    """Past 32 occurrences followed, the compiled lookup counts their next tokens in a table
    (`lookup._tally`) instead of sorting them. Here every occurrence of the last token matches
    one token alone (a distinct token before each), so the draft is that token's most frequent
    continuation: two continuations in equal numbers tie, and the one that occurred last wins."""
    from vllm_selfspec.sources.lookup import MOST_SORTED

    rng = np.random.default_rng(11)
    for case in range(200):
        half = int(rng.integers(MOST_SORTED // 2 + 1, 100))
        followers = rng.permutation([2] * half + [3] * (half + (case % 3 == 0)))  # (a third without a tie)
        before = rng.permutation(np.arange(1000, 1000 + len(followers) + 1))  # (distinct: each match is 1 token)
        triples = np.stack([before[:-1], np.ones_like(followers), followers], axis=1)
        context = np.append(triples.ravel(), [before[-1], 1])
        got = suffix_draft(context, 8, None, 24, 0.0)
        want = numpy_suffix_draft(context.astype(np.int64), 8, None, 24, 0.0)
        assert (got.tokens.tolist(), got.probs, got.match) == (want.tokens.tolist(), want.probs, want.match)
        winner = followers[-1] if case % 3 else 3
        assert (got.tokens.tolist(), got.match) == ([winner], 1)


def test_continuations_whose_ids_collide_in_the_count_are_sorted_instead():
    """Token ids chosen so that every one lands in the same slot of `lookup._tally`'s table (and
    token 0 among them): the count gives up past MOST_PROBES slots and the continuations are
    sorted, the same draft as the numpy rule's; ids that collide a little are counted."""
    from vllm_selfspec.sources.lookup import MOST_PROBES, MOST_SORTED, TALLY_SLOTS

    def colliding(n: int, slot: int) -> np.ndarray:
        """n ids that `_tally` hashes to `slot`: (t ^ (t >> 9)) & mask is (h ^ slot) ^ h."""
        return np.array([TALLY_SLOTS * h + (h ^ slot) for h in range(n)], dtype=np.int64)

    rng = np.random.default_rng(12)
    for case in range(60):
        many = case % 2 == 0  # (past MOST_PROBES in one chain, or a few collisions only)
        ids = colliding(MOST_SORTED + 10 if many else MOST_PROBES // 2, slot=int(rng.integers(0, 4)))
        ids = np.append(ids, 0)  # (token 0: a token, not a free slot)
        followers = rng.choice(ids, int(rng.integers(MOST_SORTED + 1, 200)))
        before = rng.permutation(np.arange(10**6, 10**6 + len(followers) + 1))  # (each match: 1 token)
        triples = np.stack([before[:-1], np.full_like(followers, 7), followers], axis=1)
        context = np.append(triples.ravel(), [before[-1], 7])
        got = suffix_draft(context, 8, None, 24, 0.0)
        want = numpy_suffix_draft(context.astype(np.int64), 8, None, 24, 0.0)
        assert (got.tokens.tolist(), got.probs, got.match) == (want.tokens.tolist(), want.probs, want.match)
        assert got.match == 1 and len(got) == 1


def test_a_batchs_own_context_drafts_at_once_are_each_rows_lookup():
    """`context_drafts` reads the rows in place, as vLLM holds them, and looks up again, for
    the full budget, a capped draft that copies (`row_lookup.budgeted_lookup_draft`'s rule)."""
    rng = np.random.default_rng(1)
    copies = 0
    for _ in range(300):
        batch, width = int(rng.integers(1, 9)), int(rng.integers(4, 300))
        token_ids = rng.integers(0, rng.integers(2, 40), (batch + 2, width)).astype(rng.choice([np.int32, np.int64]))
        rows = rng.choice(batch + 2, batch, replace=False).tolist()
        lengths = rng.integers(0, width + 1, batch).tolist()
        full = rng.integers(0, 12, batch)
        capped, match = np.minimum(full, rng.integers(0, 12, batch)).tolist(), int(rng.integers(1, 8))
        got = context_drafts(token_ids, rows, lengths, capped, full_budgets=full.tolist(), max_match=match)
        for r, (row, length, budget, whole) in enumerate(zip(rows, lengths, capped, full.tolist())):
            n = int(got.lengths[r])
            draft = (
                LookupDraft(got.tokens[r, :n], tuple(got.probs[r, :n].tolist()), int(got.match[r])) if n else NO_DRAFT
            )
            want = suffix_draft(token_ids[row, :length], budget, max_match=match)
            if budget < whole and want.match >= match:
                want, copies = suffix_draft(token_ids[row, :length], whole, max_match=match), copies + 1
            assert (draft.tokens.tolist(), draft.probs, draft.match) == (want.tokens.tolist(), want.probs, want.match)
    assert copies > 50
    with pytest.raises(IndexError):  # (the kernel reads in place: a row outside the batch must not be read)
        context_drafts(np.zeros((2, 4), dtype=np.int32), [2], [4], [1])
    with pytest.raises(IndexError):  # (nor a row's inputs past the shortest of them)
        context_drafts(np.zeros((2, 4), dtype=np.int32), [0, 1], [4], [1, 1])
    from types import SimpleNamespace

    from vllm_selfspec.sources.step_drafts import StepDrafts

    short = SimpleNamespace(**{**vars(StepDrafts.empty(2, 4)), "probs": np.ones((1, 4))})
    with pytest.raises(IndexError):  # (nor drafts' arrays shorter than the rows they are written at)
        context_drafts(np.zeros((2, 4), dtype=np.int32), [0, 1], [4, 4], [1, 1], into=short, at=np.array([0, 1]))


def test_a_batchs_drafts_with_its_tenants_history_at_once_are_each_rows_lookup_draft():
    """`context_drafts` with a history: each row's draft is `lookup_draft`'s, the better of its
    own context's and the history's, source included, with `row_lookup.budgeted_lookup_draft`'s second lookup
    of a copy; over histories whose index has dropped and merged outputs."""
    from vllm_selfspec.sources.step_drafts import StepDrafts

    rng = np.random.default_rng(2)
    chosen = {DraftSource.LOOKUP: 0, DraftSource.HISTORY: 0}
    copies = 0
    for _ in range(200):
        vocabulary = int(rng.integers(2, 30))
        history = OutputHistory(max_tokens=int(rng.integers(8, 400)))
        for _ in range(int(rng.integers(1, 12))):
            history.add(rng.integers(0, vocabulary, int(rng.integers(1, 60))))
        batch, width = int(rng.integers(1, 9)), int(rng.integers(4, 200))
        token_ids = rng.integers(0, vocabulary, (batch + 2, width)).astype(rng.choice([np.int32, np.int64]))
        rows = rng.choice(batch + 2, batch, replace=False).tolist()
        lengths = rng.integers(0, width + 1, batch).tolist()
        full = rng.integers(0, 12, batch)
        capped, match = np.minimum(full, rng.integers(0, 12, batch)).tolist(), int(rng.integers(1, 8))
        got = StepDrafts.empty(batch, max(full.max(), 1))
        context_drafts(
            token_ids, rows, lengths, capped, full_budgets=full.tolist(), max_match=match, into=got,
            at=np.arange(batch), source=SOURCE_INDEX[DraftSource.LOOKUP], pool=history,
            pool_source=SOURCE_INDEX[DraftSource.HISTORY],
        )  # fmt: skip
        for r, (row, length, budget, whole) in enumerate(zip(rows, lengths, capped, full.tolist())):
            source, draft = got[r]
            want = lookup_draft(token_ids[row, :length], budget, match, history)
            if budget < whole and want[1].match >= match:
                want, copies = lookup_draft(token_ids[row, :length], whole, match, history), copies + 1
            if len(want[1]):
                assert source == want[0]
                chosen[source] += 1
            assert (draft.tokens.tolist(), draft.probs, draft.match) == (
                want[1].tokens.tolist(), want[1].probs, want[1].match,
            )  # fmt: skip
    assert copies > 20 and min(chosen.values()) > 50, (copies, chosen)


def test_own_context_drafts_written_into_a_steps_drafts_check_every_index_before_writing():
    from vllm_selfspec.sources.step_drafts import StepDrafts

    token_ids = np.tile(np.array([5, 6, 7, 5, 6, 7, 5, 6], dtype=np.int32), (2, 1))  # (both rows copy)
    drafts = StepDrafts.empty(3, 4)
    context_drafts(token_ids, [0, 1], [8, 8], [4, 4], into=drafts, at=np.array([0, 2]))
    assert drafts.lengths.tolist()[0] > 0 and drafts.lengths[1] == 0 and drafts.lengths[2] > 0
    fresh = StepDrafts.empty(3, 4)
    for rows, at in (([0, 1], [0, 3]), ([0, 2], [0, 1])):  # (a draft row, then a batch row, outside)
        with pytest.raises(IndexError):
            context_drafts(token_ids, rows, [8, 8], [4, 4], into=fresh, at=np.array(at))
        assert not fresh.lengths.any() and not fresh.tokens.any()  # (nothing written, not even the first row)


def test_lookup_work_is_bounded_by_its_caps_whatever_the_context():
    """A hostile context (one token repeated, as long as a model serves) is followed through at
    most MAX_OCCURRENCES_FOLLOWED occurrences, the same draft as a context just long enough to
    hold them: without the caps the probabilities would count every earlier occurrence and the
    work would grow with the context."""
    from vllm_selfspec.sources.lookup import MAX_OCCURRENCES_FOLLOWED, MAX_OCCURRENCES_SCANNED

    hostile = suffix_draft(np.full(200_000, 7), max_tokens=4)
    followed = MAX_OCCURRENCES_FOLLOWED
    assert hostile.tokens.tolist() == [7] * 4
    assert hostile.probs[0] == followed / (followed + 1)
    assert MAX_OCCURRENCES_FOLLOWED <= MAX_OCCURRENCES_SCANNED
    # The same holds for a history of earlier outputs (whose latest occurrence ends the output,
    # so nothing follows it).
    history = OutputHistory(max_tokens=300_000)
    history.add(np.full(200_000, 7))
    assert history.draft(np.full(30, 7), max_tokens=4, max_match=24).probs[0] == (followed - 1) / (followed + 1)


def test_a_request_of_unknown_tenant_neither_reads_nor_writes_history():
    from vllm_selfspec.sources.lookup import UNKNOWN_TENANT, TenantHistories

    histories = TenantHistories(max_tokens=100, share_unsalted=True)
    histories.add(None, np.array([1, 2, 3]))
    histories.add(UNKNOWN_TENANT, np.array([4, 5, 6]))
    assert histories.tenants == 1 and len(histories) == 5
    assert histories.pool(UNKNOWN_TENANT) is None
    assert histories.pool(None).tokens.tolist() == [SEPARATOR, 1, 2, 3, SEPARATOR]


def test_requests_without_a_salt_share_no_history_unless_the_operator_opts_in():
    """Closed by default: an unsalted request neither reads nor writes a pool another can reach."""
    from vllm_selfspec.options import DEFAULTS
    from vllm_selfspec.sources.lookup import TenantHistories

    assert DEFAULTS.lookup_history_unsalted is False
    closed = TenantHistories(max_tokens=100)
    closed.add(None, np.array([1, 2, 3]))
    assert closed.pool(None) is None and closed.tenants == 0 and len(closed) == 0
    closed.add("salt", np.array([1, 2, 3]))
    assert closed.pool("salt") is not None and closed.pool(None) is None
    shared = TenantHistories(max_tokens=100, share_unsalted=True)
    shared.add(None, np.array([1, 2, 3]))
    assert shared.pool(None).draft(np.array([1, 2]), 2, 24).tokens.tolist() == [3]


def test_an_empty_salt_is_no_salt_as_in_vllm():
    """vLLM salts no block hash with cache_salt="": such requests are unsalted, not one tenant
    that every empty salt shares."""
    from vllm_selfspec.scheduler_note import salt_digest
    from vllm_selfspec.sources.lookup import TenantHistories

    assert salt_digest("") is None and salt_digest(None) is None and salt_digest("a") != salt_digest("b")
    closed = TenantHistories(max_tokens=100)
    closed.add("", np.array([1, 2, 3]))
    assert closed.pool("") is None and closed.tenants == 0
    shared = TenantHistories(max_tokens=100, share_unsalted=True)
    shared.add("", np.array([1, 2, 3]))
    assert shared.pool(None) is shared.pool("") is not None


def test_a_flood_of_fresh_salts_stays_bounded_and_spares_a_returning_tenant():
    """200,000 one-shot salts: the pools' number and memory stay within the bound the docs give,
    and a tenant that keeps coming back still drafts from its history."""
    import tracemalloc

    from vllm_selfspec.sources.lookup import TenantHistories

    tenants, max_tokens = 256, 65_536
    histories = TenantHistories(max_tokens, max_tenants=tenants)
    regular = np.arange(100, 140)
    histories.add("regular", regular)
    histories.add("regular", regular)  # it came back
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200_000):
            histories.add(f"fresh-{i}" * (1 + i % 50), np.full(1 + i % 16, i % 1000))  # long salts too
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert histories.tenants == tenants and len(histories) <= max_tokens
    # docs/operating.md: tokens x 32 B (the tokens and their index) + ~2 kB a tenant
    assert held < max_tokens * 32 + tenants * 2048, held
    draft = histories.pool("regular").draft(np.array([7, *range(100, 106)]), 4, 24)
    assert draft.tokens.tolist() == [106, 107, 108, 109]


def test_returning_tenants_leave_room_for_newcomers_to_return():
    """Returning tenants hold at most their share of the pools: a newcomer that comes back
    before the next few newcomers push it out becomes a returning tenant itself."""
    from vllm_selfspec.sources.lookup import TenantHistories

    histories = TenantHistories(10_000, max_tenants=8)
    for t in range(8):  # eight tenants, each twice: all returning, more than their share
        histories.add(f"old{t}", np.array([t]))
        histories.add(f"old{t}", np.array([t]))
    assert len(histories.returning) == 6 and histories.tenants == 8
    histories.add("new", np.array([1]))
    histories.add("new", np.array([2]))
    assert histories.key("new") in histories.returning and histories.tenants == 8


def test_one_newcomers_long_output_does_not_push_out_the_returning_tenants():
    """Room for a newcomer's output is taken from other newcomers, then from the newcomer
    itself, before any returning tenant loses an output."""
    from vllm_selfspec.sources.lookup import TenantHistories

    histories = TenantHistories(1_000, max_tenants=8)
    for tenant in ("alice", "bob"):
        for _ in range(2):
            histories.add(tenant, np.arange(200))
    held = {t: len(histories.pool(t)) for t in ("alice", "bob")}
    histories.add("stranger", np.arange(990))  # alone nearly the whole budget
    assert {t: len(histories.pool(t)) for t in ("alice", "bob")} == held
    assert histories.pool("stranger") is None and len(histories) <= 1_000
    histories.add("stranger", np.arange(150))  # a newcomer that fits stays
    assert len(histories.pool("stranger")) == 152


def test_output_history_counts_earlier_outputs_and_drops_the_oldest_whole():
    history = OutputHistory(max_tokens=12)
    for output in ([1, 2, 3], [1, 2, 4], [1, 2, 4]):
        history.add(np.array(output))
    assert history.tokens.tolist() == [-1, 1, 2, 4, -1, 1, 2, 4, -1]  # [1, 2, 3] dropped
    draft = history.draft(np.array([9, 1, 2]), max_tokens=3, max_match=24)
    assert (draft.tokens.tolist(), draft.probs) == ([4], (2 / 3,))  # stops at the output's end
    assert len(history.draft(np.array([7, 2, 4]), 3, 24)) == 0  # nothing followed "4"


def test_a_historys_index_finds_what_a_scan_of_it_finds():
    """The history's `TokenIndex`, kept up to date as outputs come and the oldest go (some
    dropped entries kept until a compaction), holds what a sort of the history holds, finds the
    occurrences a scan back finds (under any cap), and so drafts what a scan of the history
    drafts; small vocabularies make long matches and many ties."""
    from vllm_selfspec.sources.lookup import _indexed_occurrences, _recent_occurrences

    rng = np.random.default_rng(3)
    drafts = compactions = merges = 0
    for _ in range(200):
        history = OutputHistory(max_tokens=int(rng.integers(8, 300)))
        vocabulary = int(rng.integers(2, 12))
        for _ in range(int(rng.integers(1, 30))):
            history.add(rng.integers(0, vocabulary, int(rng.integers(0, 40))))
            order = np.argsort(history.tokens, kind="stable")
            order = order[history.tokens[order] != SEPARATOR]
            live_tokens, live_positions = history.index.live()
            assert live_tokens.tolist() == history.tokens[order].tolist()
            assert live_positions.tolist() == order.tolist()
            index = history.index
            compactions += index.dropped_since_compaction == 0 and index.offset > 0
            merges += len(index.recent[0]) == 0 and len(index.base[0]) > 0
            assert 3 * len(index) <= 4 * len(live_positions)  # (dropped entries: a quarter at most)
            for _ in range(5):
                token, limit, cap = int(rng.integers(0, vocabulary)), len(history) - 1, int(rng.integers(1, 20))
                found = _indexed_occurrences(*index.searched(), limit, token, cap)
                assert found.tolist() == _recent_occurrences(history.tokens, limit, token, cap).tolist()
                context = rng.integers(0, vocabulary, int(rng.integers(1, 30)))
                k, match = int(rng.integers(1, 8)), int(rng.integers(1, 30))
                got, want = history.draft(context, k, match), suffix_draft(context, k, history.tokens, match)
                assert (got.tokens.tolist(), got.probs, got.match) == (want.tokens.tolist(), want.probs, want.match)
                drafts += len(got) > 0
    assert drafts > 3000 and compactions > 100 and merges > 100


def test_lookup_draft_takes_the_better_of_own_context_and_history():
    history = OutputHistory(max_tokens=1000)
    for _ in range(3):
        history.add(np.array([8, 9, 10, 11]))
    own_weak = np.array([8, 9, 3, 5, 8, 9])  # own context: "8 9" -> 3 once (score 0.5 + ...)
    source, draft = lookup_draft(own_weak, 3, 24, history)
    assert (source, draft.tokens.tolist()) == ("history", [10, 11])
    assert lookup_draft(own_weak, 3, 24, None)[0] == "lookup"
    source, draft = lookup_draft(np.array([8, 9, 3, 5, 8, 9, 3, 5, 8, 9]), 3, 24, history)
    assert (source, draft.tokens.tolist()) == ("lookup", [3, 5, 8])  # a longer, surer match


def test_token_bins_by_match_length_and_agreement():
    assert token_bins("lookup", (0.5, 0.5, 0.25), 3, 3) == [
        ("lookup", False, 1, 2),
        ("lookup", False, 1, 4),
        ("lookup", False, 1, 2),
    ]
    assert token_bins("history", (0.9,), 12, 1, sampled=True) == [("history", True, 3, 4)]
    # Without probabilities (a prediction), one bin per match bucket: how far the output has
    # followed the prediction, 0-1 | 2-3 | 4-7 | 8+.
    assert token_bins("prediction", (), 0, 2) == [("prediction", False, 0)] * 2
    assert token_bins("prediction", (), 3, 1) == [("prediction", False, 1)]
    assert token_bins("prediction", (), 40, 1, sampled=True) == [("prediction", True, 3)]


def test_an_unseen_bin_is_priced_by_its_agreement_not_by_weak_drafts_elsewhere():
    controller = trained(t0=0.25, t1=0.03, self_step=0.5, lookup_rate=0.6, self_rate=0.5)
    for _ in range(40):  # weak one-token drafts fail and drag the source's rate down
        controller.observe_draft("y", "lookup", 1, 0, controller.calibration(RowOffer(**WEAK)))
    assert controller.acceptance.rates[DraftSource.LOOKUP].rate < 0.2
    offer = RowOffer("a", lookup_tokens=2, lookup_probs=(0.75, 0.75), lookup_match=5)
    gains = controller.acceptance.lookup_gains(offer)
    assert gains == pytest.approx([0.75, 0.75 * 0.999])
    # What the proposer counts against verification's outcome: the gains of the tokens it drafts.
    expected = controller.acceptance.step_gains(StepOffers.of([offer])).expected
    assert expected([0], [1])[0] == pytest.approx([0.75])
    assert expected([0], [2])[0] == pytest.approx([sum(gains)])


def test_a_prediction_just_rejoined_is_priced_by_what_such_drafts_did_not_by_long_runs():
    """Drafts made just after the output rejoined its prediction fail; those deep in a long run
    hold: each run bucket learns its own, so the planner prices the two apart."""
    acceptance = AcceptanceModel()

    def offer(req_id, run):
        return RowOffer(req_id, lookup_tokens=4, lookup_source="prediction", lookup_match=run)

    for i in range(30):
        acceptance.observe_draft(f"r{i}", "prediction", 4, 0, acceptance.calibration(offer(f"r{i}", 3)))
        acceptance.observe_draft(f"r{i}", "prediction", 4, 4, acceptance.calibration(offer(f"r{i}", 40)))
    fresh, deep = acceptance.lookup_gains(offer("new", 3)), acceptance.lookup_gains(offer("new", 40))
    assert fresh[0] < 0.3 < 0.9 < deep[0]


def test_acceptance_rate_counts_trials_up_to_the_first_rejection():
    rate = AcceptanceRate(prior=0.5, decay=1.0)
    rate.observe(drafted=4, accepted=4)  # 4 trials, 4 successes
    rate.observe(drafted=4, accepted=1)  # 2 trials (1 success, then a rejection)
    assert rate.rate == pytest.approx((1 + 4 + 1) / (2 + 4 + 2))
    rate.observe(drafted=0, accepted=0)
    assert rate.rate == pytest.approx(6 / 8)


def target_step_cost():
    from vllm_selfspec.control import step_costs

    return dataclasses.replace(step_costs.target_step_cost(), decay=1.0)


def test_a_settled_step_cost_fit_is_solved_every_few_steps_and_at_once_when_costs_jump():
    cost = target_step_cost()
    step = lambda n, seconds: cost.observe((0, n, 0, 0, 0, 0), seconds)  # noqa: E731
    for i in range(4 * cost.min_samples - 1):  # until settled, every step refits
        before = cost.coefficients()
        step(1 + i % 8, 0.2 + 0.01 * (1 + i % 8))
        assert cost.coefficients() is not before
    settled = cost.coefficients()
    for i in range(cost.refit_every - 1):  # a little dearer: followed at the next refit
        step(1 + i % 8, 0.25 + 0.01 * (1 + i % 8))
        assert cost.coefficients() is settled
    step(4, 0.29)
    assert cost.coefficients() is not settled and cost.predict((0, 1, 0, 0, 0, 0)) > 0.21
    for _ in range(3):  # four times dearer, three steps running: followed at once
        step(1, 2.0)
    assert cost.predict((0, 1, 0, 0, 0, 0)) > 0.25


def test_step_cost_fits_each_kind_of_work_and_ignores_idle_gaps():
    cost = target_step_cost()
    # Decode steps of 1-8 rows, half of them sampling, some verifying drafts, a few prefill chunks.
    steps = [(0, n, s, v) for n in range(1, 9) for s in (0, n // 2) for v in (0, n % 2)] + [
        (300, 1, 0, 0),
        (120, 2, 1, 0),
    ]
    for new in (1, 0):  # each shape comes twice, the first time with set-up
        for p, n, s, v in steps:
            k = n * (1 + n % 3) * (0.5 + new)  # thousands of context tokens read, spread apart from rows
            cost.observe(
                (p, n, s, v, new, k), 0.2 + 0.001 * p + 0.01 * n + 0.02 * s + 0.05 * v + 0.03 * new + 0.004 * k
            )
    intercept, coef = cost.coefficients()
    assert intercept == pytest.approx(0.2, rel=1e-2)
    assert coef == pytest.approx([0.001, 0.01, 0.02, 0.05, 0.03, 0.004], rel=5e-2)
    cost.observe((0, 1, 0, 0, 0, 0), 60.0)  # the engine sat idle between requests
    assert cost.predict((0, 1, 0, 0, 0, 0)) == pytest.approx(0.21, rel=1e-2)
    for _ in range(6):  # but steps that really got slower are followed
        cost.observe((0, 1, 0, 0, 0, 0), 2.0)
    assert cost.predict((0, 1, 0, 0, 0, 0)) > 0.3


def test_step_cost_charges_an_always_sampling_workload_to_its_rows():
    """With every row sampling, rows and sampled rows cannot be told apart; the fit must still
    price a sampled row right, and not make rows look free."""
    cost = target_step_cost()
    for n in [32, 64, 96, 128] * 3:
        cost.observe((0, n, n, 1, 0, 0), 0.3 + 0.015 * n)  # and always verifying drafts
    intercept, (_, t_row, t_sampled, t_verify, _, _) = cost.coefficients()
    assert t_row + t_sampled == pytest.approx(0.015, rel=1e-2) and t_row > 0.01
    assert intercept + t_verify == pytest.approx(0.3, rel=1e-2) and t_verify < 0.01


def test_step_cost_prompt_tokens_do_not_make_draft_tokens_look_cheap():
    """A prefill chunk of 4000 tokens costs far less per token than a verified draft token (no
    logits, one big product). One slope for both priced drafts at the prompt rate."""
    cost = target_step_cost()
    for n in [32, 64, 96, 128] * 3:
        cost.observe((0, n, 0, 0, 0, 0), 0.3 + 0.012 * n)
    for _ in range(3):
        cost.observe((4000, 32, 0, 0, 0, 0), 0.3 + 0.002 * 4000 + 0.012 * 32)
    _, (t_prompt, t_row, _, _, _, _) = cost.coefficients()
    assert t_prompt == pytest.approx(0.002, rel=1e-2) and t_row == pytest.approx(0.012, rel=1e-2)


def test_step_cost_without_spread_assumes_a_token_costs_a_tenth_of_a_step():
    cost = target_step_cost()
    for _ in range(10):
        cost.observe((0, 4, 0, 0, 0, 0), 0.28)
    _, (_, t_row, _, _, _, _) = cost.coefficients()
    assert 0.01 < t_row < 0.05 and cost.predict((0, 4, 0, 0, 0, 0)) == pytest.approx(0.28)


def test_set_up_at_a_new_shape_is_not_charged_to_verification():
    """Measured on the tiny model: the first step at each shape (logit rows, sampled rows, draft
    tokens) costs about 12 ms on top of a 5 ms step, once. The first steps that verify anything
    are all at new shapes; charged to verification, their set-up made any draft look too dear
    to try again, so it was never measured again (a flaky engine test)."""
    controller, seen = DraftController(), set()
    controller.planner.protect_rows = False  # (new rows: the per-row rule's own tests below)

    def step(rows, drafts=0):
        shape = (rows + drafts, 0, drafts)
        set_up = 0.012 if shape not in seen else 0.0
        seen.add(shape)
        controller.observe_step(0, rows + drafts, 0, 0.005 + 1e-4 * (rows + drafts) + set_up, drafts)

    # A closed batch of 6 greedy rows: one lookup token drafted early, then none; rows finishing.
    for rows, drafts in [(6, 0)] * 6 + [(6, 1)] + [(6, 0)] * 40 + [(4, 0), (2, 0)]:
        step(rows, drafts)
    t0, (_, _, _, t_verify, t_new, _) = controller.costs.step.coefficients()
    assert t_verify < 0.002 and t_new == pytest.approx(0.012, rel=0.2)
    sure = [
        RowOffer(f"r{i}", lookup_tokens=3, lookup_source="history", lookup_probs=(0.5, 0.5, 0.5), lookup_match=8)
        for i in range(6)
    ]
    assert sum(controller.plan(sure, self_budget=0).lookup_lengths) > 0


def trained(t0, t1, self_step, lookup_rate, self_rate, t_sampled=0.0, t_verify=0.0, protect_rows=False):
    """A controller that has learned these step costs and acceptance rates. The greedy plan's
    own rules are tested without the per-row rule (`objective: "throughput"`), which has tests
    of its own (`protect_rows=True`)."""
    controller = DraftController()
    controller.planner.protect_rows = protect_rows
    for n in [1, 3, 5, 8] * 4:
        controller.observe_step(0, n, 0, t0 + t1 * n)
        controller.observe_step(0, n, n, t0 + (t1 + t_sampled) * n)
        controller.observe_step(0, n + 2, 0, t0 + t1 * (n + 2) + t_verify, draft_tokens=2)
    for rows in (1, 2):
        controller.observe_self_step(rows, self_step)
    controller.acceptance.rates[DraftSource.LOOKUP] = AcceptanceRate(prior=lookup_rate, decay=1.0)
    controller.acceptance.rates[DraftSource.SELF] = AcceptanceRate(prior=self_rate, decay=1.0)
    return controller


def lookup_rows(*found, sampled=False):
    return [RowOffer(f"r{i}", lookup_tokens=n, sampled=sampled) for i, n in enumerate(found)]


def self_rows(count, start=100):
    return [RowOffer(f"r{start + i}", can_self_draft=True) for i in range(count)]


def assert_every_row_left_its_due(lengths, *, cost, t_plain, t_verify, credited, ahead, context=None):
    """The per-row rule, written apart from the planner's arithmetic: a plan of lookup drafts
    `lengths` (tokens of `cost` seconds each) leaves each row i (1 + g_i) / t_i >= (1 -
    ROW_SLACK) / t_plain, g_i the tokens it is `credited`, with what it is `ahead` added; a
    plan that drafts nothing passes."""
    from vllm_selfspec.control.planner import ROW_SLACK

    drafted = sum(lengths) > 0
    added = sum(c * n for c, n in zip(cost, lengths)) + t_verify * drafted
    for i, n in enumerate(lengths):
        allowed = t_plain * ((1 + credited[i]) / (1 - ROW_SLACK) - 1) + ahead[i]
        allowed += cost[i] * n + t_verify if n else 0.0
        assert not drafted or added <= allowed + 1e-9, (context, i, lengths)


def with_history(controller, req_ids, drafted=4, accepted=4, times=3):
    """Requests whose lookup drafts have been verified often enough to be trusted."""
    for req_id in req_ids:
        for _ in range(times):
            controller.observe_draft(req_id, DraftSource.LOOKUP, drafted, accepted)
    return controller


def test_a_row_without_a_draft_is_not_slowed_by_its_neighbours_drafts():
    """A sure lookup draft whose verification costs a tenth of the step each token, beside a
    row with none: the batch would gain, the row without a draft would lose; the plan keeps
    the step within ROW_SLACK of plain's. The operator's throughput objective takes it."""
    from vllm_selfspec.control.planner import ROW_SLACK

    controller = trained(t0=0.05, t1=0.01, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    offers = [RowOffer("hostile", lookup_tokens=4, lookup_probs=(0.95,) * 4), RowOffer("chat")]
    assert sum(controller.plan(offers, self_budget=0).lookup_lengths) == 0
    controller.planner.protect_rows = False
    assert controller.plan(offers, self_budget=0).lookup_lengths == [4, 0]
    # Cheap verification: the tokens that fit in the slack are still taken.
    cheap = trained(t0=0.05, t1=0.001, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    step = cheap.costs.target()
    fit = int(ROW_SLACK / (1 - ROW_SLACK) * (step.t0 + 2 * step.t_row) / step.t_row)
    assert fit < 4 and cheap.plan(offers, self_budget=0).lookup_lengths == [fit, 0]


def test_the_row_rule_costs_nothing_for_one_row_or_rows_that_all_gain():
    protected = trained(t0=0.05, t1=0.01, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    unprotected = trained(t0=0.05, t1=0.01, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    unprotected.planner.protect_rows = False
    alone = [RowOffer("alone", lookup_tokens=4, lookup_probs=(0.95,) * 4)]
    assert protected.plan(alone, 0) == unprotected.plan(alone, 0) and sum(protected.plan(alone, 0).lookup_lengths)
    rows = [RowOffer(f"code{i}", lookup_tokens=4, lookup_probs=(0.95,) * 4) for i in range(4)]
    for controller in (protected, unprotected):
        with_history(controller, [o.req_id for o in rows])
    assert protected.plan(rows, 0) == unprotected.plan(rows, 0) and sum(protected.plan(rows, 0).lookup_lengths) > 4
    # A row is never charged its own draft: a new request's draft dearer than the slack, beside a
    # trusted row whose short draft fits in the slack, is made whole.
    controller = trained(t0=0.05, t1=0.001, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    with_history(controller, ["short"])
    offers = [RowOffer("new", lookup_tokens=4, lookup_probs=(0.95,) * 4), RowOffer("short", lookup_tokens=1)]
    assert controller.plan(offers, self_budget=0).lookup_lengths == [4, 1]


def test_a_draft_token_is_priced_by_the_context_its_row_attends_over():
    """Steps whose rows read long contexts cost more: the fit learns it, and a draft token of a
    6,000-token row beside a short one no longer fits the slack the short row allows, while the
    same draft of a short row does."""
    controller = trained(t0=0.05, t1=0.0005, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    for n in [1, 2, 4] * 6:  # the same rows over contexts of 100 to 6,000 tokens: 1 ms a row per 1,000
        for context in (100, 2000, 6000):
            controller.observe_step(0, n, 0, 0.05 + 0.0005 * n + 0.001 * n * context / 1000, context_read=n * context)
    assert controller.costs.target().t_context == pytest.approx(0.001, rel=0.1)
    sure = dict(lookup_tokens=4, lookup_probs=(0.95,) * 4)
    beside_short = [RowOffer("drafting", context=200, **sure), RowOffer("chat", context=200)]
    beside_long = [RowOffer("drafting", context=6000, **sure), RowOffer("chat", context=200)]
    assert sum(controller.plan(beside_short, 0).lookup_lengths) > sum(controller.plan(beside_long, 0).lookup_lengths)


def test_a_new_request_is_credited_no_gain_until_its_drafts_are_verified():
    """A row with a one-token draft beside a row whose long draft costs more than the slack:
    the short draft's estimated gain would cover the long draft's time, but a new request's
    estimate is not trusted (it counts as gaining nothing); once its drafts are verified, it is."""
    controller = trained(t0=0.05, t1=0.001, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    with_history(controller, ["long"])
    offers = [RowOffer("long", lookup_tokens=4, lookup_probs=(0.95,) * 4), RowOffer("short", lookup_tokens=1)]
    untrusted = controller.plan(offers, self_budget=0).lookup_lengths
    with_history(controller, ["short"])
    trusted = controller.plan(offers, self_budget=0).lookup_lengths
    assert untrusted[0] < trusted[0] == 4 and untrusted[1] == trusted[1] == 1
    # A new request is credited the acceptance of its draft's calibration bins over the batch
    # once that rests on enough verified tokens (other requests'), though its own does not yet;
    # tokens verified in other bins (the long row's sure ones) do not count.
    from vllm_selfspec.control.acceptance import TRUSTED_BIN_TOKENS

    newcomer = [offers[0], RowOffer("newcomer", lookup_tokens=1)]
    for _ in range(TRUSTED_BIN_TOKENS):
        controller.observe_draft("long", DraftSource.LOOKUP, 4, 4, controller.calibration(offers[0]))
    assert controller.plan(newcomer, self_budget=0).lookup_lengths == untrusted
    for i in range(TRUSTED_BIN_TOKENS):
        controller.observe_draft(f"earlier{i}", DraftSource.LOOKUP, 1, 1, controller.calibration(newcomer[1]))
    assert controller.plan(newcomer, self_budget=0).lookup_lengths == trusted


def settle(controller, accepted):
    """The step just planned ran, and its rows accepted these draft tokens."""
    controller.observe_rows(accepted)


def test_a_busy_steps_rows_settle_as_arrays_as_they_do_one_by_one():
    """The ledger settles a step of many rows as arrays (`row_ledger.settled_by_arrays`), of a
    few one by one: the same ledger to the last bit, rows gone from the batch dropped, what is
    carried clamped at both bounds."""
    import random

    from vllm_selfspec.control.row_ledger import PlannedStep, settled_by_arrays, settled_by_rows

    rng = random.Random(4)
    clamped = dropped = 0
    for _ in range(300):
        req_ids = tuple(f"r{i}" for i in range(rng.randint(0, 300)))
        plain = rng.uniform(0.005, 0.05)
        step = PlannedStep(req_ids, plain, plain * rng.uniform(0.9, 1.6))
        ahead = {r: rng.uniform(-0.5, 9) * plain for r in req_ids if rng.random() < 0.7}
        accepted = {r: rng.randint(0, 8) for r in req_ids if rng.random() < 0.95}
        due, bounds = plain / (1 - 0.02), (-0.25 * plain, 8 * plain)
        by_rows = settled_by_rows(ahead, step, accepted, due, bounds)
        assert settled_by_arrays(ahead, step, accepted, due, bounds) == by_rows
        assert list(by_rows) == [r for r in req_ids if r in accepted]
        clamped += sum(v in bounds for v in by_rows.values())
        dropped += len(req_ids) - len(by_rows)
    assert clamped > 100 and dropped > 100, (clamped, dropped)


def test_a_row_ahead_of_plain_pays_for_its_neighbours_drafts_and_one_behind_allows_less():
    """The per-row rule's ledger (`row_ledger`): a chat row beside a sure draft allows only the
    slack in a step. After steps in which it gained (its own drafts accepted), it lets the step
    grow for its neighbour's draft; a row whose drafts were all rejected, in steps that grew for
    them, allows less than a new row; what is carried is bounded and is dropped with the row."""
    from vllm_selfspec.control.row_ledger import MOST_AHEAD, MOST_BEHIND, PlannedStep

    controller = trained(t0=0.05, t1=0.01, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    with_history(controller, ["hostile", "chat"])
    offers = [RowOffer("hostile", lookup_tokens=4, lookup_probs=(0.95,) * 4), RowOffer("chat")]
    assert controller.plan(offers, self_budget=0).lookup_lengths == [0, 0]  # (as in the test above)
    settle(controller, {"hostile": 0, "chat": 0})
    # The chat row drafted and gained 4 tokens a step, twice.
    both = [offers[0], RowOffer("chat", lookup_tokens=4, lookup_probs=(0.95,) * 4)]
    for _ in range(2):
        assert controller.plan(both, self_budget=0).lookup_lengths == [4, 4]
        settle(controller, {"hostile": 4, "chat": 4})
    ledger = controller.planner.ledger
    ahead = ledger.ahead(["chat"])[0]
    plain = controller.costs.target().t0 + 2 * controller.costs.target().t_row
    assert plain < ahead <= MOST_AHEAD * plain * (1 + 1e-9)
    assert controller.plan(offers, self_budget=0).lookup_lengths == [4, 0]  # it pays from what it gained
    # Its neighbour's drafts are rejected from now on: the chat row spends what it gained, and
    # never falls behind; the hostile row falls behind, as far as the bound.
    hostile = ledger.ahead(["hostile"])[0]
    settle(controller, {"hostile": 0, "chat": 0})
    assert ledger.ahead(["chat"])[0] < ahead and ledger.ahead(["hostile"])[0] < hostile
    drafted = []
    for _ in range(30):
        drafted.append(controller.plan(offers, self_budget=0).lookup_lengths[0])
        settle(controller, {"hostile": 0, "chat": 0})
        assert ledger.ahead(["chat"])[0] >= -1e-9
    assert sum(drafted[-10:]) < sum(drafted[:10]) and max(drafted[-10:]) <= 1  # (the slack it earns)
    assert ledger.ahead(["hostile"])[0] < hostile
    # However long a step was, a row is carried at most MOST_BEHIND plain steps behind.
    ledger.plan_made(PlannedStep(("hostile", "chat"), plain_seconds=plain, planned_seconds=100 * plain))
    settle(controller, {"hostile": 0, "chat": 0})
    assert ledger.ahead(["hostile"]) == [pytest.approx(-MOST_BEHIND * plain)]
    # A step that did not follow the plan settles nothing; rows gone are dropped, as are forgotten ones.
    before = ledger.ahead(["chat", "hostile"])
    controller.plan(offers, self_budget=0)
    settle(controller, None)
    assert ledger.ahead(["chat", "hostile"]) == before
    controller.plan(offers, self_budget=0)
    settle(controller, {"chat": 0})
    assert len(ledger) == 1 and ledger.ahead(["hostile"]) == [0.0]
    controller.forget("chat")
    assert len(ledger) == 0


def test_cheap_verification_and_good_drafts_draft_everything():
    controller = trained(t0=0.25, t1=0.01, self_step=0.02, lookup_rate=0.9, self_rate=0.9)
    assert controller.plan(self_rows(1), self_budget=4).self_length == 4
    assert controller.plan(lookup_rows(3), self_budget=0).lookup_lengths == [3]


def test_a_self_draft_step_must_beat_the_rate_lookup_already_reached():
    # 0.04 s per self-draft step: worth a first token at acceptance 0.9, not a second one
    # once the lookup row has made the step productive.
    controller = trained(t0=0.25, t1=0.01, self_step=0.04, lookup_rate=0.9, self_rate=0.9)
    plan = controller.plan(lookup_rows(3) + self_rows(1), self_budget=4)
    assert plan.lookup_lengths == [3, 0] and plan.self_length == 1


def test_self_drafts_that_cost_a_full_step_are_not_made_nor_retried():
    """The measured case on a 2-core CPU: a draft step costs about a target step, so even with
    every draft token accepted a self-draft cannot beat plain decoding; retrying it (and
    probing new prompts for it) would only cost time."""
    controller = trained(t0=0.25, t1=0.02, self_step=0.3, lookup_rate=0.8, self_rate=0.8)
    plans = [controller.plan(lookup_rows(4) + self_rows(1), self_budget=4) for _ in range(300)]
    assert all(p.self_length == 0 for p in plans) and plans[0].lookup_lengths[0] >= 2


def test_a_draft_that_only_breaks_even_is_not_made():
    """Dozens of rows under a server's load: a draft token whose gain per second only just beats
    the step's rate buys nothing and makes the step, and the first tokens waiting on it, later.
    One that beats it by the margin is taken."""
    from vllm_selfspec.control.planner import DRAFT_MARGIN

    t0, t1 = 0.03, 0.002  # 45 rows: a 120 ms step, 375 tokens a second; a draft token 2 ms
    rate = 45 / (t0 + 45 * t1)
    for accepted, drafts in ((rate * t1 * (1 + DRAFT_MARGIN / 2), False), (rate * t1 * (1 + 2 * DRAFT_MARGIN), True)):
        controller = trained(t0=t0, t1=t1, self_step=0.5, lookup_rate=accepted, self_rate=0.1)
        plan = controller.plan(lookup_rows(*[1] * 45), self_budget=0)
        assert (sum(plan.lookup_lengths) > 0) == drafts


def test_a_step_a_new_prompt_waits_for_stays_within_the_slack_of_plains():
    """When a prompt will wait for the step (queued, or sent as a request ends), the step may be
    at most FIRST_TOKEN_SLACK longer than plain decoding's, however well drafts pay; with none
    waiting the plan is unchanged. Verification's own fixed cost counts against the slack."""
    from vllm_selfspec.control.planner import FIRST_TOKEN_SLACK

    t0, t1 = 0.03, 0.0005  # 45 rows: a 52.5 ms step; a draft token 0.5 ms
    step = t0 + 45 * t1
    fit = int(FIRST_TOKEN_SLACK * step / t1)  # 5 draft tokens fit in 2.6 ms
    controller = trained(t0=t0, t1=t1, self_step=0.5, lookup_rate=0.9, self_rate=0.1)
    offers = lookup_rows(*[3] * 45)
    assert sum(controller.plan(offers, self_budget=0).lookup_lengths) >= 45  # with none waiting
    assert controller.plan(offers, self_budget=0) == controller.plan(offers, self_budget=0, prompts_waiting=False)
    assert sum(controller.plan(offers, self_budget=0, prompts_waiting=True).lookup_lengths) == fit == 5
    dear_verification = trained(t0=t0, t1=t1, self_step=0.5, lookup_rate=0.9, self_rate=0.1, t_verify=3 * t1 * fit)
    assert sum(dear_verification.plan(offers, self_budget=0).lookup_lengths) > 0
    assert sum(dear_verification.plan(offers, self_budget=0, prompts_waiting=True).lookup_lengths) == 0


def test_a_self_draft_a_new_prompt_waits_for_is_cut_to_the_slack_or_refused_when_one_token_exceeds_it():
    """A self-draft token costs its verification and a draft step, and a prompt waiting for the
    step waits for both: with one waiting, the self-draft takes only the tokens that fit in
    FIRST_TOKEN_SLACK of plain's step, none if one does not fit; with none waiting, the budget.
    (Rows with a mask: no probe.)"""
    from vllm_selfspec.control.planner import FIRST_TOKEN_SLACK

    rows = [dataclasses.replace(self_rows(1)[0], has_mask=True)]
    for self_step, fit in ((0.004, 2), (0.02, 0)):  # a self-draft token: 5 ms, 21 ms; the slack 12.55 ms
        controller = trained(t0=0.25, t1=0.001, self_step=self_step, lookup_rate=0.9, self_rate=0.9)
        step = controller.costs.target()
        per_token = step.t_row + controller.costs.self_step_seconds(1)
        assert int((FIRST_TOKEN_SLACK * (step.t0 + step.t_row) - step.t_verify) / per_token) == fit
        assert controller.plan(rows, self_budget=4).self_length == 4
        assert controller.plan(rows, self_budget=4, prompts_waiting=True).self_length == fit


def test_a_row_that_needs_a_probe_does_not_self_draft_while_a_prompt_waits():
    """A probe reads the prompt: a few target steps, past any slack a waiting prompt allows, so
    only rows with a mask self-draft then. Control: with a mask, or with none waiting, it does."""
    controller = trained(t0=0.25, t1=0.001, self_step=0.004, lookup_rate=0.9, self_rate=0.9)
    controller.observe_probe(rows=1, seconds=3.0)
    new, measured = self_rows(1)[0], dataclasses.replace(self_rows(1)[0], has_mask=True)
    assert controller.plan([new], 4, prompts_waiting=True).self_length == 0
    assert controller.plan([measured], 4, prompts_waiting=True).self_length > 0
    assert controller.plan([new], 4).self_length > 0


def test_a_retry_is_refused_while_a_prompt_waits_for_its_step():
    """A retry costs a draft step, and a probe when no row has a mask yet (a few target steps),
    for a source that did not pay when last used: a prompt waiting for the step would wait for
    all of it. The retry that is due is made at the next step no prompt waits for."""
    from vllm_selfspec.control.planner import FIRST_RETRY_AFTER

    for has_mask in (True, False):
        controller = trained(t0=0.25, t1=0.02, self_step=0.1, lookup_rate=0.8, self_rate=0.2)
        controller.observe_probe(rows=1, seconds=0.5)
        rows = [dataclasses.replace(self_rows(1)[0], has_mask=has_mask)]
        assert not any(controller.plan(rows, 4).explored for _ in range(FIRST_RETRY_AFTER - 1))  # one more is due
        assert not any(controller.plan(rows, 4, prompts_waiting=True).explored for _ in range(3))
        retry = controller.plan(rows, 4)
        assert retry.explored and retry.self_rows == [True] and retry.self_length == 1


def observe_shares(calibration, accepted_share: float, drafts: int = 2000) -> None:
    """One-token drafts estimated at 1, accepted_share of them accepted, evenly spread."""
    for k in range(drafts):
        calibration.observe(expected=1.0, accepted=int((k + 1) * accepted_share) - int(k * accepted_share))


def test_estimate_calibration_follows_what_verification_accepts_of_the_drafts_chosen():
    from vllm_selfspec.control.acceptance import EstimateCalibration

    calibration = EstimateCalibration()
    assert calibration.factor == 1.0  # nothing verified yet: the estimates as they are
    observe_shares(calibration, 0.85)
    assert calibration.factor == pytest.approx(0.85, abs=0.01)
    calibration.observe(expected=0.0, accepted=0)  # a draft nobody estimated teaches nothing
    assert calibration.factor == pytest.approx(0.85, abs=0.01)
    observe_shares(calibration, 1.0)  # the load changes: estimates borne out again
    assert calibration.factor == pytest.approx(1.0, abs=0.01)
    observe_shares(calibration, 0.0)
    assert calibration.factor == calibration.limits[0]


def test_a_draft_that_beats_the_margin_only_by_estimates_verification_does_not_bear_out_is_not_made():
    """With dozens of rows a step the planner chooses among many noisy estimates, and the ones
    it chooses are too high: past capacity the drafts taken were accepted 0.85x as often as
    estimated, and drafts that beat the margin by the estimates only broke even. Scaled by what
    verification bears out, they are not made; estimates borne out keep them."""
    from vllm_selfspec.control.planner import DRAFT_MARGIN

    t0, t1 = 0.03, 0.002  # 45 rows: a 120 ms step, 375 tokens a second; a draft token 2 ms
    rate = 45 / (t0 + 45 * t1)
    estimate = rate * t1 * (1 + 1.5 * DRAFT_MARGIN)  # beats the margin by its estimate
    for accepted_share, drafts in ((1.0, True), (0.85, False)):
        controller = trained(t0=t0, t1=t1, self_step=0.5, lookup_rate=estimate, self_rate=0.1)
        observe_shares(controller.acceptance.estimate_calibration[DraftSource.LOOKUP], accepted_share)
        offers = lookup_rows(*[1] * 45)
        ((planned,), (estimated,)) = controller.acceptance.step_gains(StepOffers.of(offers[:1])).expected([0], [1])
        assert estimated == pytest.approx(estimate)
        assert planned == pytest.approx(estimate * accepted_share, rel=0.02)
        assert (sum(controller.plan(offers, self_budget=0).lookup_lengths) > 0) == drafts
        # History drafts are calibrated on their own.
        assert controller.acceptance.estimate_calibration[DraftSource.HISTORY].factor == 1.0


def test_expensive_verification_turns_drafting_off():
    """Large batches on CPU: each extra verified token costs nearly as much as a row's token."""
    controller = trained(t0=0.1, t1=0.03, self_step=0.5, lookup_rate=0.5, self_rate=0.5)
    plan = controller.plan(lookup_rows(*[4] * 16) + self_rows(16), self_budget=4)
    assert plan.lookup_lengths == [0] * 32 and plan.self_length == 0


def test_sampled_rows_draft_less_when_their_verification_costs_more():
    controller = trained(t0=0.3, t1=0.004, self_step=0.5, lookup_rate=0.5, self_rate=0.5, t_sampled=0.02)
    greedy = controller.plan(lookup_rows(4, 4), self_budget=0).lookup_lengths
    sampled = controller.plan(lookup_rows(4, 4, sampled=True), self_budget=0).lookup_lengths
    assert sum(sampled) < sum(greedy)


def test_a_step_that_verifies_anything_pays_a_fixed_cost_once():
    """vLLM's rejection sampler and its metadata run only in steps with drafts (43 ms of a
    560 ms step at batch 32 here): a lone unsure token does not pay for it, a longer sure draft does."""
    controller = trained(t0=0.1, t1=0.01, self_step=0.5, lookup_rate=0.5, self_rate=0.5, t_verify=0.05)
    assert controller.costs.step.coefficients()[1][3] == pytest.approx(0.05, rel=0.05)
    assert controller.plan(lookup_rows(1), self_budget=0).lookup_lengths == [0]
    free = trained(t0=0.1, t1=0.01, self_step=0.5, lookup_rate=0.5, self_rate=0.5)
    assert free.plan(lookup_rows(1), self_budget=0).lookup_lengths == [1]
    controller.acceptance.rates[DraftSource.LOOKUP] = AcceptanceRate(prior=0.9, decay=1.0)
    assert controller.plan(lookup_rows(4), self_budget=0).lookup_lengths == [4]


def closed(offers, remaining):
    return [dataclasses.replace(o, remaining=r) for o, r in zip(offers, remaining)]


def test_a_draining_batch_drafts_only_in_the_rows_that_finish_last():
    """Batch 32 on this CPU (t0 = 0.28 s, 8.8 ms a row): at acceptance 0.7 a draft token pays in
    the steady state. In an offline batch that is finishing, the rows ahead would finish early
    and free nothing: only the rows that set the batch's length draft."""
    controller = trained(t0=0.28, t1=0.0088, self_step=0.5, lookup_rate=0.7, self_rate=0.7)
    offers = closed(lookup_rows(*[2] * 32), [48] * 4 + [36] * 28)
    steady = controller.plan(offers, self_budget=0).lookup_lengths
    draining = controller.plan(offers, self_budget=0, draining=True).lookup_lengths
    assert all(n > 0 for n in steady)
    assert all(n > 0 for n in draining[:4]) and draining[4:] == [0] * 28


def test_a_closed_batch_of_level_rows_drafts_only_if_every_row_is_likely_to_advance():
    """8 rows with 40 tokens left each: the batch ends a step sooner only if all 8 accept a
    token. At acceptance 0.6 that is 0.6**8 = 2%: no draft pays, though each would in the
    steady state. Sure drafts in every row do pay; one row without any draft rules it out."""
    controller = trained(t0=0.18, t1=0.012, self_step=0.5, lookup_rate=0.6, self_rate=0.6)
    level = closed(lookup_rows(*[2] * 8), [40] * 8)
    assert sum(controller.plan(level, self_budget=0).lookup_lengths) > 0
    assert controller.plan(level, self_budget=0, draining=True).lookup_lengths == [0] * 8
    controller.acceptance.rates[DraftSource.LOOKUP] = AcceptanceRate(prior=0.99, decay=1.0)
    assert controller.plan(level, self_budget=0, draining=True).lookup_lengths == [2] * 8
    one_without = closed(lookup_rows(*[2] * 7, 0), [40] * 8)
    assert controller.plan(one_without, self_budget=0, draining=True).lookup_lengths == [0] * 8


def test_a_draining_batch_drafts_each_row_to_a_common_finish_line():
    """A row one token ahead of the last ones needs one token less to end with them."""
    controller = trained(t0=0.28, t1=0.0088, self_step=0.5, lookup_rate=0.99, self_rate=0.6)
    offers = closed(lookup_rows(4, 4, 4), [30, 29, 20])
    assert controller.plan(offers, self_budget=0, draining=True).lookup_lengths == [4, 3, 0]


def test_a_last_row_without_lookup_self_drafts_when_that_brings_the_end_nearer():
    controller = trained(t0=0.28, t1=0.0088, self_step=0.05, lookup_rate=0.99, self_rate=0.95)
    offers = closed(lookup_rows(4) + self_rows(1), [30, 30])
    plan = controller.plan(offers, self_budget=4, draining=True)
    assert plan.self_rows == [False, True] and plan.self_length > 0 and plan.lookup_lengths[0] == plan.self_length
    dear = trained(t0=0.28, t1=0.0088, self_step=0.3, lookup_rate=0.99, self_rate=0.95)
    plans = [dear.plan(offers, self_budget=4, draining=True) for _ in range(100)]
    assert all(p.self_length == 0 and p.lookup_lengths == [0, 0] for p in plans)  # nor retried


def test_a_draining_batch_prices_the_probe_a_new_row_needs_before_it_self_drafts():
    """A row whose prompt is not probed yet pays a probe (a few target steps) before its first
    self-draft: the batch's end brought a step nearer does not pay for that, and a probed row's
    self-draft still does."""
    controller = trained(t0=0.28, t1=0.0088, self_step=0.05, lookup_rate=0.99, self_rate=0.95)
    new = closed(lookup_rows(4) + self_rows(1), [30, 30])
    assert controller.plan(new, self_budget=4, draining=True).self_length > 0  # (no probe timed yet: free)
    controller.observe_probe(1, 0.9)
    plan = controller.plan(new, self_budget=4, draining=True)  # (a retry, a back-off later, may still probe it)
    assert plan.self_length == 0 and not any(plan.self_rows) and not plan.explored
    probed = [new[0], dataclasses.replace(new[1], has_mask=True)]
    assert controller.plan(probed, self_budget=4, draining=True).self_length > 0


def test_one_row_drafts_alike_draining_or_not():
    controller = trained(t0=0.25, t1=0.01, self_step=0.05, lookup_rate=0.7, self_rate=0.9)
    for offers in (closed(lookup_rows(4), [30]), closed(self_rows(1), [30])):
        assert controller.plan(offers, self_budget=4, draining=True) == controller.plan(offers, self_budget=4)


def test_lookup_acceptance_is_learned_per_request():
    controller = trained(t0=0.25, t1=0.03, self_step=0.5, lookup_rate=0.6, self_rate=0.5)
    for _ in range(30):
        controller.observe_draft("r0", "lookup", 4, 4)  # copies its context well
        controller.observe_draft("r1", "lookup", 4, 0)  # does not
    plan = controller.plan(lookup_rows(4, 4), self_budget=0)
    assert plan.lookup_lengths[0] == 4 and plan.lookup_lengths[1] == 0
    controller.forget("r1")
    assert controller.acceptance.lookup_rate("r1") == controller.acceptance.rates[DraftSource.LOOKUP].rate


SURE = dict(lookup_tokens=4, lookup_probs=(0.9, 0.9, 0.9, 0.9), lookup_match=12)  # long, unanimous match
WEAK = dict(lookup_tokens=1, lookup_probs=(0.5,), lookup_match=1)  # one token, one earlier occurrence


def with_learned_bins(controller):
    for _ in range(40):
        controller.observe_draft("x", "lookup", 4, 4, controller.calibration(RowOffer(**SURE)))
        controller.observe_draft("y", "lookup", 1, 0, controller.calibration(RowOffer(**WEAK)))
    return controller


def test_lookup_tokens_are_priced_by_how_sure_their_match_is():
    controller = with_learned_bins(trained(t0=0.25, t1=0.03, self_step=0.5, lookup_rate=0.6, self_rate=0.5))
    sure, weak = RowOffer("a", **SURE), RowOffer("b", **WEAK)
    assert controller.acceptance.lookup_gains(sure)[-1] > 0.9 and controller.acceptance.lookup_gains(weak)[0] < 0.1
    assert controller.plan([sure, weak], self_budget=0).lookup_lengths == [4, 0]


def test_rates_learned_on_greedy_rows_do_not_price_sampled_rows():
    """Measured on Qwen, batch 32, temperature 1: bins learned at temperature 0 made sampled
    rows draft tokens that half failed, and the cell ran at 0.85x."""
    controller = with_learned_bins(trained(t0=0.25, t1=0.03, self_step=0.5, lookup_rate=0.6, self_rate=0.5))
    for _ in range(40):
        controller.observe_draft("z", "lookup", 4, 0, controller.calibration(RowOffer(sampled=True, **SURE)))
    greedy, sampled = RowOffer("a", **SURE), RowOffer("b", sampled=True, **SURE)
    assert controller.acceptance.lookup_gains(greedy)[0] > 0.9 and controller.acceptance.lookup_gains(sampled)[0] < 0.1


def test_each_row_drafts_from_the_source_it_trusts_more():
    controller = with_learned_bins(trained(t0=0.25, t1=0.01, self_step=0.01, lookup_rate=0.9, self_rate=0.9))
    plan = controller.plan(
        [RowOffer("a", can_self_draft=True, **SURE), RowOffer("b", can_self_draft=True, **WEAK)], self_budget=4
    )
    assert (plan.lookup_lengths, plan.self_rows, plan.self_length) == ([4, 0], [False, True], 4)


def test_a_row_keeps_its_lookup_draft_when_self_drafting_does_not_pay():
    """Measured on Qwen at batch 1: rows whose lookup drafts were less likely than a self-draft
    were set aside for self-drafting, which cost about a full step and so was not made; those
    rows then drafted nothing at all."""
    controller = trained(t0=0.25, t1=0.01, self_step=0.3, lookup_rate=0.5, self_rate=0.9)
    offer = RowOffer("b", lookup_tokens=2, can_self_draft=True, lookup_probs=(0.5, 0.5), lookup_match=2)
    plan = controller.plan([offer], self_budget=4)
    assert (plan.lookup_lengths, plan.self_rows, plan.self_length) == ([2], [False], 0)


def test_an_unused_source_is_retried_with_back_off():
    # A self-draft step of 0.1 s could pay if its tokens were accepted: it is retried.
    controller = trained(t0=0.25, t1=0.02, self_step=0.1, lookup_rate=0.8, self_rate=0.2)
    retries = [i for i in range(200) if controller.plan(self_rows(1), 4).explored]
    assert retries[:3] == [15, 47, 111]  # after 16, then 32, then 64 idle steps


def test_a_retry_must_be_able_to_pay_back_its_probe():
    """Batch 1 on this CPU: a draft step at 0.84 of a target step could pay, at best 0.04 s a
    token; a retry that needs a 0.57 s probe is not worth it near a request's end, one that
    reuses a mask is."""
    controller = trained(t0=0.24, t1=0.015, self_step=0.2, lookup_rate=0.8, self_rate=0.2)
    controller.observe_probe(rows=2, seconds=1.14)
    assert controller.costs.probe_seconds == pytest.approx(0.57)

    def retries(**offer):
        row = [dataclasses.replace(self_rows(1)[0], **offer)]
        return sum(controller.plan(row, 4).explored for _ in range(200))

    assert retries(remaining=40) > 0  # at best 1.3 s saved
    assert retries(remaining=10) == 0  # at best 0.3 s
    assert retries(remaining=10, has_mask=True) > 0
    assert retries(remaining=None) > 0


def test_a_new_request_is_probed_only_if_self_drafting_wins_its_probe_back():
    """In a server every request is new once: a 3 s probe (prefill-sized) is not paid for a
    request with 10 tokens left, though self-drafts pay per step; a probed one drafts."""
    controller = trained(t0=0.25, t1=0.01, self_step=0.02, lookup_rate=0.9, self_rate=0.9)
    controller.observe_probe(rows=1, seconds=3.0)

    def plan(**offer):
        return controller.plan([dataclasses.replace(self_rows(1)[0], **offer)], self_budget=4)

    assert plan(remaining=10).self_length == 0
    assert plan(remaining=10, has_mask=True).self_length == 4
    assert plan(remaining=400).self_length == 4 and plan(remaining=None).self_length == 4
    mixed = controller.plan(
        [dataclasses.replace(o, remaining=10, has_mask=i == 0) for i, o in enumerate(self_rows(2))], self_budget=4
    )
    assert mixed.self_rows == [True, False] and mixed.self_length == 4


def test_a_fresh_servers_first_retry_is_priced_by_the_probe_its_warm_up_timed():
    """A fresh server has timed no self-draft step and run no probe in earnest, so its first
    retry's probe was priced at nothing: the per-row rule let the retry through once the rows had
    banked its verification, and every row then waited for the probe. The warm-up's timed probe
    (`StepLessons.warm_up_probed`) prices it: a probe of four steps waits until every row has
    banked that much, and is made then."""
    from vllm_selfspec.control.step_costs import self_step_cost

    def first_retry(warm_up_probe):
        controller = trained(t0=0.25, t1=0.01, self_step=0.1, lookup_rate=0.8, self_rate=0.2, protect_rows=True)
        controller.costs.self_step = self_step_cost()  # (no retry has timed one yet)
        if warm_up_probe is not None:
            controller.observe_probe(rows=1, seconds=warm_up_probe)
        rows = self_rows(2)
        for step in range(400):
            if controller.plan(rows, 4).explored:
                return step
            controller.planner.ledger.settle({row.req_id: 0 for row in rows})
        return None

    assert first_retry(None) < 32  # (due after 16 steps)
    assert 150 < first_retry(1.0) < 400  # (2% of a 0.27 s step banked a step, towards 1 s)


def test_the_warm_up_prices_probes_only_until_one_runs_in_earnest():
    """The warm-up's probe is of one prompt, whatever the workload's: the first probe in earnest
    replaces its price, later ones average in; a warm-up timed again never replaces theirs."""
    from vllm_selfspec.control.step_costs import StepCostModel

    costs = StepCostModel()
    costs.observe_probe(1, 1.0, provisional=True)
    assert costs.probe_seconds == 1.0
    costs.observe_probe(2, 0.4)
    assert costs.probe_seconds == pytest.approx(0.2)
    costs.observe_probe(1, 0.4)
    assert costs.probe_seconds == pytest.approx(0.7 * 0.2 + 0.3 * 0.4)
    costs.observe_probe(1, 5.0, provisional=True)
    assert costs.probe_seconds == pytest.approx(0.26)


def test_a_retry_drafts_with_the_rows_that_have_a_mask_or_else_one_new_row():
    controller = trained(t0=0.25, t1=0.02, self_step=0.1, lookup_rate=0.8, self_rate=0.2)
    rows = [dataclasses.replace(o, has_mask=i == 1) for i, o in enumerate(self_rows(3))]
    retry = next(p for p in (controller.plan(rows, 4) for _ in range(50)) if p.explored)
    assert retry.self_rows == [False, True, False] and retry.self_length == 1
    retry = next(p for p in (controller.plan(self_rows(3), 4) for _ in range(100)) if p.explored)
    assert retry.self_rows == [True, False, False]


def test_a_due_retry_is_made_only_if_it_pays_and_fits_every_rows_room():
    """A retry that could pay back its draft step is made only within the room the per-row rule
    leaves (`room()`), and one that could not pay is never made, whatever the room."""
    from types import SimpleNamespace

    from vllm_selfspec.control.planner import Choice, make_retry

    offers = StepOffers.of([dataclasses.replace(o, has_mask=True) for o in self_rows(2)])
    costs = SimpleNamespace(self_step_measured=True, probe_seconds=None, self_step_seconds=lambda rows: 0.001)
    step, cost = SimpleNamespace(t_verify=0.0005), [0.0001, 0.0001]  # (seconds a verified token, a row each)
    retry_seconds = 0.001 + 2 * 0.0001 + 0.0005  # a draft step, both rows' verification, t_verify

    def retried(room, best_saving=1.0):
        choice = Choice([0, 0], tokens=2.0, seconds=0.01, best_self_saving=best_saving)
        made = make_retry(costs, offers, [0, 1], choice, 8, cost, step, room=room)
        assert made == (choice.self_length == 1)
        return made and choice.self_rows == {0, 1} and choice.seconds == pytest.approx(0.01 + retry_seconds)

    assert retried(room=None) and retried(room=lambda: retry_seconds * 1.01)
    assert not retried(room=lambda: retry_seconds * 0.99)
    assert not retried(room=None, best_saving=0.0) and not retried(room=lambda: 1.0, best_saving=0.0)


def test_before_costs_are_known_only_free_drafts_are_made():
    """Lookup drafts need no forward pass; self-drafts wait until their cost can be judged."""
    plan = DraftController().plan(lookup_rows(2, 4) + self_rows(1), self_budget=3)
    assert plan.lookup_lengths == [2, 4, 0] and plan.self_length == 0


def test_head_ids_map_draft_columns_back_to_token_ids():
    import torch

    from vllm_selfspec.self_drafting.residual_stream import HeadIds

    head = torch.randn(50, 8)
    ids = HeadIds(head, num_first=10, extra=torch.tensor([17, 42]))
    h = torch.randn(3, 8)
    logits = torch.cat([h @ head[:10].T, h @ head[[17, 42]].T], dim=-1)
    assert ids.token_ids(torch.tensor([3, 10, 11])).tolist() == [3, 17, 42]
    # Restricted to the same ids, the truncated head picks what the full head picks.
    full = h @ head.T
    allowed = torch.tensor(list(range(10)) + [17, 42])
    expected = allowed[full[:, allowed].argmax(-1)]
    assert torch.equal(ids.token_ids(logits.argmax(-1)), expected)


def test_history_pools_are_per_tenant_and_bounded_in_all():
    from vllm_selfspec.sources.lookup import TenantHistories

    histories = TenantHistories(max_tokens=1000, max_tenants=1000, share_unsalted=True)
    for tenant in ("a", None):
        histories.add(tenant, np.array([8, 9, 10, 11]))
    assert histories.pool("b") is None
    assert histories.pool("a").draft(np.array([5, 8, 9]), 3, 24).tokens.tolist() == [10, 11]
    rng = np.random.default_rng(0)
    for i in range(5000):  # thousands of requests from hundreds of tenants
        histories.add(f"t{i % 300}", rng.integers(0, 1000, size=rng.integers(1, 60)))
        assert len(histories) <= 1000
    assert len(histories) > 900  # full, not emptied
    assert histories.pool("a") is None and histories.pool("t199") is not None


def test_the_step_cost_model_remembers_a_bounded_number_of_step_shapes():
    from vllm_selfspec.control.step_costs import MAX_SHAPES_REMEMBERED, StepCostModel

    costs = StepCostModel()
    for rows in range(MAX_SHAPES_REMEMBERED + 100):
        costs.observe_step(0, rows + 1, 0, 0.01 + 1e-5 * rows)
    assert len(costs._shapes_seen) == MAX_SHAPES_REMEMBERED
    assert (MAX_SHAPES_REMEMBERED + 100, 0, 0) in costs._shapes_seen and (1, 0, 0) not in costs._shapes_seen


def test_lookup_stops_when_it_costs_more_than_its_accepted_tokens_save_and_is_retried():
    from vllm_selfspec.control.lookup_gate import FIRST_RETRY_AFTER, MIN_ROW_LOOKUPS, LookupGate

    gate = LookupGate()
    seconds_per_token = 0.010
    gate.observe_lookup(MIN_ROW_LOOKUPS // 2, 0.5)
    assert gate.open(seconds_per_token)  # too few lookups measured to close
    # Lookups that took 5 ms a row and found nothing accepted: closed, retried after a back-off.
    for _ in range(20):
        gate.observe_lookup(8, 0.040)
    assert not gate.pays(seconds_per_token)
    decisions = [gate.open(seconds_per_token) for _ in range(FIRST_RETRY_AFTER)]
    assert decisions == [False] * (FIRST_RETRY_AFTER - 1) + [True]
    # A retry measures afresh: open until enough lookups are measured, closed again if they still
    # cost more, and retried after twice as long.
    retried = 0
    while gate.open(seconds_per_token):
        gate.observe_lookup(8, 0.040)
        retried += 1
    assert retried == MIN_ROW_LOOKUPS // 8
    decisions = [gate.open(seconds_per_token) for _ in range(2 * FIRST_RETRY_AFTER)]
    assert decisions.index(True) == 2 * FIRST_RETRY_AFTER - 2  # (the loop's last call was the first)
    # Accepted tokens worth more than the lookups' time keep it open.
    for _ in range(MIN_ROW_LOOKUPS // 8):
        gate.observe_lookup(8, 0.040)
        gate.observe_accepted(5)
    assert gate.pays(seconds_per_token) and gate.open(seconds_per_token)
    # Cheap lookups pay with few accepted tokens.
    cheap = LookupGate()
    for _ in range(20):
        cheap.observe_lookup(8, 0.0004)
        cheap.observe_accepted(1)
    assert cheap.open(seconds_per_token)


def naive_histories(max_tokens: int, max_tenants: int, adds) -> dict:
    """The pools TenantHistories should hold, by the rule itself: every output kept per tenant
    with its separator; tenants with one output are newcomers, the rest returning (at most 3/4
    of the pools, the least recently used demoted to the newest newcomer); room is taken from
    the least recently used other newcomer, then from the tenant just added to if it is a
    newcomer, then from the least recently used other returning tenant; the tenant bound drops
    whole pools, the token bound the oldest outputs."""
    from collections import OrderedDict

    newcomers: OrderedDict = OrderedDict()
    returning: OrderedDict = OrderedDict()
    size = lambda outs: sum(len(o) + 1 for o in outs) + 1  # noqa: E731
    total = lambda: sum(size(o) for seg in (newcomers, returning) for o in seg.values())  # noqa: E731
    for tenant, output in adds:
        if tenant in returning or tenant in newcomers:
            outputs = returning.pop(tenant) if tenant in returning else newcomers.pop(tenant)
            segment = returning
        else:
            outputs, segment = [], newcomers
        outputs = [*outputs, list(output)]
        while size(outputs) > max_tokens and outputs:  # a pool never holds more than the whole budget
            outputs.pop(0)
        segment[tenant] = outputs
        while len(returning) > max(1, int(0.75 * max_tenants)):
            demoted, outs = returning.popitem(last=False)
            newcomers[demoted] = outs  # as the newest newcomer

        def victim(spared=tenant):
            others = [t for t in newcomers if t != spared]
            if others:
                return newcomers, others[0]
            if spared in newcomers:
                return newcomers, spared
            others = [t for t in returning if t != spared]
            return (returning, others[0]) if others else (returning, spared)

        while len(newcomers) + len(returning) > max_tenants:
            seg, t = victim()
            del seg[t]
        while total() > max_tokens and (newcomers or returning):
            seg, t = victim()
            excess = total() - max_tokens
            while excess > 0 and seg[t]:
                excess -= len(seg[t].pop(0)) + 1
            if not seg[t]:
                del seg[t]
    pools = {**newcomers, **returning}
    return {t: [SEPARATOR] + [x for o in outs for x in [*o, SEPARATOR]] for t, outs in pools.items()}


def test_tenant_histories_keep_what_the_rule_says_and_drop_cheaply():
    from vllm_selfspec.sources.lookup import TenantHistories

    rng = np.random.default_rng(3)
    for trial in range(200):
        max_tokens, max_tenants = int(rng.integers(5, 60)), int(rng.integers(1, 6))
        adds = [
            (int(rng.integers(0, 6)) if rng.random() < 0.8 else None, rng.integers(0, 9, int(rng.integers(0, 12))))
            for _ in range(int(rng.integers(1, 30)))
        ]
        histories = TenantHistories(max_tokens, max_tenants=max_tenants, share_unsalted=True)
        for tenant, output in adds:
            histories.add(tenant, output)
        want = naive_histories(max_tokens, max_tenants, adds)
        got = {t: histories.pool(t).tokens.tolist() for t in want}
        assert got == want and histories.tenants == len(want), (trial, max_tokens, max_tenants)
        pools = [*histories.newcomers.values(), *histories.returning.values()]
        assert len(histories) == sum(len(p) for p in pools) <= max_tokens
    # One tenant's many one-token outputs, then another tenant's long output: the eviction drops
    # thousands of outputs with one slice (a scan per dropped output took a third of a second).
    histories = TenantHistories(65_536)
    for _ in range(30_000):
        histories.add("many", np.array([1]))
    histories.add("long", np.array([2]))  # a returning tenant, whom room is made for
    histories.add("long", np.arange(60_000))
    assert len(histories) <= 65_536 and histories.pool("long").tokens[-60_001:-1].tolist() == list(range(60_000))


def test_at_capacity_sure_drafts_are_kept_for_every_row_that_has_one():
    """Eight rows with near-certain drafts (a prediction each), one short, one weaker: the
    margin leaves the weaker row without a draft, where it would allow only the slack, so it
    takes its own tokens instead of having everyone's given back; and tokens are given back
    from the rows that can spare them (a row's last token taken back lowers what it allows far
    more than the step shortens). Measured costs of Qwen2.5-Coder-1.5B at batch 8."""
    controller = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    sure = dict(lookup_tokens=8, lookup_probs=(0.999,) * 8)
    offers = [RowOffer("short", lookup_tokens=2, lookup_probs=(0.999, 0.95))]
    offers += [RowOffer(f"edit{i}", **sure) for i in range(6)]
    offers += [RowOffer("weaker", lookup_tokens=8, lookup_probs=tuple(0.9**j for j in range(1, 9)))]
    with_history(controller, [o.req_id for o in offers], drafted=8, accepted=8)
    protected = controller.plan(offers, self_budget=0).lookup_lengths
    controller.planner.protect_rows = False
    free = controller.plan(offers, self_budget=0).lookup_lengths
    assert free[-1] == 0 and protected[-1] > 0
    assert all(protected) and sum(protected) >= 0.7 * sum(free)


def test_every_plan_leaves_every_row_its_due_whatever_the_offers_and_the_ledger():
    """The per-row rule as a property, checked apart from the planner's own arithmetic: over
    random batches of sure, weak, short, new and trusted rows, lookups and predictions, some
    ahead of their pace and some behind, every plan leaves each row i (1 + g_i) / t_i >=
    (1 - ROW_SLACK) / t_plain, with what it carries added (or is no plan at all)."""
    import random

    rng = random.Random(0)
    controller = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.9, self_rate=0.9, protect_rows=True)
    with_history(controller, [f"old{i}" for i in range(4)], drafted=8, accepted=6)
    for step in range(300):
        offers = []
        for i in range(rng.randint(2, 12)):
            n = rng.choice([0, 0, 1, 3, 8])
            probs = tuple(rng.choice([0.999, 0.9, 0.5, 0.2]) ** j for j in range(1, n + 1))
            req_id = rng.choice(["old", "new"]) + str(i)
            if rng.random() < 0.25:  # a prediction: no probabilities, its run as its match
                offer = RowOffer(
                    req_id, lookup_tokens=n, lookup_source="prediction", lookup_match=rng.choice([0, 3, 12])
                )
            else:
                offer = RowOffer(req_id, lookup_tokens=n, lookup_probs=probs)
            offers.append(offer)
        plan = controller.plan(offers, self_budget=0)
        ledger, acceptance = controller.planner.ledger, controller.acceptance
        target = controller.costs.target()
        cost = [target.t_row + target.t_context * o.context / 1000 for o in offers]
        t_plain = target.t0 + sum(cost)
        ahead = ledger.ahead([o.req_id for o in offers])
        credited = [
            sum(acceptance.lookup_gains(o)[:n]) if acceptance.trusted(o) and a >= 0 else 0.0
            for o, n, a in zip(offers, plan.lookup_lengths, ahead)
        ]
        assert_every_row_left_its_due(
            plan.lookup_lengths,
            cost=cost,
            t_plain=t_plain,
            t_verify=target.t_verify,
            credited=credited,
            ahead=ahead,
            context=step,
        )
        settle(controller, {o.req_id: rng.randint(0, n) for o, n in zip(offers, plan.lookup_lengths)})


def test_the_plans_skipped_as_known_are_the_plans_the_greedy_makes(monkeypatch):
    """Two shortcuts skip a greedy plan whose outcome is known: the lookup plan when every lookup
    token would leave some row short (`every_lookup_token_binds`), the self-draft plan when its
    first token cannot beat the starting rate (`self_draft_may_pay`). Both are exact: over random
    batches of new and trusted rows, greedy and sampled (tokens of different prices), ahead of
    their pace and behind, with and without drafts and self-drafts, and a verification cost of
    its own, each plan is the one made without them; and each decides both ways, often."""
    import copy
    import random

    from vllm_selfspec.control import planner as planner_module

    rng = random.Random(1)
    controller = trained(
        t0=0.05, t1=0.0035, self_step=0.004, lookup_rate=0.9, self_rate=0.9, t_sampled=0.003, t_verify=0.004
    )
    controller.planner.protect_rows = True
    # (the planner's Python path, where the shortcuts are functions; the compiled plan is held
    # to it: test_the_compiled_plan_is_the_plan_python_makes)
    controller.planner.compiled_lookup_plan = False
    with_history(controller, [f"old{i}" for i in range(4)], drafted=8, accepted=6)
    taken = {"every_lookup_token_binds": [], "self_draft_may_pay": []}
    for name, calls in taken.items():
        shortcut = getattr(planner_module, name)
        monkeypatch.setattr(planner_module, name, lambda *a, f=shortcut, c=calls: c.append(f(*a)) or c[-1])
    for step in range(400):
        offers, every_row_offers = [], rng.random() < 0.5  # (a row without a draft mostly binds)
        for i in range(rng.randint(2, 12)):
            n = rng.choice([1, 3, 8] if every_row_offers else [0, 0, 1, 3, 8])
            probs = tuple(rng.choice([0.999, 0.9, 0.5, 0.2]) ** j for j in range(1, n + 1))
            name = rng.choice(["old", "new"]) + str(i)
            offers.append(
                RowOffer(
                    name,
                    lookup_tokens=n,
                    lookup_probs=probs,
                    sampled=rng.random() < 0.5,
                    can_self_draft=rng.random() < 0.3,
                )
            )
        without, budget = copy.deepcopy(controller), rng.choice([0, 4])
        with monkeypatch.context() as off:
            off.setattr(planner_module, "every_lookup_token_binds", lambda *a: False)
            off.setattr(planner_module, "self_draft_may_pay", lambda *a: True)
            expected = without.plan(offers, self_budget=budget)
        assert controller.plan(offers, self_budget=budget) == expected, step
        settle(controller, {o.req_id: rng.randint(0, n) for o, n in zip(offers, expected.lookup_lengths)})
    for calls in taken.values():
        assert 0.1 < sum(calls) / len(calls) < 0.9
    # It stands for the lookup plan only: a new row without a lookup draft binds every lookup
    # token, but may still draft with the model itself beside a row ahead of its pace.
    sure = [RowOffer(name, lookup_tokens=8, lookup_probs=(0.999,) * 8) for name in ("ahead", "other")]
    with_history(controller, ["ahead", "other"], drafted=8, accepted=8)
    for _ in range(6):
        settle(controller, dict(zip(["ahead", "other"], controller.plan(sure, self_budget=0).lookup_lengths)))
    plan = controller.plan([RowOffer("new", can_self_draft=True), RowOffer("ahead")], self_budget=4)
    assert plan.self_length == 4 and plan.self_rows == [True, False]


def test_the_lookup_plan_is_skipped_only_where_the_greedy_would_keep_no_token():
    """`every_lookup_token_binds` against the greedy plan held to the per-row rule, on random
    rows (trusted or not, ahead of their pace or behind, tokens of different prices, with and
    without verification's fixed cost): where it says every token binds, the greedy keeps
    none; and it says so, and the greedy drafts, often. And the greedy leaves every row its due."""
    import itertools
    import random

    from vllm_selfspec.control.planner import RowDue, every_lookup_token_binds

    rng = random.Random(2)
    planner = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.9, self_rate=0.9).planner
    skipped = drafted = behind_drafting = 0
    for _ in range(6000):
        offers = [RowOffer(f"r{i}", lookup_tokens=rng.choice([0, 0, 1, 3, 8])) for i in range(rng.randint(2, 10))]
        cost = [rng.uniform(0.001, 0.01) for _ in offers]
        gains = [
            list(itertools.accumulate([rng.uniform(0.5, 0.999)] * o.lookup_tokens, lambda g, a: g * a)) for o in offers
        ]
        t_plain, t_verify = 0.05 + sum(cost), rng.choice([0.0, 0.004])
        due = RowDue(
            t_plain,
            t_verify,
            trusted=np.array([rng.random() < 0.5 for _ in offers], dtype=bool),
            ahead=np.array([rng.choice([-0.002, 0.0, 0.002, 0.004, 0.006, 0.02]) for _ in offers], dtype=float),
        )
        step = StepOffers.of(offers)
        plan = planner._greedy(step, gain_table(gains), cost, (len(offers), t_plain + t_verify), protected=due)
        if every_lookup_token_binds(due, step, cost):
            skipped += 1
            assert sum(plan.lookup_lengths) == 0, (due, cost, [o.lookup_tokens for o in offers])
        drafted += sum(plan.lookup_lengths) > 0
        # And the greedy held to the rule leaves every row its due, rows behind among them.
        assert_every_row_left_its_due(
            plan.lookup_lengths,
            cost=cost,
            t_plain=t_plain,
            t_verify=t_verify,
            credited=[t * sum(g[:n]) for t, g, n in zip(due.trusted, gains, plan.lookup_lengths)],
            ahead=due.ahead,
        )
        behind_drafting += sum(bool(n) and a < 0 for n, a in zip(plan.lookup_lengths, due.ahead))
    assert skipped > 300 and drafted > 300 and behind_drafting > 100


def test_the_ledger_settles_a_step_only_as_it_ran():
    """`StepLessons.learn` settles the per-row ledger only when the planned drafts were verified
    whole: a step whose drafts the scheduler withheld (beside a prefill) or cut short, or whose
    drafts were not made, cost what a plain step does and settles nothing."""
    from types import SimpleNamespace

    from vllm_selfspec.control.learning import StepLessons
    from vllm_selfspec.operations.counters import ProposerCounters
    from vllm_selfspec.vllm_integration.runner_state import StepRows

    controller = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.95, self_rate=0.9, protect_rows=True)
    offers = [RowOffer(f"r{i}", lookup_tokens=4, lookup_probs=(0.999,) * 4) for i in range(2)]
    with_history(controller, ["r0", "r1"])
    lessons = StepLessons(controller, ProposerCounters())
    rows = [SimpleNamespace(req_id=o.req_id, index=i) for i, o in enumerate(offers)]

    def run_step(verified: int, made: bool = True) -> list[float]:
        plan = controller.plan(offers, self_budget=0)
        assert plan.lookup_lengths == [4, 4] and controller.planner.ledger.planned is not None
        lessons.note_step()
        step_offers = StepOffers.of(offers)
        prepared = SimpleNamespace(offers=step_offers, gains=controller.acceptance.step_gains(step_offers))
        lessons.lookup_drafts_taken(prepared, [0, 1], plan.lookup_lengths)
        lessons.step_ended(drafted=made)
        lessons.call_ended()
        lessons.note_step()
        step = SimpleNamespace(
            rows=StepRows.of(rows),
            shape=lambda: None,
            engine_was_busy=True,
            verified_draft_tokens=lambda req_id: verified,
            accepted=lambda index: verified,
        )
        lessons.learn(step)
        return controller.planner.ledger.ahead(["r0", "r1"])

    assert run_step(verified=4) > [0.0, 0.0]  # as planned, every token accepted: ahead
    settled = controller.planner.ledger.ahead(["r0", "r1"])
    assert run_step(verified=0) == settled  # withheld
    assert run_step(verified=2) == settled  # cut short
    assert run_step(verified=4, made=False) == settled  # not made (a fault, or the ranks disagreed)
    assert run_step(verified=4) > settled


def test_a_steps_self_drafts_are_learned_with_its_lookup_drafts_in_the_steps_row_order():
    """`StepLessons`: a step's lookup drafts and self-drafts, learned once verified, as each
    draft alone in the order of the rows that verified them (`reference.LearningByObjects`); a
    row that self-drafted after its lookup draft was taken is learned as a self-draft only."""
    from types import SimpleNamespace

    from vllm_selfspec.control.learning import StepLessons
    from vllm_selfspec.operations.counters import ProposerCounters
    from vllm_selfspec.vllm_integration.runner_state import StepRows

    from reference import LearningByObjects

    controller = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.95, self_rate=0.9)
    controller.acceptance.rates[DraftSource.SELF] = AcceptanceRate(prior=0.9)  # (fading: the order counts)
    reference = LearningByObjects()
    reference.rates = {s: dataclasses.replace(r) for s, r in controller.acceptance.rates.items()}
    offers = [RowOffer(f"r{i}", lookup_tokens=4, lookup_probs=(0.9, 0.8, 0.5, 0.5)) for i in range(3)]
    lessons = StepLessons(controller, ProposerCounters())
    step_offers = StepOffers.of(offers)
    gains = controller.acceptance.step_gains(step_offers)
    lessons.note_step()
    lessons.lookup_drafts_taken(SimpleNamespace(offers=step_offers, gains=gains), [0, 2], [4, 3])
    lessons.self_drafted("r3", 2)
    lessons.self_drafted("r2", 4)  # (in place of its lookup draft)
    lessons.step_ended(drafted=True)
    lessons.call_ended()
    lessons.note_step()
    # The rows moved in the batch: r2 first, then r0, r3.
    rows = [SimpleNamespace(req_id=r, index=i) for i, r in enumerate(["r2", "r0", "r1", "r3"])]
    accepted = {"r3": 1, "r0": 3, "r1": 0, "r2": 4}
    step = SimpleNamespace(
        rows=StepRows.of(rows),
        shape=lambda: None,
        engine_was_busy=True,
        verified_draft_tokens=lambda req_id: {"r3": 2, "r0": 4, "r2": 4}.get(req_id, 0),
        accepted=lambda index: accepted[rows[index].req_id],
    )
    lessons.learn(step)
    no_bins = SimpleNamespace(bins=np.zeros(0, dtype=np.int64), priors=np.zeros(0))
    reference.observe("r2", DraftSource.SELF, 4, 4, no_bins, 0.0)
    calibration = SimpleNamespace(bins=gains.bins[0, :4], priors=gains.priors[0, :4])
    reference.observe("r0", DraftSource.LOOKUP, 4, 3, calibration, float(sum(gains.estimated[0, :4])))
    reference.observe("r3", DraftSource.SELF, 2, 1, no_bins, 0.0)
    assert {s: r.rate for s, r in controller.acceptance.rates.items()} == {
        s: r.rate for s, r in reference.rates.items()
    }
    assert controller.acceptance.requests.rate("r0", 0) == reference.by_request[("r0", DraftSource.LOOKUP)].rate
    assert controller.acceptance.requests.rate("r2", 0) is None  # (its lookup draft was not what ran)
    assert lessons.counters.lookup_accepted == 3 and lessons.counters.lookup_tokens == 7


def test_the_compiled_lookup_plan_is_the_plan_python_makes():
    """The compiled kernel (`control.lookup_plan`) against the planner's token-by-token Python
    path, on random batches: gains tied across rows and depths, rows trusted or not, ahead or
    behind, with and without the per-row rule and a step-length cap. The same lengths, tokens
    and seconds to the last bit; and the batches draft, and make the per-row rule give back."""
    import itertools
    import random

    from vllm_selfspec.control.planner import RowDue

    rng = random.Random(11)
    planner = trained(t0=0.05, t1=0.0035, self_step=0.02, lookup_rate=0.9, self_rate=0.9).planner
    compared = drafted = given_back = 0
    for _ in range(4000):
        offers = [RowOffer(f"r{i}", lookup_tokens=rng.choice([0, 1, 2, 4, 8])) for i in range(rng.randint(1, 40))]
        step = StepOffers.of(offers)
        cost = [rng.choice([0.001, 0.002, rng.uniform(0.0005, 0.01)]) for _ in offers]
        gains = np.zeros((len(offers), 8))  # (a step's table, `AcceptanceModel.step_gains`)
        for i, o in enumerate(offers):
            each = [rng.choice([0.5, 0.9, rng.uniform(0.3, 0.999)])] * o.lookup_tokens
            gains[i, : o.lookup_tokens] = list(itertools.accumulate(each, lambda g, a: g * a))
        t_plain, t_verify = rng.uniform(0.01, 0.06) + sum(cost), rng.choice([0.0, 0.004])
        due = RowDue(
            t_plain,
            t_verify,
            trusted=np.array([rng.random() < 0.7 for _ in offers], dtype=bool),
            ahead=np.array([rng.choice([-0.002, 0.0, 0.002, 0.004, 0.02]) for _ in offers], dtype=float),
        )
        protected = due if rng.random() < 0.8 else None
        max_seconds = rng.choice([math.inf, (t_plain + t_verify) * 1.05])
        start = (float(len(offers)), t_plain + t_verify)
        made = []
        for compiled in (True, False):
            planner.compiled_lookup_plan = compiled
            choice = planner._greedy(step, gains, cost, start, max_seconds=max_seconds, protected=protected)
            made.append((choice.lookup_lengths, choice.tokens, choice.seconds, choice.self_length))
        planner.compiled_lookup_plan = True
        assert made[0] == made[1], (offers, gains, cost, due, protected is not None, max_seconds)
        compared += 1
        drafted += sum(made[0][0]) > 0
        # (a plan held to the rule that keeps fewer tokens than the greedy alone took gave some back)
        if protected is not None:
            planner.compiled_lookup_plan = False
            greedy_alone = planner._greedy(step, gains, cost, start, max_seconds=max_seconds)
            planner.compiled_lookup_plan = True
            given_back += sum(greedy_alone.lookup_lengths) > sum(made[0][0]) > 0
    assert compared == 4000 and drafted > 1000 and given_back > 100, (drafted, given_back)


def test_the_compiled_plan_is_the_plan_python_makes():
    """A step's plan laid out by one compiled call (`lookup_plan.steady_lookup_plan`: prices,
    plain's step, the rows that would rather self-draft, trust, due, the shortcut, the greedy)
    against the planner's Python path, over steps of random batches: rows new and trusted,
    ahead of their pace and behind, greedy and sampled, short and long contexts, lookup drafts
    and predictions, may self-draft or not, probed or not; with prompts waiting, draining, the
    per-row rule on and off. Every layout to the last bit, every plan alike, and the steps
    cover each outcome of the layout."""
    import dataclasses
    import random

    from vllm_selfspec.control.planner import EVERY_TOKEN_BINDS, MADE, NOT_MADE

    rng = random.Random(5)
    controllers = {}
    for compiled in (True, False):
        controller = trained(
            t0=0.05, t1=0.0035, self_step=0.004, lookup_rate=0.9, self_rate=0.9, t_sampled=0.003, t_verify=0.004
        )
        controller.observe_step(0, 4, 0, 0.07, context_read=9000)  # (a price per context token)
        controller.planner.compiled_lookup_plan = compiled
        controllers[compiled] = controller
    for controller in controllers.values():
        with_history(controller, [f"old{i}" for i in range(6)], drafted=8, accepted=6)
    outcomes, self_drafted, trusted_by_bins = {NOT_MADE: 0, MADE: 0, EVERY_TOKEN_BINDS: 0}, 0, 0
    for step in range(600):
        offers = []
        for i in range(rng.randint(1, 14)):
            n = rng.choice([0, 0, 1, 3, 8])
            predicted = n and rng.random() < 0.2
            offers.append(
                RowOffer(
                    rng.choice(["old", "new"]) + str(i),
                    lookup_tokens=n,
                    lookup_source=DraftSource.PREDICTION if predicted else DraftSource.LOOKUP,
                    lookup_probs=() if predicted else tuple(rng.choice([0.999, 0.9, 0.5, 0.2]) for _ in range(n)),
                    lookup_match=rng.choice([1, 4, 24]),
                    sampled=rng.random() < 0.4,
                    can_self_draft=rng.random() < 0.4,
                    has_mask=rng.random() < 0.5,
                    remaining=rng.choice([None, 3, 40]),
                    context=rng.choice([10, 900, 5000]),
                )
            )
        when = {"draining": rng.random() < 0.15, "prompts_waiting": rng.random() < 0.2}
        budget, protect = rng.choice([0, 4]), rng.random() < 0.8
        plans, layouts, batch = [], [], StepOffers.of(offers)
        for compiled, controller in controllers.items():
            planner = controller.planner
            planner.protect_rows = protect
            gains = controller.acceptance.step_gains(batch)
            layouts.append(planner.lay_out(batch, gains, planner.costs.target(), when["prompts_waiting"], True))
            plans.append(controller.plan(batch, self_budget=budget, gains=gains, **when))
            if compiled:  # (rows trusted by the bins their tokens fall in, not by their own drafts)
                acceptance = controller.acceptance
                own = acceptance.requests.trusted[acceptance.slots(batch, gains)]
                trusted_by_bins += int((acceptance.trusted_rows(batch, gains) & ~own).sum())
        compiled, python = (
            {k: v.tolist() if hasattr(v, "tolist") else v for k, v in x._asdict().items()} for x in layouts
        )
        if python["lookup_plan"] != MADE:  # (lengths are read only from a plan made)
            compiled["lookup_lengths"] = python["lookup_lengths"] = []
        assert compiled == python, step
        assert plans[0] == plans[1], step
        outcomes[python["lookup_plan"]] += 1
        self_drafted += plans[0].self_length > 0
        accepted = {o.req_id: rng.randint(0, n) for o, n in zip(offers, plans[0].lookup_lengths)}
        for controller in controllers.values():
            settle(controller, accepted)
        # Drafts verified in their calibration bins (of other requests: bins trust new rows).
        for o in rng.sample(offers, min(3, len(offers))):
            if o.lookup_tokens:  # (predictions too: their bins must not trust a row)
                verified = rng.randint(1, o.lookup_tokens)
                accepted_tokens = rng.randint(0, verified)
                for controller in controllers.values():
                    acceptance = controller.acceptance
                    estimated = sum(acceptance.lookup_gains(o, scaled=False))
                    bins = acceptance.calibration(o)
                    acceptance.observe_draft("other", o.lookup_source, verified, accepted_tokens, bins, estimated)
    assert min(outcomes.values()) > 25 and self_drafted > 20 and trusted_by_bins > 100, (
        outcomes,
        self_drafted,
        trusted_by_bins,
    )
    assert dataclasses.asdict(controllers[True].planner.ledger) == dataclasses.asdict(controllers[False].planner.ledger)


def test_the_compiled_plan_checks_every_index_before_it_reads():
    """The kernel reads the step's arrays in place, and numba checks no index: a slot outside
    the trust array, a bin outside the bins, gains narrower than a draft or offers of different
    lengths raise before anything is read (the fail-safe then costs the step its drafts)."""
    from vllm_selfspec.control.lookup_plan import steady_lookup_plan

    rows, offered = 3, np.array([2, 0, 1], dtype=np.int64)
    flags = np.ones(rows, dtype=bool)
    offers = (offered, flags, np.full(rows, 100, dtype=np.int64), flags, ~flags, np.full(rows, np.inf), offered)
    gains, bins = np.full((rows, 2), 0.5), np.zeros((rows, 2), dtype=np.int64)
    rule = (True, flags, np.arange(rows, dtype=np.int64), bins, np.full(4, 99, dtype=np.int64), 16, 2, np.zeros(rows))
    args = (gains, (1e-3, 1e-4, 0.0, 0.0, 1e-3), (0.5, True, False, True), (0.2, 0.02, 0.05))
    assert steady_lookup_plan(offers, *args, rule)[6] == 1  # (well formed: a plan is made)
    bad_rules = (
        rule[:2] + (np.array([0, 1, 3], dtype=np.int64),) + rule[3:],  # a slot past the trust array
        rule[:3] + (np.full((rows, 2), 4, dtype=np.int64),) + rule[4:],  # a bin past the bins
        rule[:7] + (np.zeros(2),),  # ahead of another length
    )
    for bad in bad_rules:
        with pytest.raises(IndexError):
            steady_lookup_plan(offers, *args, bad)
    with pytest.raises(IndexError):  # gains narrower than a row's draft
        steady_lookup_plan(offers, gains[:, :1].copy(), *args[1:], rule)
    with pytest.raises(IndexError):  # offers of different lengths
        steady_lookup_plan((offered, flags[:2], *offers[2:]), *args, rule)


def gain_table(rows: list[list[float]]) -> np.ndarray:
    """Rows of lookup gains as the planner takes them: a step's table, 0 past each row's draft."""
    table = np.zeros((len(rows), max(max(map(len, rows), default=0), 1)))
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


def test_a_steps_gains_at_once_are_each_offers_gains_to_the_last_bit():
    """`AcceptanceModel.step_gains` (arrays, once a step) against `lookup_gains` (one offer,
    token by token), over random offers of every source, with and without probabilities, after
    random verified drafts have taught bins, requests and the calibration; rows past their
    draft are 0. The same for the bins and priors learned from, and for which rows are trusted."""
    import random

    from vllm_selfspec.control.acceptance import AcceptanceModel, DraftSource
    from vllm_selfspec.control.request_rates import TRUSTED_AFTER_TOKENS

    rng = random.Random(5)
    sources = [DraftSource.LOOKUP, DraftSource.HISTORY, DraftSource.PREDICTION]

    def random_offer(i: int) -> RowOffer:
        source, tokens = rng.choice(sources), rng.choice([0, 1, 3, 4, 8])
        probs, p = [], 1.0
        for _ in range(tokens):
            p *= rng.choice([1.0, 0.9, 0.5, rng.uniform(0.1, 1.0)])
            probs.append(max(p, 0.1))
        with_probs = source != DraftSource.PREDICTION or rng.random() < 0.2
        return RowOffer(
            f"r{rng.randint(0, 12)}",
            lookup_tokens=tokens,
            lookup_source=source,
            sampled=rng.random() < 0.3,
            lookup_probs=tuple(probs) if with_probs else (),
            lookup_match=rng.choice([0, 1, 2, 3, 5, 9, 30]),
        )

    compared = learned = trusted_by_bins = 0
    for _ in range(300):
        acceptance, by_bin = AcceptanceModel(), {}  # (by_bin: each bin's rate as objects, the reference)
        own_tokens = {}  # (per request and source, its verified tokens: the reference for its own trust)
        offers = [random_offer(i) for i in range(rng.randint(1, 24))]
        for _ in range(rng.randint(0, 60)):
            # (drafts like the step's, of other requests or its own: they fill the same bins)
            o = dataclasses.replace(rng.choice(offers), req_id=rng.choice(["other", "r1"]))
            if rng.random() < 0.05:  # (a request ends: its own trust goes)
                acceptance.forget(o.req_id)
                own_tokens = {key: tokens for key, tokens in own_tokens.items() if key[0] != o.req_id}
            if o.lookup_tokens:
                estimated, accepted = sum(acceptance.lookup_gains(o, scaled=False)), rng.randint(0, o.lookup_tokens)
                verified = rng.randint(max(accepted, 1), o.lookup_tokens)  # (verification may cut a draft short)
                bins = acceptance.calibration(o)
                acceptance.observe_draft(o.req_id, o.lookup_source, verified, accepted, bins, estimated)
                key = (o.req_id, o.lookup_source)
                own_tokens[key] = own_tokens.get(key, 0) + verified
                for j, (token_bin, prior) in enumerate(zip(*bins)):
                    if j <= accepted and j < verified:  # (the accepted tokens and the first rejected)
                        rate = by_bin.setdefault(token_bin, AcceptanceRate(prior=min(prior, 0.999)))
                        rate.observe(1, int(j < accepted))
                learned_bins = np.flatnonzero(acceptance._bin_verified).tolist()
                assert learned_bins == sorted(by_bin)
                assert acceptance._bin_rates[learned_bins].tolist() == [by_bin[b].rate for b in learned_bins]
                assert acceptance._bin_verified[learned_bins].tolist() == [by_bin[b].verified for b in learned_bins]
                # (after every draft learned from: each bin's count crosses the threshold in turn)
                trusted = [acceptance.trusted(o) for o in offers]
                step = StepOffers.of(offers)
                assert acceptance.trusted_rows(step, acceptance.step_gains(step)).tolist() == trusted
                own = [
                    any(n >= TRUSTED_AFTER_TOKENS for (r, _), n in own_tokens.items() if r == o.req_id) for o in offers
                ]
                assert all(t for t, trusted_own in zip(trusted, own) if trusted_own)
                trusted_by_bins += sum(t and not trusted_own for t, trusted_own in zip(trusted, own))
        step = StepOffers.of(offers)
        assert step.rows == offers  # (the row-by-row paths plan from what the arrays hold)
        gains = acceptance.step_gains(step)
        for i, o in enumerate(offers):
            planned, estimated = gains.planned[i].tolist(), gains.estimated[i].tolist()
            n = o.lookup_tokens
            assert planned[:n] == acceptance.lookup_gains(o) and estimated[:n] == acceptance.lookup_gains(
                o, scaled=False
            )
            assert not any(planned[n:]) and not any(estimated[n:])
            calibration, reference = Calibration(gains.bins[i, :n], gains.priors[i, :n]), acceptance.calibration(o, n)
            assert calibration.bins.tolist() == reference.bins.tolist()
            assert calibration.priors.tolist() == reference.priors.tolist()
            compared += n > 0
        learned += len(by_bin) > 3
    assert compared > 2000 and learned > 100 and trusted_by_bins > 100, (compared, learned, trusted_by_bins)


def test_a_step_where_no_row_offers_gets_the_kernels_gains_without_calling_it(monkeypatch):
    """Where no row offers a lookup token, `step_gains` skips the kernel and reads no request's
    slot: its gains are what the kernel makes of such a step (a column of zeros, bins -1), array
    for array, and the slots are read where asked for (`AcceptanceModel.slots`)."""
    from vllm_selfspec.control import acceptance as acceptance_module
    from vllm_selfspec.control.acceptance import AGREEMENT, MATCH, SOURCES, AcceptanceModel, _lookup_gains

    acceptance = AcceptanceModel()
    for rows in (1, 5):
        step = StepOffers.of([RowOffer(f"r{i}", sampled=i % 2 == 1, lookup_match=i) for i in range(rows)])
        with monkeypatch.context() as patched:
            patched.setattr(acceptance_module, "_lookup_gains", None)  # (called, it raises)
            gains = acceptance.step_gains(step)
        assert gains.slots is None and not acceptance.requests.slot_of
        offered = (step.lookup_tokens, step.sampled, step.match, step.has_probs, step.probs)
        own = (acceptance.requests.seen, acceptance.requests.accepted, acceptance.requests.trials)
        slots = acceptance.slots(step, gains)
        assert slots.tolist() == [acceptance.requests.slot_of[f"r{i}"] for i in range(rows)]
        kernel = _lookup_gains(
            slots, (*offered, acceptance._bin_rates, AGREEMENT, MATCH), step.sources, np.ones((len(SOURCES), 2)), own
        )
        for made, expected in zip(gains[:4], kernel):
            assert made.dtype == expected.dtype and made.shape == expected.shape and np.array_equal(made, expected)
        for i in range(rows):
            acceptance.forget(f"r{i}")


def test_a_steps_drafts_learned_at_once_are_each_draft_learned_in_turn():
    """`AcceptanceModel.observe_drafts` (one kernel call a step, `request_rates.learn_verified`)
    against `reference.LearningByObjects`, draft by draft with rate objects: the bins, the
    sources' and the requests' rates, the estimates' calibration and trust, to the last bit,
    over steps whose drafts share bins and requests (the order within a step matters there),
    with requests ending (their slots given to others) and more requests than the first slots."""
    import random

    from vllm_selfspec.control.acceptance import SOURCE_INDEX, AcceptanceModel, DraftSource, VerifiedDraft

    from reference import LearningByObjects

    rng = random.Random(7)
    shared = 0
    model, reference = AcceptanceModel(), LearningByObjects()
    for _ in range(300):
        drafts = []
        for _ in range(rng.randint(0, 12)):
            source = rng.choice([DraftSource.LOOKUP, DraftSource.HISTORY, DraftSource.PREDICTION, DraftSource.SELF])
            tokens = rng.randint(1, 6)
            offer = RowOffer(
                f"r{rng.randint(0, 90)}",
                lookup_tokens=0 if source == DraftSource.SELF else tokens,
                lookup_source=DraftSource.LOOKUP if source == DraftSource.SELF else source,
                lookup_probs=tuple(sorted((rng.choice([0.2, 0.5, 0.9, 1.0]) for _ in range(tokens)), reverse=True)),
                lookup_match=rng.choice([1, 3, 9]),
            )
            calibration = model.calibration(offer)
            accepted = rng.randint(0, tokens)
            drafts.append(VerifiedDraft(offer.req_id, source, tokens, accepted, calibration, rng.uniform(0, 3)))
        bins = [b for d in drafts for b in d.calibration.bins[: min(d.accepted + 1, d.drafted)].tolist()]
        shared += len(bins) > len(set(bins))
        model.observe_drafts(drafts)
        for d in drafts:
            reference.observe(*d)
        learned = np.flatnonzero(model._bin_verified).tolist()
        assert learned == sorted(reference.by_bin)
        assert model._bin_rates[learned].tolist() == [reference.by_bin[b].rate for b in learned]
        assert model._bin_verified[learned].tolist() == [reference.by_bin[b].verified for b in learned]
        assert {s: r.rate for s, r in model.rates.items()} == {s: r.rate for s, r in reference.rates.items()}
        for (req_id, source), rate in reference.by_request.items():
            assert model.requests.rate(req_id, SOURCE_INDEX[source]) == rate.rate
        assert {r for r in model.requests.slot_of if model.requests.trusted[model.requests.slot_of[r]]} == (
            reference.trusted
        )
        assert {s: c.factor for s, c in model.estimate_calibration.items()} == {
            s: c.factor for s, c in reference.calibration.items()
        }
        for _ in range(rng.randint(0, 3)):  # (requests end: a later one may take the slot)
            req_id = f"r{rng.randint(0, 90)}"
            model.forget(req_id)
            reference.forget(req_id)
            assert model.lookup_rate(req_id) == model.rates[DraftSource.LOOKUP].rate
    assert shared > 100 and len(model.requests.trusted) > 64


def test_the_indexed_give_back_gives_back_what_a_scan_would():
    """`GiveBack` (heaps over each row's thresholds) against the scan it replaced
    (`reference.give_back_by_scan`), on random plans: lookup tokens of many rows, and some
    with a self-draft's tokens over several rows; the same tokens, in the same order."""
    import copy
    import random

    from vllm_selfspec.control.planner import GiveBack, RowDue, RowProtection

    from reference import give_back_by_scan

    rng = random.Random(5)
    compared = given_back = 0
    for _ in range(3000):
        rows = rng.randint(1, 24)
        self_rows = sorted(rng.sample(range(rows), rng.randint(2, rows))) if rows > 2 and rng.random() < 0.3 else []
        taken = []
        for i in range(rows):
            if i in self_rows:
                continue
            gain, price = rng.uniform(0.3, 1.0), rng.uniform(0.001, 0.01)
            for _depth in range(rng.choice([0, 1, 2, 4, 8])):
                taken.append((gain / price, "lookup", [i], price, [gain]))
                gain *= rng.uniform(0.5, 1.0)
        if self_rows:
            each, a = rng.uniform(0.001, 0.01), rng.uniform(0.3, 0.9)
            for depth in range(1, rng.randint(1, 4) + 1):
                taken.append(
                    (
                        len(self_rows) * a**depth / each,
                        "self",
                        self_rows,
                        each / len(self_rows),
                        [a**depth] * len(self_rows),
                    )
                )
        taken.sort(key=lambda token: -token[0])
        t_plain = 0.05 + rows * 0.003
        due = RowDue(
            t_plain,
            rng.choice([0.0, 0.004]),
            trusted=np.array([rng.random() < 0.6 for _ in range(rows)], dtype=bool),
            ahead=np.array([rng.choice([-0.004, 0.0, 0.002, 0.01]) for _ in range(rows)], dtype=float),
        )
        protection = RowProtection(due)
        for token in taken:
            protection.take(token[2], token[3], token[4])
        seconds = t_plain + due.t_verify + sum(t[3] * len(t[2]) for t in taken)
        scanned = give_back_by_scan(copy.deepcopy(protection), list(taken), seconds)
        indexed, give_back, row = [], GiveBack(protection, list(taken)), None
        while give_back.left and (row := protection.a_binding_row(seconds - t_plain, hint=row)) is not None:
            token = give_back.pop(seconds - t_plain)
            seconds -= token[3] * len(token[2])
            indexed.append(token)
        assert indexed == scanned
        compared += 1
        given_back += len(scanned)
    assert compared == 3000 and given_back > 3000


def test_the_learning_kernels_source_indices_are_the_sources():
    """`request_rates` cannot import `acceptance` (it imports it): its source indices are
    written out, and must be `acceptance.SOURCE_INDEX`'s."""
    from vllm_selfspec.control import request_rates
    from vllm_selfspec.control.acceptance import LOOKED_UP, SOURCE_INDEX

    assert request_rates.PREDICTION_SOURCE == SOURCE_INDEX[DraftSource.PREDICTION]
    assert request_rates.SELF_SOURCE == SOURCE_INDEX[DraftSource.SELF]
    assert request_rates.LOOKED_UP_SOURCES == len(LOOKED_UP) and max(SOURCE_INDEX[s] for s in LOOKED_UP) < len(
        LOOKED_UP
    )
