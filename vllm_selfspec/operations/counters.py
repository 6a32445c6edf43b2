# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The proposer's counters: totals since the engine started, which operators read on /metrics
(`metrics`), and benchmarks and tests through the worker extension (`worker_extension`)."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# The parts of a step's proposer time, in the order they run (`PartClock`).
PROPOSER_PARTS = ("update_states", "read_step", "learn", "look_up", "plan", "agree", "draft")


@dataclass
class ProposerCounters:
    """Totals since the engine started."""

    prompts_measured: int = 0
    prompt_tokens_measured: int = 0
    probe_seconds: float = 0.0
    warmup_seconds: float = 0.0  # the eager path's one-off set-up, paid at the first step
    draft_calls: int = 0
    draft_steps: int = 0
    draft_tokens: int = 0
    draft_seconds: float = 0.0
    propose_calls: int = 0  # steps the proposer was asked for drafts
    # Its own time in them, probes and self-drafts included, and its part in every step's
    # `_update_states` (vLLM's: requests admitted and dropped), asked for drafts or not
    # (`SelfAdmgProposer.begin_step`, `forget`).
    propose_seconds: float = 0.0
    # The CPU time of the proposer's thread in them: below `propose_seconds` by the time it was
    # off a core, descheduled or blocked (the ranks' all-reduce included); a spin-wait counts as
    # CPU time.
    propose_cpu_seconds: float = 0.0
    # The same by part: update_states (requests admitted and dropped), read_step (vLLM's
    # state), learn, look_up, plan, agree (the ranks' all-reduce) and draft (lookup drafts
    # handed over, self-drafts): where a step's time goes.
    part_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROPOSER_PARTS, 0.0))
    # What the plan was offered, before it chose: the rows whose contexts were looked up (none
    # while the lookup gate is closed) and the draft tokens lookup and predictions offered. Beside
    # the tokens drafted they tell a plan that declined drafts from one that was offered none.
    rows_looked_up: int = 0
    tokens_offered: int = 0
    lookup_tokens: int = 0  # from lookup, own context or history
    history_tokens: int = 0  # of which from earlier requests' outputs
    context_tokens: int = 0  # and from the request's own context
    prediction_tokens: int = 0  # and from the request's own prediction (OpenAI's `prediction`)
    prediction_accepted: int = 0  # of those, accepted
    # Of the lookup tokens verified, those accepted and those the planner expected to be: a
    # planner that expects too many takes drafts that do not pay.
    lookup_accepted: int = 0
    lookup_expected: float = 0.0
    lookup_estimated: float = 0.0  # the same before the planner's calibration scaled them
    # Drafts made but not verified: the scheduler withheld them beside a prefill, or cut them
    # at max_model_len.
    draft_tokens_withheld: int = 0
    # Steps whose drafts went back to the engine core with the sampled tokens
    # (`vllm_integration.draft_handoff`), and faults there (each costs a round trip, not drafts).
    drafts_handed_over: int = 0
    draft_handoff_faults: int = 0
    steps_prompts_waiting: int = 0  # steps the scheduler said requests wait that it could admit
    # The last measured prompts, for diagnostics and tests: (prompt_key, attention similarity,
    # MLP similarity, mask). Bounded, so a long-running server does not grow it.
    measurements: deque = field(default_factory=lambda: deque(maxlen=4096))
    # The last steps as the controller saw them: (prompt tokens, logit rows, sampled logit
    # rows, draft tokens, seconds, context tokens the logit rows read), to check its cost model against.
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))
    steps_timed: int = 0  # every step ever appended to `steps`: a run's own are the last (after - before)


def prompt_key(prompt_token_ids) -> str:
    """A short, stable name for a prompt's token ids (to match measurements to prompts)."""
    return hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


class PartClock:
    """Splits a step's proposer time into parts: each lap adds the time since the one before
    (or since the clock started) to its part in `seconds`."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


def updating_states(counters: ProposerCounters, work) -> None:
    """`work()`, the proposer's part in vLLM's `_update_states` (requests admitted and dropped),
    counted in its time: every step pays it, whether or not vLLM asks for drafts."""
    start, cpu_start = time.perf_counter(), time.thread_time()
    try:
        work()
    finally:
        seconds = time.perf_counter() - start
        counters.propose_seconds += seconds
        counters.propose_cpu_seconds += time.thread_time() - cpu_start
        counters.part_seconds["update_states"] += seconds
