# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Each live request's own lookup acceptance, as arrays over request slots, and what a step's
verified drafts teach, learned in one compiled call.

A request gets a slot (a row of the arrays) the first time a step asks for it and gives it back
when it ends, so that a step reads its rows' rates and trust with one gather, and learns its
drafts with no object per draft. The arithmetic is `acceptance.AcceptanceRate`'s, in the same
order, so the same bits: a request's rate of a source starts, at its first verified draft, at
two pseudo-trials at the source's overall rate then, and fades by REQUEST_DECAY a draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_selfspec.compiled import compiled
from vllm_selfspec.request_slots import NO_SLOT, RequestSlots, widened

REQUEST_DECAY = 0.95  # a request's own rates follow its last few drafts
TRUSTED_AFTER_TOKENS = 8  # a request's verified draft tokens (of one source) before its own acceptance counts
LOOKED_UP_SOURCES = 3  # sources kept per request: lookup, history, prediction (`acceptance.LOOKED_UP`)
MOST_RATE = 0.999  # no rate is taken as certain


class RequestRates(RequestSlots):
    """Per request slot and looked-up source: decayed accepted tokens and trials, tokens
    verified, and whether a draft was verified yet (`seen`); per slot, whether some source's
    rate rests on TRUSTED_AFTER_TOKENS verified tokens (`trusted`, which only grows while the
    request lives)."""

    def __init__(self):
        super().__init__()
        self.accepted = np.zeros((0, LOOKED_UP_SOURCES))
        self.trials = np.zeros((0, LOOKED_UP_SOURCES))
        self.verified = np.zeros((0, LOOKED_UP_SOURCES), dtype=np.int64)
        self.seen = np.zeros((0, LOOKED_UP_SOURCES), dtype=bool)
        self.trusted = np.zeros(0, dtype=bool)

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Each request's slot, given now to those without one."""
        slot_of = self.slot_of
        slots = [slot_of.get(r, NO_SLOT) for r in req_ids]
        if NO_SLOT in slots:
            slots = [slot_of[r] if r in slot_of else self._take(r) for r in req_ids]  # (a request may repeat)
        return np.array(slots, dtype=np.int64)

    def _grow(self, old: int) -> None:
        self.accepted, self.trials = widened(self.accepted, self.capacity), widened(self.trials, self.capacity)
        self.verified, self.seen = widened(self.verified, self.capacity), widened(self.seen, self.capacity)
        self.trusted = widened(self.trusted, self.capacity)

    def _freed(self, slot: int) -> None:
        self.seen[slot] = False
        self.trusted[slot] = False

    def rate(self, req_id: str, source: int) -> float | None:
        """The request's own rate of a looked-up source (None before its first verified draft)."""
        slot = self.slot_of.get(req_id)
        if slot is None or source >= LOOKED_UP_SOURCES or not self.seen[slot, source]:
            return None
        return min(self.accepted[slot, source] / self.trials[slot, source], MOST_RATE)


PREDICTION_SOURCE, SELF_SOURCE = 2, 3  # (their indices in `acceptance.SOURCES`)


@dataclass(eq=False)
class DraftsMade:
    """Drafts made in a step, to learn from once verified, as arrays over the drafts: per draft
    its request (id and slot), source (by its index in `acceptance.SOURCES`), length, the lookup
    tokens the planner expected accepted (as it planned, and before its calibration scaled them:
    what that learns from), and its tokens' calibration bins and priors (drafts x depth; bins
    -1 and priors 0 past its lookup tokens and for a self-draft's)."""

    req_ids: list[str]
    slots: np.ndarray  # int64
    sources: np.ndarray  # int64
    lengths: np.ndarray  # int64
    expected: np.ndarray  # float64
    estimated: np.ndarray  # float64
    bins: np.ndarray  # int64
    priors: np.ndarray  # float64

    @staticmethod
    def self_drafts(req_ids: list[str], lengths: list[int]) -> DraftsMade:
        """Self-drafts (no request slot: nothing of a self-draft is learned per request)."""
        n = len(req_ids)
        return DraftsMade(
            req_ids, np.full(n, NO_SLOT, dtype=np.int64), np.full(n, SELF_SOURCE, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
            np.zeros(n), np.zeros(n), np.full((n, 1), -1, dtype=np.int64), np.zeros((n, 1)),
        )  # fmt: skip

    def taken(self, at: np.ndarray) -> DraftsMade:
        """The drafts at these indices."""
        return DraftsMade(
            [self.req_ids[i] for i in at.tolist()],
            *(a[at] for a in (self.slots, self.sources, self.lengths, self.expected, self.estimated)),
            self.bins[at],
            self.priors[at],
        )

    def joined(self, other: DraftsMade) -> DraftsMade:
        width = max(self.bins.shape[1], other.bins.shape[1])

        def padded(array: np.ndarray, fill) -> np.ndarray:
            return np.pad(array, ((0, 0), (0, width - array.shape[1])), constant_values=fill)

        mine = (self.slots, self.sources, self.lengths, self.expected, self.estimated)
        theirs = (other.slots, other.sources, other.lengths, other.expected, other.estimated)
        return DraftsMade(
            self.req_ids + other.req_ids,
            *(np.concatenate(pair) for pair in zip(mine, theirs)),
            np.concatenate((padded(self.bins, -1), padded(other.bins, -1))),
            np.concatenate((padded(self.priors, 0.0), padded(other.priors, 0.0))),
        )


# What `learn_verified` sums for the counters, by index.
WITHHELD, PREDICTION_ACCEPTED, LOOKUP_ACCEPTED, LOOKUP_EXPECTED, LOOKUP_ESTIMATED, LOOKED_UP_DRAFTS = range(6)


@compiled
def learn_verified(
    slots, sources, lengths, expected, estimated, bins, priors,
    order, scheduled, sampled,
    overall, calibration,
    own_accepted, own_trials, own_verified, seen, trusted,
    bin_accepted, bin_trials, bin_verified, bin_rates,
    request_decay, bin_decay,
    settled, sums,
):  # fmt: skip
    """What verification made of a step's drafts (`DraftsMade`'s arrays): those at `order`, in
    that order, each with `scheduled` tokens verified (at most its length) and `sampled` tokens
    accepted (at most those verified), learned draft by draft as the objects learn it
    (`AcceptanceRate.observe` and `EstimateCalibration.observe`; each verified token up to the
    first rejected in its bin, as an `AcceptanceRate` starting at its first token's prior), into
    `overall` (sources x accepted, trials, decay, verified), `calibration` (looked-up sources x
    accepted, expected, decay), the request slots' arrays (`RequestRates`) and every bin's.
    Out: `settled`, each draft's accepted tokens (-1: cut short or withheld, so the step did not
    run as planned), and `sums` for the counters (their indices above). Indices outside the
    arrays (numba checks no bounds) raise before anything is learned. No arguments as tuples:
    numba reads a tuple's types in Python at every call."""
    if priors.shape != bins.shape or not len(order) == len(scheduled) == len(sampled) <= len(settled):
        raise ValueError("drafts' arrays of different shapes")
    for k in range(bins.shape[0]):
        for j in range(bins.shape[1]):
            if bins[k, j] < -1 or bins[k, j] >= len(bin_rates):
                raise ValueError("a calibration's bin ids outside the bins")
    for r in range(len(order)):
        k = order[r]
        if not (0 <= k < len(slots) and 0 <= sources[k] < overall.shape[0]):
            raise ValueError("a draft or its source outside the drafts' arrays")
        if sources[k] != SELF_SOURCE and not (0 <= slots[k] < len(seen) and sources[k] < calibration.shape[0]):
            raise ValueError("a looked-up draft's request slot outside the requests' arrays")
    for r in range(len(order)):
        k = order[r]
        s, d = sources[k], min(lengths[k], scheduled[r])
        a = min(sampled[r], d)
        sums[WITHHELD] += lengths[k] - d
        settled[r] = a if 0 < d == lengths[k] else -1
        if d == 0:
            continue
        overall[s, 0] = overall[s, 2] * overall[s, 0] + a
        overall[s, 1] = overall[s, 2] * overall[s, 1] + (a + (a < d))
        overall[s, 3] += d
        if s == PREDICTION_SOURCE:
            sums[PREDICTION_ACCEPTED] += a
        elif s != SELF_SOURCE:
            sums[LOOKUP_ACCEPTED] += a
            sums[LOOKUP_EXPECTED] += expected[k]
            sums[LOOKUP_ESTIMATED] += estimated[k]
            sums[LOOKED_UP_DRAFTS] += 1
        if s != SELF_SOURCE:  # its calibration and the request's own rate
            if estimated[k] > 0:
                calibration[s, 0] = calibration[s, 2] * calibration[s, 0] + a
                calibration[s, 1] = calibration[s, 2] * calibration[s, 1] + estimated[k]
            slot = slots[k]
            if not seen[slot, s]:
                prior = min(overall[s, 0] / overall[s, 1], MOST_RATE)
                own_accepted[slot, s], own_trials[slot, s], own_verified[slot, s] = 2 * prior, 2.0, 0
                seen[slot, s] = True
            own_accepted[slot, s] = request_decay * own_accepted[slot, s] + a
            own_trials[slot, s] = request_decay * own_trials[slot, s] + (a + (a < d))
            own_verified[slot, s] += d
            if own_verified[slot, s] >= TRUSTED_AFTER_TOKENS:
                trusted[slot] = True
        for j in range(min(a + 1, d, bins.shape[1])):  # the accepted tokens and the first rejected
            b = bins[k, j]
            if b < 0:
                continue
            if bin_verified[b] == 0:
                bin_accepted[b], bin_trials[b] = 2 * min(priors[k, j], MOST_RATE), 2.0
            bin_accepted[b] = bin_decay * bin_accepted[b] + (1.0 if j < a else 0.0)
            bin_trials[b] = bin_decay * bin_trials[b] + 1.0
            bin_verified[b] += 1
            bin_rates[b] = min(bin_accepted[b] / bin_trials[b], MOST_RATE)
