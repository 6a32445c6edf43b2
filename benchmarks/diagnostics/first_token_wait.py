# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Where does a request's first token wait under load: for the step in progress, or in its own?

The engine admits a new prompt only at a step boundary, so a request's time to first token is
the rest of the step in progress when it arrived, then the step that prefills it (and any
before it, if it had to queue). Reads a serving results folder (benchmarks.serving) and, for
every run, finds the engine's step boundaries from the client side: every streamed chunk of
every request arrives at the end of a step, and chunks of one step arrive together. Then it
splits each request's first-token time at the first boundary after its arrival. A method whose
steps are longer (they verify drafts) makes a new prompt wait longer for the step in progress,
whatever it drafts; any method's server can be split this way, no counters of ours needed.

    .venv/bin/python -m benchmarks.diagnostics.first_token_wait \
        ~/.cache/vllm-selfspec/results/serving-quick-.../ --workload code
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.serving import runs_from_folder

# Chunks of one step reach the client within a few milliseconds of each other; steps here take
# 30 ms or more.
SAME_STEP_S = 0.015


@dataclass(frozen=True)
class FirstTokenWait:
    steps: int  # step boundaries seen
    step_ms: float  # median time between consecutive boundaries
    in_progress_ms: float  # mean wait, from arrival to the end of the step in progress
    own_step_ms: float  # mean of the rest of the first-token time: the step(s) that prefilled it
    ttft_ms: float  # mean first-token time (the two above, summed)


def step_ends(result: dict) -> np.ndarray:
    """The step boundaries as the client saw them: the first arrival of each group of chunks."""
    arrivals = []
    for start, ttft, gaps in zip(result["start_times"], result["ttfts"], result["itls"]):
        arrivals.extend(start + ttft + np.concatenate([[0.0], np.cumsum(gaps)]))
    arrivals = np.sort(np.asarray(arrivals))
    if not len(arrivals):
        return arrivals
    return arrivals[np.concatenate([[True], np.diff(arrivals) > SAME_STEP_S])]


def first_token_wait(result: dict) -> FirstTokenWait | None:
    ends = step_ends(result)
    if len(ends) < 2:
        return None
    in_progress, own = [], []
    for start, ttft in zip(result["start_times"], result["ttfts"]):
        first = start + ttft
        following = ends[np.searchsorted(ends, start, side="right") :]
        boundary = following[0] if len(following) else first
        # The first boundary after arrival is the request's own first chunk: it found the engine
        # idle (or was admitted at once), and waited for no step in progress.
        wait = 0.0 if boundary >= first - SAME_STEP_S else boundary - start
        in_progress.append(wait)
        own.append(ttft - wait)
    return FirstTokenWait(
        len(ends),
        1e3 * float(np.median(np.diff(ends))),
        1e3 * float(np.mean(in_progress)),
        1e3 * float(np.mean(own)),
        1e3 * float(np.mean(result["ttfts"])),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workload", default=None, help="only this workload")
    args = parser.parse_args(argv)
    print(
        "| round | server | workload | load | steps | median step ms | wait for the step in progress ms | "
        "then to the first token ms | mean TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs_from_folder(args.folder):
        if not run.clean or (args.workload and run.workload != args.workload):
            continue
        found = first_token_wait(run.result)
        if found:
            print(
                f"| {run.round} | {run.server.name} | {run.workload} | {run.point.label} | {found.steps} | "
                f"{found.step_ms:.0f} | {found.in_progress_ms:.0f} | {found.own_step_ms:.0f} | {found.ttft_ms:.0f} |"
            )


if __name__ == "__main__":
    main()
