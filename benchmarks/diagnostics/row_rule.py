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
tokens offered, drafted (verified) and accepted, the batch's tokens per second against plain
decoding's, and each request's rate against plain's over its decoding so far (every request
admitted during the replay, from the step after its first token): the slowest, the 10th
percentile, the median and the fastest. Prefill is not priced: a new request costs its step one
logit row.

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
# decode steps, fitted (benchmarks/NOTES.md, entry 58). Self-drafting is priced out.
CPU_1_5B = {"t0": 0.15, "t_row": 1.9e-3, "t_verify": 9e-3, "self_step": 1.0}


@dataclass
class Life:
    """One request's decoding in the replay, from the step after its first token (as time per
    output token counts it: its first token's step is a prefill)."""

    seconds: float = 0.0
    tokens: int = 0


class PricedSteps:
    """The runner's steps, each priced by the pinned costs as the planner prices it (`t0`, a
    logit row per row and draft token verified, `t_verify` once if any draft is): the batch's
    time and tokens, the drafts verified and accepted, and each request's decoding."""

    def __init__(self, runner, costs: dict):
        self.runner, self.costs, self.run_step = runner, costs, runner.step
        self.steps, self.seconds, self.tokens, self.drafted, self.accepted = 0, 0.0, 0, 0, 0
        self.lives: dict[str, Life] = {}  # requests admitted during the replay
        runner.step = self.step

    def step(self, drafts):
        output, sampled = self.run_step(drafts)
        costs, verified = self.costs, sum(map(len, output.scheduled_spec_decode_tokens.values()))
        seconds = costs["t0"] + costs["t_row"] * (len(sampled) + verified) + costs["t_verify"] * (verified > 0)
        admitted = {r.req_id for r in output.scheduled_new_reqs}
        for row, tokens in zip(self.runner.rows, sampled):
            life = self.lives.get(row.req_id)
            if life is not None:
                life.seconds, life.tokens = life.seconds + seconds, life.tokens + len(tokens)
            elif row.req_id in admitted and self.steps:  # (the first step's rows are caught mid-answer)
                self.lives[row.req_id] = Life()
        self.steps += 1
        self.seconds, self.tokens = self.seconds + seconds, self.tokens + sum(map(len, sampled))
        self.drafted += verified
        self.accepted += sum(len(tokens) - 1 for tokens in sampled if tokens)
        return output, sampled


def replay(answers: list, *, batch: int, steps: int, options: dict, costs: dict, seed: int) -> dict:
    """One objective's run: its counts, and its batch's and requests' rates against plain's
    (unrounded). A request's rate is over its decoding so far, as the per-row rule holds it,
    for every request admitted during the replay, whether it finished or not."""
    runner = recorded_runner(answers, batch, seed)
    priced = PricedSteps(runner, costs)
    # (lookups priced, not timed: the lookup gate decides alike on every machine)
    pinned = {"step_costs": costs, "lookup_seconds_per_row": 2e-6}
    measured = run_ours(runner, k=8, steps=steps, warm_up=0, options=options, history=None, **pinned)
    plain_step = costs["t0"] + costs["t_row"] * batch
    rates = sorted(life.tokens * plain_step / life.seconds for life in priced.lives.values() if life.tokens)
    return {
        "offered": measured.tokens_offered,
        "drafted": priced.drafted,
        "accepted": priced.accepted,
        "batch_x": priced.tokens * plain_step / (priced.seconds * batch),
        "requests": len(rates),
        "slowest_x": rates[0] if rates else None,
        "p10_x": rates[len(rates) // 10] if rates else None,
        "median_x": statistics.median(rates) if rates else None,
        "fastest_x": rates[-1] if rates else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, required=True, help="recorded answers (benchmarks.served_answers)")
    parser.add_argument("--batch", type=int, default=16, help="requests in flight")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=None, help="answers cut to this many tokens")
    for name, value in CPU_1_5B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value, help="seconds (pinned)")
    args = parser.parse_args(argv)
    answers = [a._replace(output=a.output[: args.max_tokens]) for a in served_answers.load(args.answers)[0]]
    costs = {name: getattr(args, name) for name in CPU_1_5B}
    run = {"batch": args.batch, "steps": args.steps, "costs": costs, "seed": args.seed}
    rows = [{"objective": name, **replay(answers, options=options, **run)} for name, options in OBJECTIVES.items()]
    rows = [{key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()} for row in rows]
    cut = f"cut to {args.max_tokens} tokens" if args.max_tokens else "whole"
    print(f"{args.answers.name}, answers {cut}, {args.batch} in flight, {args.steps} steps, costs pinned: {costs}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
