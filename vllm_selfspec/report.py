"""What the self-admg proposer did, for operators, benchmarks and tests."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ProposerCounters:
    """Totals since the engine started (read through collective_rpc)."""

    prompts_measured: int = 0
    prompt_tokens_measured: int = 0
    probe_seconds: float = 0.0
    warmup_seconds: float = 0.0  # the eager path's one-off set-up, paid at the first step
    draft_calls: int = 0
    draft_steps: int = 0
    draft_tokens: int = 0
    draft_seconds: float = 0.0
    propose_calls: int = 0  # steps the proposer was asked for drafts
    propose_seconds: float = 0.0  # its own time in them, probes and self-drafts included
    lookup_tokens: int = 0  # from lookup, own context or history
    history_tokens: int = 0  # of which from earlier requests' outputs
    context_tokens: int = 0  # and from the request's own context
    # Of the lookup tokens verified, those accepted and those the planner expected to be: a
    # planner that expects too many takes drafts that do not pay.
    lookup_accepted: int = 0
    lookup_expected: float = 0.0
    lookup_estimated: float = 0.0  # the same before the planner's calibration scaled them
    # Drafts made but not verified: the scheduler withheld them beside a prefill, or cut them
    # at max_model_len.
    draft_tokens_withheld: int = 0
    steps_prompts_waiting: int = 0  # steps the scheduler said requests wait that it could admit
    # The last measured prompts, for diagnostics and tests: (prompt_key, attention similarity,
    # MLP similarity, mask). Bounded, so a long-running server does not grow it.
    measurements: deque = field(default_factory=lambda: deque(maxlen=4096))
    # The last steps as the controller saw them: (prompt tokens, logit rows, sampled logit
    # rows, draft tokens, seconds), to check its cost model against.
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))
    steps_timed: int = 0  # every step ever appended to `steps`: a run's own are the last (after - before)


def prompt_key(prompt_token_ids) -> str:
    """A short, stable name for a prompt's token ids (to match measurements to prompts)."""
    return hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def proposer_report(worker, measurements: bool = True) -> dict:
    """What a worker's self-admg proposer did, as plain (JSON-ready) data. Runs in the worker:
    `llm.collective_rpc(proposer_report)` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1, since
    vLLM pickles callables only when allowed), or by name through `SelfAdmgWorkerExtension`."""
    from vllm_selfspec.proposer import SelfAdmgProposer

    drafter = worker.model_runner.drafter
    if not isinstance(drafter, SelfAdmgProposer):
        return {}
    counters = drafter.counters
    report = {
        f.name: getattr(counters, f.name)
        for f in dataclasses.fields(counters)
        if f.name not in ("measurements", "steps")
    }
    report["live_requests"] = sorted(drafter.self_drafter.masks)
    report["faults"] = drafter.fail_safe.faults
    report["drafting_disabled"] = drafter.fail_safe.disabled
    report["steps_skipped_for_faults"] = drafter.fail_safe.steps_skipped
    report["fault_kinds"] = sorted(drafter.fail_safe.kinds_seen)
    report["requests_quarantined"] = len(drafter.quarantine.requests)
    report["prompts_quarantined"] = len(drafter.quarantine.prompts)
    report["history_tenants"] = drafter.history.tenants if drafter.history is not None else 0
    report["history_tokens_held"] = len(drafter.history) if drafter.history is not None else 0
    report["scheduler_faults"] = drafter.scheduler_faults
    if measurements:
        report["steps"] = [list(step) for step in counters.steps]
        report["measurements"] = [
            {
                "prompt_key": key,
                "attention_similarity": attn.tolist(),
                "mlp_similarity": mlp.tolist(),
                "skip_attention": [bool(x) for x in mask.attention],
                "skip_mlp": [bool(x) for x in mask.mlp],
            }
            for key, attn, mlp, mask in counters.measurements
        ]
    return report


def metrics_snapshot(drafter) -> dict:
    """What operators watch of a worker's proposer (`vllm_selfspec.metrics`): counters and
    switches, no request ids and nothing of any request's content."""
    counters, fail_safe = drafter.counters, drafter.fail_safe
    return {
        "faults": fail_safe.faults,
        "drafting_disabled": int(fail_safe.disabled),
        "steps_skipped_for_faults": fail_safe.steps_skipped,
        "draft_tokens": {
            "self": counters.draft_tokens,
            "context": counters.context_tokens,
            "history": counters.history_tokens,
        },
        "lookup_tokens_accepted": counters.lookup_accepted,
        "draft_tokens_withheld": counters.draft_tokens_withheld,
        "probes": counters.prompts_measured,
        "probe_seconds": counters.probe_seconds,
        "proposer_steps": counters.propose_calls,
        "proposer_seconds": counters.propose_seconds,
        "requests_holding_state": len(drafter.self_drafter.masks) if drafter.self_drafter is not None else 0,
        "scheduler_faults": drafter.scheduler_faults,
        "requests_quarantined": len(drafter.quarantine.requests),
    }


class SelfAdmgWorkerExtension:
    """Lets a server report on its proposer by name, without pickled functions. Start it with
    `--worker-extension-cls vllm_selfspec.report.SelfAdmgWorkerExtension` and, in vLLM's dev
    mode (VLLM_SERVER_DEV_MODE=1), POST {"method": "self_admg_state"} to /collective_rpc."""

    def self_admg_state(self) -> dict:
        """Counters and the requests that currently hold a skip mask (one dict per worker)."""
        return proposer_report(self, measurements=False)

    def self_admg_steps(self) -> list[list[float]]:
        """The last steps as the controller saw them (ProposerCounters.steps), oldest first."""
        return proposer_report(self).get("steps", [])


def spec_decode_counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters of an `LLM` built with disable_log_stats=False:
    num_drafts, num_draft_tokens, num_accepted_tokens (names without the vllm: prefix)."""
    return {
        m.name.removeprefix("vllm:spec_decode_"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value")
    }
