# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What does the per-row rule cost a server at capacity, and what does it save its requests?

A step that verifies drafts is longer for every row in it, drafting or not: by a fixed cost of
verification and a logit row per draft token. The default objective holds every request to at
least 98% of plain decoding's rate whatever its neighbours draft (the per-row rule); the
throughput objective takes every draft that pays the batch; `adaptive` off drafts every offer.

This replays recorded answers (`benchmarks.served_answers`), B in flight, each one that ends
replaced by the next, through the proposer's model-free stages (`benchmarks.host_time`'s
recorded workload), with step costs pinned: a step's seconds are those costs', not this
machine's time, so a run gives the same figures anywhere. Per objective it prints the draft
tokens offered, drafted and accepted, the batch's tokens per second against plain decoding's,
and each request's rate against plain's (requests admitted and finished inside the run):
the slowest, the 10th percentile, the median and the fastest.

    .venv/bin/python -m benchmarks.served_answers --model qwen2.5-coder-1.5b --workload code --requests 48
    .venv/bin/python -m benchmarks.diagnostics.row_rule \
        --answers ~/.cache/vllm-selfspec/served-answers/qwen2.5-coder-1.5b-code.npz
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks import served_answers
from benchmarks.host_time import recorded_runner, run_ours
from benchmarks.serve_load import markdown_table

OBJECTIVES = {
    "per-request (default)": {},
    "throughput": {"objective": "throughput"},
    "every offer (adaptive off)": {"adaptive": False},
}
# Qwen2.5-Coder-1.5B's steps at 16 rows, bf16, on a 2-core Xeon: a served capacity run's
# decode steps, fitted (benchmarks/NOTES.md, entry 59). Self-drafting is priced out.
CPU_1_5B = {"t0": 0.15, "t_row": 1.9e-3, "t_verify": 9e-3, "self_step": 1.0}


@dataclass
class Life:
    """One request in the replay: its seconds in the batch and its tokens."""

    whole: bool  # admitted inside the run (its first step is the run's)
    length: int  # its answer's tokens
    seconds: float = 0.0
    tokens: int = 0


def replay(answers: list, *, batch: int, steps: int, options: dict, costs: dict, seed: int) -> dict:
    """One objective's run: its counts, batch rate and per-request rates against plain's."""
    runner = recorded_runner(answers, batch, seed)
    lives: dict[str, Life] = {}
    totals = {"seconds": 0.0, "tokens": 0, "accepted": 0}
    plain_step = costs["t0"] + costs["t_row"] * batch
    run_step = runner.step

    def priced_step(drafts):
        output, sampled = run_step(drafts)
        drafted = sum(map(len, output.scheduled_spec_decode_tokens.values()))
        seconds = costs["t0"] + costs["t_row"] * (len(runner.rows) + drafted) + costs["t_verify"] * (drafted > 0)
        admitted = {r.req_id for r in output.scheduled_new_reqs}
        for row, tokens in zip(runner.rows, sampled):
            life = lives.setdefault(row.req_id, Life(whole=row.req_id in admitted, length=len(row.answer)))
            life.seconds += seconds
            life.tokens += len(tokens)
        totals["seconds"] += seconds
        totals["tokens"] += sum(map(len, sampled))
        totals["accepted"] += sum(len(tokens) - 1 for tokens in sampled if tokens)
        return output, sampled

    runner.step = priced_step
    # (lookups priced, not timed: the lookup gate decides alike on every machine)
    pinned = {"step_costs": costs, "lookup_seconds_per_row": 2e-6}
    measured = run_ours(runner, k=8, steps=steps, warm_up=0, options=options, history=None, **pinned)
    whole = [life for life in lives.values() if life.whole and life.tokens >= life.length]
    rates = sorted(life.tokens * plain_step / life.seconds for life in whole)
    return {
        "offered": measured.tokens_offered,
        "drafted": measured.draft_tokens,
        "accepted": totals["accepted"],
        "batch_x": round(totals["tokens"] * plain_step / (totals["seconds"] * batch), 3),
        "requests": len(rates),
        "slowest_x": round(rates[0], 3) if rates else None,
        "p10_x": round(rates[len(rates) // 10], 3) if rates else None,
        "median_x": round(statistics.median(rates), 3) if rates else None,
        "fastest_x": round(rates[-1], 3) if rates else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, required=True, help="recorded answers (benchmarks.served_answers)")
    parser.add_argument("--batch", type=int, default=16, help="requests in flight")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--seed", type=int, default=0)
    for name, value in CPU_1_5B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value, help="seconds (pinned)")
    args = parser.parse_args(argv)
    answers = served_answers.load(args.answers)[0]
    costs = {name: getattr(args, name) for name in CPU_1_5B}
    run = {"batch": args.batch, "steps": args.steps, "costs": costs, "seed": args.seed}
    rows = [{"objective": name, **replay(answers, options=options, **run)} for name, options in OBJECTIVES.items()]
    print(f"{args.answers.name}, {args.batch} in flight, {args.steps} steps, step costs pinned: {costs}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
