# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A worker extension that reports on the self-admg proposer by name, for benchmarks and tests:
`--worker-extension-cls vllm_selfspec.operations.worker_extension.SelfAdmgWorkerExtension`, then, in
vLLM's dev mode (VLLM_SERVER_DEV_MODE=1), POST {"method": "self_admg_state"} to /collective_rpc.
Offline, `llm.collective_rpc(proposer_report)` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1,
since vLLM pickles callables only when allowed)."""

from __future__ import annotations

import dataclasses

from vllm_selfspec.proposer import SelfAdmgProposer


def proposer_report(worker, measurements: bool = True) -> dict:
    """What a worker's self-admg proposer did, as plain (JSON-ready) data. Runs in the worker."""
    drafter = worker.model_runner.drafter
    if not isinstance(drafter, SelfAdmgProposer):
        return {}
    counters = drafter.counters
    report = {
        f.name: getattr(counters, f.name)
        for f in dataclasses.fields(counters)
        if f.name not in ("measurements", "steps")
    }
    report["part_seconds"] = dict(counters.part_seconds)  # a copy: the worker's goes on counting
    report["live_requests"] = sorted(drafter.self_drafter.masks)
    report["faults"] = drafter.fail_safe.faults
    report["drafting_disabled"] = drafter.fail_safe.disabled
    report["steps_skipped_for_faults"] = drafter.fail_safe.steps_skipped
    report["fault_kinds"] = sorted(drafter.fail_safe.kinds_seen)
    report["requests_quarantined"] = len(drafter.lookup.quarantine.requests)
    report["prompts_quarantined"] = len(drafter.lookup.quarantine.prompts)
    report["history_tenants"] = drafter.lookup.history.tenants if drafter.lookup.history is not None else 0
    report["history_tokens_held"] = len(drafter.lookup.history) if drafter.lookup.history is not None else 0
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


class SelfAdmgWorkerExtension:
    """Lets a server report on its proposer by name, without pickled functions."""

    def self_admg_state(self) -> dict:
        """Counters and the requests that currently hold a skip mask (one dict per worker)."""
        return proposer_report(self, measurements=False)

    def self_admg_steps(self) -> list[list[float]]:
        """The last steps as the controller saw them (ProposerCounters.steps), oldest first."""
        return proposer_report(self).get("steps", [])
