# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Is a method's time per output token set by its steps' length or by the tokens each step emits?

Reads a serving results folder (benchmarks.serving) and, for every run, takes the requests that
the engine served alone (no other request in flight from first to last token, by `vllm bench
serve`'s start times and latencies). For them each streamed chunk is one engine step, so the
inter-token latencies vLLM's benchmark saved are step times for one row, and output tokens over
chunks is the tokens a step emitted. TPOT is about one over the other; plain decoding's rows
give the step of a method that drafts nothing. Any method's server can be split this way (no
counters of ours needed), so `suffix`, `ngram` and self-admg are compared on the same footing.

    .venv/bin/python -m benchmarks.diagnostics.step_split \
        ~/.cache/vllm-selfspec/results/serving-quick-.../ --workload code
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving import runs_from_folder


@dataclass(frozen=True)
class StepSplit:
    requests_alone: int
    requests: int
    step_ms: float  # mean time between a lone request's chunks: one engine step for one row
    tokens_per_step: float  # that request's output tokens per chunk (its first included)


def alone(starts: list[float], latencies: list[float]) -> list[int]:
    """Indices of the requests that no other request overlapped in time."""
    spans = [(start, start + latency) for start, latency in zip(starts, latencies)]
    return [
        i
        for i, (start, end) in enumerate(spans)
        if not any(
            j != i and other_start < end and other_end > start for j, (other_start, other_end) in enumerate(spans)
        )
    ]


def split(result: dict) -> StepSplit | None:
    """The step split of one `vllm bench serve` result; None if no request ran alone."""
    lone = [i for i in alone(result["start_times"], result["latencies"]) if result["itls"][i]]
    if not lone:
        return None
    gaps = [gap for i in lone for gap in result["itls"][i]]
    chunks = sum(len(result["itls"][i]) + 1 for i in lone)
    tokens = sum(result["output_lens"][i] for i in lone)
    return StepSplit(len(lone), len(result["start_times"]), 1e3 * statistics.mean(gaps), tokens / chunks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workload", default=None, help="only this workload")
    args = parser.parse_args(argv)
    print("| round | server | workload | load | alone | ms per step | tokens per step | mean TPOT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs_from_folder(args.folder):
        if not run.clean or (args.workload and run.workload != args.workload):
            continue
        found = split(run.result)
        cells = (
            f"{found.requests_alone}/{found.requests} | {found.step_ms:.1f} | {found.tokens_per_step:.2f}"
            if found
            else f"0/{run.result['completed']} | - | -"
        )
        print(
            f"| {run.round} | {run.server.name} | {run.workload} | {run.point.label} | {cells} | "
            f"{run.result['mean_tpot_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
