# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Where does a request that is slower than under plain decoding lose its time?

Reads a serving results folder (benchmarks.serving) and, for each run and the plain runs the
serving table compares it with (same round, workload and load point), takes each request's
time per output token on both and splits its decoding time in two: the gaps between its tokens
that held a prefill (a gap longer than --prefill-gap times its own run's median gap: a step
carrying another request's prompt) and the rest (steps that only decoded, drafts included). A
request slower because a prompt was prefilled inside its decoding lost to where the scheduler
placed that prompt; one slower in the rest lost to its neighbours' drafts (or its own).

    .venv/bin/python -m benchmarks.diagnostics.request_losses ~/.cache/vllm-selfspec/results/serving-.../
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.serving import Run, baselines, plain_runs, request_tpots, runs_from_folder


def gap_split(gaps: list[float], long_gap: float) -> tuple[float, float]:
    """A request's decoding seconds in long gaps and in the rest."""
    long = sum(gap for gap in gaps if gap > long_gap)
    return long, sum(gaps) - long


def long_gap(result: dict, prefill_gap: float) -> float:
    """A gap that held a prefill: `prefill_gap` times the run's own median gap (a method's
    steps may be longer than plain's, and are not prefills for that)."""
    return prefill_gap * statistics.median(gap for gaps in result["itls"] for gap in gaps)


def losses(method: dict, plain: dict, prefill_gap: float) -> list[dict]:
    """Per request of a run, slowest first: its speed against plain's and where it lost."""
    method_gap, plain_gap = long_gap(method, prefill_gap), long_gap(plain, prefill_gap)
    plain_tpots, method_tpots = request_tpots(plain) or [], request_tpots(method) or []
    rows = []
    for i, (plain_tpot, tpot) in enumerate(zip(plain_tpots, method_tpots)):
        if not plain_tpot or not tpot:  # (one token or none)
            continue
        (plain_long, plain_rest), (long, rest) = (
            gap_split(plain["itls"][i], plain_gap),
            gap_split(method["itls"][i], method_gap),
        )
        rows.append(
            {
                "request": i,
                "prompt_tokens": plain["input_lens"][i],
                "speed_x": plain_tpot / tpot,
                "lost_in_prefill_steps_s": long - plain_long,
                "lost_in_other_steps_s": rest - plain_rest,
            }
        )
    return sorted(rows, key=lambda row: row["speed_x"])


def comparable(run: Run, base: Run) -> bool:
    """Both served every request, the same prompts in the same order."""
    keys = ("itls", "latencies", "input_lens")
    return (
        run.clean
        and base.clean
        and all(k in run.result for k in keys)
        and run.result["input_lens"] == base.result.get("input_lens")
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prefill-gap", type=float, default=4.0, help="a long gap, in the run's median gaps")
    parser.add_argument("--slowest", type=int, default=5, help="requests listed per run")
    args = parser.parse_args(argv)
    runs = runs_from_folder(args.folder)
    plain = plain_runs(runs)
    # Each run against the plain runs it is compared with in the serving table: a plain run
    # against another plain run is the measurement's noise.
    for run in runs:
        for base in baselines(run, plain):
            if comparable(run, base):
                title = (
                    f"round {run.round} {run.server.name} (slot {run.slot}) against plain (slot {base.slot}), "
                    f"{run.workload} {run.point.label}"
                )
                report(title, losses(run.result, base.result, args.prefill_gap), args.slowest)


def report(title: str, rows: list[dict], slowest: int) -> None:
    slower = [row for row in rows if row["speed_x"] < 1]
    in_prefill = sum(row["lost_in_prefill_steps_s"] for row in slower)
    in_other = sum(row["lost_in_other_steps_s"] for row in slower)
    print(
        f"{title}: {len(slower)}/{len(rows)} requests slower; their loss: {in_prefill:.2f} s in steps "
        f"with a prefill, {in_other:.2f} s in the others"
    )
    for row in rows[:slowest]:
        print(
            f"  #{row['request']:<3} {row['prompt_tokens']:>5} prompt tokens  speed {row['speed_x']:.2f}x  "
            f"lost {row['lost_in_prefill_steps_s']:+.2f} s in prefill steps, "
            f"{row['lost_in_other_steps_s']:+.2f} s in the others"
        )


if __name__ == "__main__":
    main()
