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
from dataclasses import dataclass, field
from enum import Enum


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


TRUSTED_AFTER_TOKENS = 8  # a request's verified draft tokens before its own acceptance counts
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


@dataclass(frozen=True)
class BinPrior:
    """A lookup token's calibration bin and the rate it starts from."""

    bin: tuple
    prior: float


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
    # Lookup acceptance per request and source (prior: the source's overall rate).
    _by_request: dict[tuple[str, DraftSource], AcceptanceRate] = field(default_factory=dict)
    # Lookup acceptance per token bin (prior: the agreement share of its first token, or without
    # probabilities, as for a prediction, its source's rate).
    _by_bin: dict[tuple, AcceptanceRate] = field(default_factory=dict)
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
        self, req_id: str, source: str, drafted: int, accepted: int, bins: list[BinPrior] = (), estimated: float = 0.0
    ) -> None:
        """What verification made of a row's draft from `source`, with its lookup tokens'
        calibration (`calibration`) and the tokens their unscaled estimates expected accepted
        (`lookup_gains(..., scaled=False)`)."""
        source = DraftSource(source)
        overall = self.rates[source]
        overall.observe(drafted, accepted)
        if source != DraftSource.SELF:
            self.estimate_calibration[source].observe(estimated, min(accepted, drafted))
            key = (req_id, source)
            if key not in self._by_request:
                self._by_request[key] = AcceptanceRate(prior=overall.rate, decay=0.95)
            self._by_request[key].observe(drafted, accepted)
        for j, token in enumerate(bins[: min(accepted + 1, drafted)]):  # accepted, the first rejected
            if token.bin not in self._by_bin:
                self._by_bin[token.bin] = AcceptanceRate(prior=min(token.prior, 0.999))
            self._by_bin[token.bin].observe(1, int(j < accepted))

    def forget(self, req_id: str) -> None:
        for source in LOOKED_UP:
            self._by_request.pop((req_id, source), None)

    def lookup_rate(self, req_id: str, source: str = DraftSource.LOOKUP) -> float:
        source = DraftSource(source)
        rate = self._by_request.get((req_id, source))
        return rate.rate if rate else self.rates[source].rate

    def trusted(self, offer) -> bool:
        """Whether a row's estimated gain rests on enough verified draft tokens to be credited
        (`planner`: a row without is credited no gain): its request's own, or else, for a
        lookup draft, those of every calibration bin its tokens fall in, over every request,
        which its estimate then stands on (a bin no draft has been verified in yet is a guess:
        a chat row's short, weak matches beside a row that repeats one token, whose drafts
        fill other bins). Not a prediction's: it is the request's own text, as good or as bad
        as its sender made it, and other requests' predictions say nothing of it."""
        own = False
        for source in LOOKED_UP:  # (a loop, not any(): asked for every row of every step)
            rate = self._by_request.get((offer.req_id, source))
            if rate is not None and rate.verified >= TRUSTED_AFTER_TOKENS:
                own = True
                break
        if own or not offer.lookup_tokens or DraftSource(offer.lookup_source) == DraftSource.PREDICTION:
            return own
        return all(
            (rate := self._by_bin.get(token_bin)) is not None and rate.verified >= TRUSTED_BIN_TOKENS
            for token_bin in set(offer.lookup_bins)
        )

    def calibration(self, offer, length: int | None = None) -> list[BinPrior]:
        """The bins and priors of an offer's first `length` lookup tokens (all by default)."""
        return [BinPrior(b, p) for b, p in self._bins_and_priors(offer, length)]

    def _bins_and_priors(self, offer, length: int | None = None):
        """(bin, prior) of an offer's first `length` lookup tokens. A token's prior is the share
        of occurrences that agree on it (suffix decoding's own estimate), or without
        probabilities its source's overall rate. (Pairs, not `BinPrior`s: `lookup_gains` asks
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
        gains, gain, by_bin = [], 1.0, self._by_bin
        if offer.lookup_tokens and not offer.lookup_probs:  # (every token in one bin, at one rate: a prediction's)
            token_bin, prior = offer.lookup_bins[0], self.rate(source)
            each = min((by_bin[token_bin].rate if token_bin in by_bin else prior) * request, 0.999)
            for _ in range(offer.lookup_tokens):
                gain *= each
                gains.append(gain)
        else:
            for token_bin, prior in self._bins_and_priors(offer):
                rate = by_bin[token_bin].rate if token_bin in by_bin else prior
                gain *= min(rate * request, 0.999)
                gains.append(gain)
        return self.scaled(source, gains) if scaled else gains

    def scaled(self, source: str, estimates: list[float]) -> list[float]:
        """A lookup source's unscaled gains, scaled by what verification bears out of them."""
        factor = self.estimate_calibration[DraftSource(source)].factor
        return [min(g * factor, 0.999) for g in estimates]
