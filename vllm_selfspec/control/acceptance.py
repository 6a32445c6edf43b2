# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""How likely a draft token is to be accepted: per draft source, per request and per lookup bin.

A source's tokens are verified in order, so a draft of d tokens with a accepted was a + (a < d)
Bernoulli trials. Lookup and history rates are also kept per request (code and prose copy from
their context very differently) and per token bin: a lookup draft says how sure each token is
(how many earlier occurrences agree, how long a match they share), and a bin's rate is learned
from the tokens drafted in it, starting from that agreement share.

Last, each lookup source's estimates are scaled by how far verification bears out the drafts
the planner chose by them (`EstimateCalibration`). Choosing the best of many noisy estimates
picks those estimated too high, the more so the more rows a step has to choose among: served
drafts are accepted less often than estimated at 16 rows a step than at one, and there drafts
the planner took as paying by its margin only broke even.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from vllm_selfspec.compiled import compiled
from vllm_selfspec.control.request_rates import MOST_RATE, REQUEST_DECAY, DraftsMade, RequestRates, learn_verified


class DraftSource(str, Enum):
    """Where a row's draft came from."""

    LOOKUP = "lookup"  # the row's own context
    HISTORY = "history"  # earlier requests' outputs
    PREDICTION = "prediction"  # the request's own prediction of its answer (OpenAI's `prediction`)
    SELF = "self"  # the target model with skipped sublayers


LOOKED_UP = (DraftSource.LOOKUP, DraftSource.HISTORY, DraftSource.PREDICTION)  # drafts that cost no forward


@dataclass
class Decayed:
    """An exponentially weighted sum, so that old observations fade out."""

    decay: float
    value: float = 0.0

    def add(self, x: float) -> None:
        self.value = self.decay * self.value + x


@dataclass
class AcceptanceRate:
    """Per-token acceptance of one draft source, from (drafted, accepted) outcomes."""

    prior: float
    decay: float = 0.98
    accepted: Decayed = field(init=False)
    trials: Decayed = field(init=False)

    def __post_init__(self):
        # Two pseudo-trials at the prior, so that the first outcomes do not swing it to 0 or 1.
        self.accepted, self.trials = Decayed(self.decay, 2 * self.prior), Decayed(self.decay, 2.0)

    verified: int = 0  # draft tokens verified so far (not decayed): how much the rate rests on

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.accepted.add(accepted)
            self.trials.add(accepted + (accepted < drafted))
            self.verified += drafted

    @property
    def rate(self) -> float:
        return min(self.accepted.value / self.trials.value, 0.999)


TRUSTED_BIN_TOKENS = 16  # ... or, per calibration bin, every request's, before a new request's does
MATCH_EDGES = (2, 4, 8)  # match length buckets: 1 | 2-3 | 4-7 | 8+ tokens
AGREEMENT_EDGES = (0.34, 0.5, 0.67, 0.9)  # share of the occurrences agreeing on the token


def agreement(probs: tuple[float, ...]) -> list[float]:
    """Per lookup token, the share of the occurrences behind the previous token that agree on
    this one (p_j / p_j-1)."""
    return [p / previous for p, previous in zip(probs, (1.0, *probs))]


def token_bins(source: str, probs: tuple[float, ...], match: int, length: int, sampled: bool = False) -> list[tuple]:
    """Each lookup draft token's calibration bin: its source, whether its row samples (a
    sampled row accepts a token with the target's probability of it, a greedy row only if it
    is the argmax: rates learned on one say little about the other), its match-length bucket
    and its agreement bucket. Without probabilities (a prediction, whose match is how far the
    output has followed it), one bin per source, kind of row and match bucket."""
    source = DraftSource(source).value
    match_bucket = bisect.bisect_right(MATCH_EDGES, match)
    if not probs:
        return [(source, sampled, match_bucket)] * length
    return [
        (source, sampled, match_bucket, bisect.bisect_right(AGREEMENT_EDGES, share))
        for share in agreement(probs[:length])
    ]


SOURCE_INDEX = {source: i for i, source in enumerate(DraftSource)}
SOURCES = tuple(DraftSource)  # a source by its index
AGREEMENT_SLOTS = len(AGREEMENT_EDGES) + 2  # 0: no probabilities (one bin per source), 1 + bucket
MATCH_BUCKETS = len(MATCH_EDGES) + 1
NUM_BINS = len(DraftSource) * 2 * MATCH_BUCKETS * AGREEMENT_SLOTS


@functools.cache  # (a handful of bins, asked for every token learned from)
def bin_id(token_bin: tuple) -> int:
    """A calibration bin (`token_bins`) as an index into arrays over every bin."""
    source, sampled, match_bucket, *agreement_bucket = token_bin
    slot = agreement_bucket[0] + 1 if agreement_bucket else 0
    return ((SOURCE_INDEX[DraftSource(source)] * 2 + sampled) * MATCH_BUCKETS + match_bucket) * AGREEMENT_SLOTS + slot


class StepGains(NamedTuple):
    """Every row's lookup gains this step (`AcceptanceModel.lookup_gains`), rows x depth, 0 past
    a row's draft: as the planner plans with them, and before the calibration scaled them; and
    each token's calibration bin (`bin_id`, -1 past the draft) and the prior it starts from."""

    planned: np.ndarray
    estimated: np.ndarray
    bins: np.ndarray
    priors: np.ndarray
    # Each row's request slot (`request_rates.RequestRates`); None where no row offered a token
    # (`AcceptanceModel.step_gains` read none): `AcceptanceModel.slots` reads them then.
    slots: np.ndarray | None = None

    def expected(self, rows, lengths) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of each row's first `length` the planner expected accepted, and unscaled
        (summed left to right, in one kernel call: what is learned from them must not depend on
        how)."""
        planned, estimated = np.empty(len(rows)), np.empty(len(rows))
        at, lengths = np.asarray(rows, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        _sums_in_order(self.planned, self.estimated, at, lengths, planned, estimated)
        return planned, estimated


class Calibration(NamedTuple):
    """A lookup draft's tokens' calibration bins (`bin_id`), and the rate each starts from."""

    bins: np.ndarray  # int64
    priors: np.ndarray  # float64

    @staticmethod
    def of(pairs) -> Calibration:
        pairs = list(pairs)
        return Calibration(
            np.fromiter((b for b, _ in pairs), dtype=np.int64, count=len(pairs)),
            np.fromiter((p for _, p in pairs), dtype=np.float64, count=len(pairs)),
        )


NO_CALIBRATION = Calibration(np.zeros(0, dtype=np.int64), np.zeros(0))


class VerifiedDraft(NamedTuple):
    """What verification made of a row's draft: its tokens drafted and accepted, with its
    lookup tokens' calibration and the tokens their unscaled estimates expected accepted."""

    req_id: str
    source: DraftSource
    drafted: int
    accepted: int
    calibration: Calibration = NO_CALIBRATION
    estimated: float = 0.0


BIN_DECAY = 0.98  # a bin's rate, as `AcceptanceRate`'s default


AGREEMENT = np.array(AGREEMENT_EDGES)


@compiled
def _sums_in_order(planned, estimated, rows, lengths, planned_sums, estimated_sums):
    """Each row's first `lengths` tokens of `planned` and of `estimated` (rows x depth; past the
    depth, the whole row), summed left to right: the same bits whichever Python runs it (the
    builtin `sum` compensates its rounding from Python 3.12 on)."""
    for r in range(len(rows)):
        row, planned_sum, estimated_sum = rows[r], 0.0, 0.0
        for j in range(min(lengths[r], planned.shape[1])):
            planned_sum += planned[row, j]
            estimated_sum += estimated[row, j]
        planned_sums[r], estimated_sums[r] = planned_sum, estimated_sum


@compiled
def _lookup_gains(slots, offered, sources, source_rates, own_rates):
    """`AcceptanceModel.step_gains`' arithmetic, row by row and token by token: (planned,
    estimated, bins, priors), rows x depth. Each token's agreement share (its probability over
    the previous one's) picks its bin, whose learned rate, or else that share, times the
    request's factor (its own rate of its source over the source's, 1 before it has one),
    multiplies the row's gain so far (as `lookup_gains` does). `slots`: each row's request
    slot; `offered`: the step's `StepOffers` arrays (lengths, sampled, match, has_probs, probs),
    then every bin's learned rate and the agreement and match-length bucket edges; `sources`:
    each row's source, whose rate and calibration factor `source_rates` holds (sources x 2);
    `own_rates`: the requests' (seen, accepted, trials), slots x sources."""
    lengths, sampled, match, has_probs, probs, bin_rates, agreement, match_edges = offered
    seen, accepted, trials = own_rates
    width = 1
    for row in range(len(lengths)):
        width = max(width, lengths[row])
    shape = (len(lengths), width)
    planned, estimated, bins, priors = np.zeros(shape), np.zeros(shape), np.full(shape, -1, np.int64), np.zeros(shape)
    for row in range(len(lengths)):
        if lengths[row] == 0:
            continue
        gain, source, slot = 1.0, sources[row], slots[row]
        if not (0 <= source < seen.shape[1] and 0 <= slot < seen.shape[0]):
            raise IndexError("a lookup draft's source or request slot outside the rates' arrays")
        rate, factor = source_rates[source, 0], source_rates[source, 1]
        own = rate
        if seen[slot, source]:  # (a slot's rates are unread before its first verified draft)
            own = accepted[slot, source] / trials[slot, source]
            if own > MOST_RATE:  # (np.minimum's: NaN stays NaN)
                own = MOST_RATE
        request = own / rate if rate != 0.0 else (np.inf if own > 0 else np.nan)  # (NumPy's x / 0, not a raise)
        match_bucket = 0
        for edge in match_edges:
            match_bucket += edge <= match[row]
        base = ((source * 2 + sampled[row]) * MATCH_BUCKETS + match_bucket) * AGREEMENT_SLOTS
        for j in range(lengths[row]):
            share, token_slot = rate, 0  # (no probabilities: one bin, its prior the source's rate)
            if has_probs[row]:
                share = probs[row, j] / (probs[row, j - 1] if j > 0 else 1.0)
                token_slot = 1
                for edge in agreement:
                    token_slot += edge <= share
            token_bin = base + token_slot
            learned = bin_rates[token_bin]
            gain *= min((share if np.isnan(learned) else learned) * request, 0.999)
            estimated[row, j], planned[row, j] = gain, min(gain * factor, 0.999)
            bins[row, j], priors[row, j] = token_bin, share
    return planned, estimated, bins, priors


MATCH = np.array(MATCH_EDGES)


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) at the engine's start."""
    model = AcceptanceModel()
    # (a step of one row offering two tokens, as `step_gains` passes a step's `StepOffers`)
    one, two = np.zeros(1, dtype=np.int64), np.full(1, 2, dtype=np.int64)
    offered = (two, np.zeros(1, dtype=bool), two, np.ones(1, dtype=bool), np.array([[0.5, 0.25]]))
    rates, requests = np.ones((len(SOURCES), 2)), model.requests
    slots = requests.slots(["warm-up"])
    own_rates = (requests.seen, requests.accepted, requests.trials)
    out = _lookup_gains(slots, (*offered, model._bin_rates, AGREEMENT, MATCH), one, rates, own_rates)
    StepGains(*out).expected([0], [1])
    model.observe_draft("warm-up", DraftSource.LOOKUP, 1, 1, Calibration(np.zeros(1, np.int64), np.ones(1)))
    model.forget("warm-up")


def default_rates() -> dict[DraftSource, AcceptanceRate]:
    return {
        DraftSource.LOOKUP: AcceptanceRate(prior=0.6),
        DraftSource.HISTORY: AcceptanceRate(prior=0.4),
        # A client sends a prediction it expects the answer to follow: most of an edited file.
        DraftSource.PREDICTION: AcceptanceRate(prior=0.8),
        DraftSource.SELF: AcceptanceRate(prior=0.7),
    }


@dataclass
class EstimateCalibration:
    """Lookup tokens accepted over those the planner's unscaled estimates expected, over the
    drafts it chose: the factor its estimates are scaled by. Pseudo-counts start it at 1;
    observations fade, so that it follows the load (how many rows a step chooses among)."""

    decay: float = 0.995  # per draft verified: at 16 rows a step, the last dozen or so steps
    pseudo_tokens: float = 8.0
    limits: tuple[float, float] = (0.5, 1.5)
    accepted: Decayed = field(init=False)
    expected: Decayed = field(init=False)

    def __post_init__(self):
        self.accepted, self.expected = Decayed(self.decay, self.pseudo_tokens), Decayed(self.decay, self.pseudo_tokens)

    def observe(self, expected: float, accepted: int) -> None:
        if expected > 0:
            self.accepted.add(accepted)
            self.expected.add(expected)

    @property
    def factor(self) -> float:
        low, high = self.limits
        return min(max(self.accepted.value / self.expected.value, low), high)


@dataclass
class AcceptanceModel:
    rates: dict[DraftSource, AcceptanceRate] = field(default_factory=default_rates)
    # Lookup acceptance per request and source (prior: the source's overall rate), and whether
    # the request's own rate is trusted, as arrays over request slots (`request_rates`).
    requests: RequestRates = field(default_factory=RequestRates)
    # Lookup acceptance per token bin, by `bin_id` (prior: the agreement share of its first
    # token, or without probabilities, as for a prediction, its source's rate), as arrays over
    # every bin, which a step reads at once (`step_gains`, `trusted_rows`) and learns into with
    # its drafts (`request_rates.learn_verified`): each bin's rate (NaN for a bin no draft has
    # been verified in), tokens verified, and decayed accepted tokens and trials.
    _bin_rates: np.ndarray = field(default_factory=lambda: np.full(NUM_BINS, np.nan))
    _bin_verified: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS, dtype=np.int64))
    _bin_accepted: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    _bin_trials: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    # Per lookup source, verification's outcome over the unscaled estimates of the drafts chosen.
    estimate_calibration: dict[DraftSource, EstimateCalibration] = field(
        default_factory=lambda: {source: EstimateCalibration() for source in LOOKED_UP}
    )

    def rate(self, source: str) -> float:
        return self.rates[DraftSource(source)].rate

    @property
    def self_rate(self) -> float:
        return self.rates[DraftSource.SELF].rate

    def observe_draft(
        self,
        req_id: str,
        source: str,
        drafted: int,
        accepted: int,
        calibration: Calibration = NO_CALIBRATION,
        estimated: float = 0.0,
    ) -> None:
        """What verification made of a row's draft from `source`, with its lookup tokens'
        calibration (`calibration`) and the tokens their unscaled estimates expected accepted
        (`lookup_gains(..., scaled=False)`)."""
        self.observe_drafts([VerifiedDraft(req_id, DraftSource(source), drafted, accepted, calibration, estimated)])

    def observe_drafts(self, drafts: list[VerifiedDraft]) -> None:
        """`observe_draft` of each of a step's drafts, in order (`learn`)."""
        width = max((len(d.calibration.bins) for d in drafts), default=0)
        bins, priors = np.full((len(drafts), width), -1, dtype=np.int64), np.zeros((len(drafts), width))
        for i, draft in enumerate(drafts):
            n = len(draft.calibration.bins)
            if len(draft.calibration.priors) != n:
                raise ValueError(f"a calibration of {n} bins and {len(draft.calibration.priors)} priors")
            bins[i, :n], priors[i, :n] = draft.calibration.bins, draft.calibration.priors
        drafted = np.array([d.drafted for d in drafts], dtype=np.int64)
        made = DraftsMade(
            req_ids=[d.req_id for d in drafts],
            slots=self.requests.slots([d.req_id for d in drafts]),
            sources=np.array([SOURCE_INDEX[DraftSource(d.source)] for d in drafts], dtype=np.int64),
            lengths=drafted,
            expected=np.zeros(len(drafts)),
            estimated=np.array([d.estimated for d in drafts], dtype=np.float64),
            bins=bins,
            priors=priors,
        )
        accepted = np.array([d.accepted for d in drafts], dtype=np.int64)
        self.learn(made, np.arange(len(drafts)), drafted, accepted)

    def learn(self, made: DraftsMade, order: np.ndarray, scheduled: np.ndarray, sampled: np.ndarray):
        """What verification made of drafts `made`: those at `order`, in that order, `scheduled`
        tokens of each verified and `sampled` accepted, learned in one kernel call
        (`request_rates.learn_verified`): the overall rates and the estimates' calibration (a
        few numbers a source, copied in and back out of their objects), the requests' own rates
        and trust, and the bins. Returns each draft's accepted tokens (-1: cut short or withheld)
        and the counters' sums (`request_rates.WITHHELD`...)."""
        rates = [self.rates[source] for source in SOURCES]
        calibrations = [self.estimate_calibration[source] for source in LOOKED_UP]
        overall = np.array([(r.accepted.value, r.trials.value, r.accepted.decay, r.verified) for r in rates])
        calibration = np.array([(c.accepted.value, c.expected.value, c.accepted.decay) for c in calibrations])
        settled, sums, requests = np.empty(len(order), dtype=np.int64), np.zeros(6), self.requests
        learn_verified(
            made.slots, made.sources, made.lengths, made.expected, made.estimated, made.bins, made.priors,
            order, scheduled, sampled,
            overall, calibration,
            requests.accepted, requests.trials, requests.verified, requests.seen, requests.trusted,
            self._bin_accepted, self._bin_trials, self._bin_verified, self._bin_rates,
            REQUEST_DECAY, BIN_DECAY,
            settled, sums,
        )  # fmt: skip
        for rate, (accepted, trials, _, verified) in zip(rates, overall.tolist()):
            rate.accepted.value, rate.trials.value, rate.verified = accepted, trials, int(verified)
        for calibrated, (accepted, expected, _) in zip(calibrations, calibration.tolist()):
            calibrated.accepted.value, calibrated.expected.value = accepted, expected
        return settled, sums

    def forget(self, req_id: str) -> None:
        self.requests.forget(req_id)

    def lookup_rate(self, req_id: str, source: str = DraftSource.LOOKUP) -> float:
        source = DraftSource(source)
        own = self.requests.rate(req_id, SOURCE_INDEX[source])
        return self.rates[source].rate if own is None else own

    def trusted(self, offer) -> bool:
        """Whether a row's estimated gain rests on enough verified draft tokens to be credited
        (`planner`: a row without is credited no gain): its request's own, or else, for a
        lookup draft, those of every calibration bin its tokens fall in, over every request,
        which its estimate then stands on (a bin no draft has been verified in yet is a guess:
        a chat row's short, weak matches beside a row that repeats one token, whose drafts
        fill other bins). Not a prediction's: it is the request's own text, as good or as bad
        as its sender made it, and other requests' predictions say nothing of it."""
        slot = self.requests.slot_of.get(offer.req_id)
        own = slot is not None and bool(self.requests.trusted[slot])
        if own or not offer.lookup_tokens or DraftSource(offer.lookup_source) == DraftSource.PREDICTION:
            return own
        return all(self._bin_verified[bin_id(token_bin)] >= TRUSTED_BIN_TOKENS for token_bin in set(offer.lookup_bins))

    def slots(self, offers, gains: StepGains) -> np.ndarray:
        """Each row's request slot: the gains' own, or read now where the step read none (never
        `gains.slots` itself unread: NumPy takes an index of None as a new axis)."""
        return self.requests.slots(offers.req_ids) if gains.slots is None else gains.slots

    def trusted_rows(self, offers, gains: StepGains) -> np.ndarray:
        """`trusted` of every row of a step's offers (`offers.StepOffers`), as an array."""
        slots = self.slots(offers, gains)
        own = self.requests.trusted[slots]
        bins = gains.bins
        verified = np.where(bins >= 0, self._bin_verified[bins], TRUSTED_BIN_TOKENS) >= TRUSTED_BIN_TOKENS
        looked_up = (offers.lookup_tokens > 0) & (offers.sources != SOURCE_INDEX[DraftSource.PREDICTION])
        return own | (looked_up & verified.all(axis=1))

    def trust_rule(self, offers, gains: StepGains) -> tuple:
        """What `trusted_rows` reads, for the compiled plan (`lookup_plan.steady_lookup_plan`):
        each slot's own trust, each row's slot, each token's bin, each bin's verified tokens,
        the tokens a bin is trusted at, and the prediction's source index."""
        slots = self.slots(offers, gains)
        prediction = SOURCE_INDEX[DraftSource.PREDICTION]
        return self.requests.trusted, slots, gains.bins, self._bin_verified, TRUSTED_BIN_TOKENS, prediction

    def calibration(self, offer, length: int | None = None) -> Calibration:
        """The bins and priors of an offer's first `length` lookup tokens (all by default)."""
        return Calibration.of((bin_id(b), p) for b, p in self._bins_and_priors(offer, length))

    def _bins_and_priors(self, offer, length: int | None = None):
        """(bin, prior) of an offer's first `length` lookup tokens. A token's prior is the share
        of occurrences that agree on it (suffix decoding's own estimate), or without
        probabilities its source's overall rate. (Pairs, not a `Calibration`: `lookup_gains` asks
        for every row a step.)"""
        length = offer.lookup_tokens if length is None else length
        shares = agreement(offer.lookup_probs) or [self.rate(offer.lookup_source)] * offer.lookup_tokens
        return zip(offer.lookup_bins[:length], shares[:length])

    def lookup_gains(self, offer, scaled: bool = True) -> list[float]:
        """Expected tokens from each depth j of a row's lookup draft: the chance that its first
        j tokens are all accepted, the product of each token's rate, scaled by how this
        request's drafts fare against its source's, and then (`scaled`) by how the source's
        chosen drafts fare against these estimates. Never rises with depth. A token's rate is
        its bin's; in a bin not seen yet, its prior, not the source's overall rate, which weak
        drafts drag down."""
        source = DraftSource(offer.lookup_source)
        request = self.lookup_rate(offer.req_id, source) / self.rate(source)
        gains, gain = [], 1.0
        learned = lambda token_bin, prior: prior if np.isnan(r := self._bin_rates[token_bin]) else float(r)  # noqa: E731
        if offer.lookup_tokens and not offer.lookup_probs:  # (every token in one bin, at one rate: a prediction's)
            each = min(learned(bin_id(offer.lookup_bins[0]), self.rate(source)) * request, 0.999)
            for _ in range(offer.lookup_tokens):
                gain *= each
                gains.append(gain)
        else:
            for token_bin, prior in self._bins_and_priors(offer):
                gain *= min(learned(bin_id(token_bin), prior) * request, 0.999)
                gains.append(gain)
        return self.scaled(source, gains) if scaled else gains

    def step_gains(self, offers) -> StepGains:
        """`lookup_gains` of every row of a step's offers (`offers.StepOffers`) at once, to the
        last bit: each token's bin and prior from its agreement share, its rate from the bins'
        array, the products along each row: one compiled call (none where no row offers a
        token: the kernel's zeros, and no request's slot read)."""
        if not np.count_nonzero(offers.lookup_tokens):
            shape = (len(offers), 1)
            return StepGains(np.zeros(shape), np.zeros(shape), np.full(shape, -1, dtype=np.int64), np.zeros(shape))
        slots = self.requests.slots(offers.req_ids)
        # Per source, by its index: its rate and calibration factor (self-drafts', unread: ones).
        rates, calibrated = self.rates, self.estimate_calibration
        source_rates = np.array(
            [x for s in SOURCES for x in ((rates[s].rate, calibrated[s].factor) if s in LOOKED_UP else (1.0, 1.0))]
        ).reshape(len(SOURCES), 2)
        offered = (offers.lookup_tokens, offers.sampled, offers.match, offers.has_probs, offers.probs)
        offered = (*offered, self._bin_rates, AGREEMENT, MATCH)
        own_rates = (self.requests.seen, self.requests.accepted, self.requests.trials)
        return StepGains(*_lookup_gains(slots, offered, offers.sources, source_rates, own_rates), slots)

    def scaled(self, source: str, estimates: list[float]) -> list[float]:
        """A lookup source's unscaled gains, scaled by what verification bears out of them."""
        factor = self.estimate_calibration[DraftSource(source)].factor
        return [min(g * factor, 0.999) for g in estimates]
