# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Is a change to the proposer's host side faster, and does it plan the same? Two checkouts'
model-free stages (`benchmarks.host_time`), step by step in one process.

Runs of `benchmarks.host_time` one after the other differ by up to 2x on a 2-core VM (a process
lands fast or slow, and the machine's speed comes in bursts), far more than most changes move
it. Here the working tree's pipeline and an earlier commit's (`--against`, a copy of its
`vllm_selfspec` and `benchmarks/host_time.py` under other names) take turns, step by step, each over its own
copy of the same requests, which goes first alternating: each pair of steps meets the same
machine. Per cell, each round's median step of each, their ratio (below 1: the working tree is
faster), each stage's medians, and whether every step planned the same. Step costs pinned as in
`host_time`; the lookup gate told a fixed cost per row, so that plans do not follow the timing.

    .venv/bin/python -m benchmarks.diagnostics.host_time_ab --against HEAD~3
    .venv/bin/python -m benchmarks.diagnostics.host_time_ab --cells recorded:16 nothing:64 --rounds 16
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import numpy as np

from benchmarks import host_time as now

RENAMED = {"vllm_selfspec": "vllm_selfspec_then", "benchmarks": "benchmarks_then"}
# What the copy needs: the package, and of the lab the benchmark alone (its other imports are
# the working tree's, made only where it writes a table, which the copy never does).
ARCHIVED = ("vllm_selfspec", "benchmarks/__init__.py", "benchmarks/host_time.py")
COPIES_KEPT = 4  # commits' copies kept in the cache, the most recently made
REPOSITORY = Path(__file__).resolve().parents[2]
LOOKUP_SECONDS_PER_ROW = 2e-6
HISTORY_TOKENS = 65536  # (`host_time`'s default)


def resolved(rev: str) -> str:
    """The commit `rev` names (an error naming --against if none)."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPOSITORY, capture_output=True, text=True
    )
    if found.returncode:
        raise SystemExit(f"--against: {rev!r} names no commit of {REPOSITORY}")
    return found.stdout.strip()


def copy_of(commit: str):
    """`benchmarks.host_time` of `commit` (a full hash), with its `vllm_selfspec`, imported under
    other names from a copy in the lab's cache (kept: numba's compiled kernels are cached beside
    it). One commit a process: the names are taken."""
    from benchmarks.assets import cache_root

    imported = sys.modules.get("benchmarks_then.host_time")
    if imported is not None:
        if commit not in imported.__file__:
            raise RuntimeError(f"this process compares with {imported.__file__} already, not {commit}")
        return imported
    copies = cache_root() / "host-time-ab"
    into = copies / commit
    if not into.exists():  # (made aside, then moved into place whole: a copy is complete or absent)
        archive = subprocess.run(["git", "archive", commit, *ARCHIVED], cwd=REPOSITORY, capture_output=True, check=True)
        copies.mkdir(parents=True, exist_ok=True)
        making = Path(tempfile.mkdtemp(dir=copies))
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(making, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        names = re.compile(r"\b(" + "|".join(RENAMED) + r")\b")
        for package, renamed in RENAMED.items():
            for path in (making / package).rglob("*.py"):
                path.write_text(names.sub(lambda m: RENAMED[m[1]], path.read_text()))
            (making / package).rename(making / renamed)
        try:
            making.rename(into)
        except OSError:  # (another run made it first)
            shutil.rmtree(making, ignore_errors=True)
    for old in sorted((p for p in copies.iterdir() if p != into), key=lambda p: p.stat().st_mtime)[:-COPIES_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    sys.path.insert(0, str(into))
    return importlib.import_module("benchmarks_then.host_time")


class Side:
    """One checkout's pipeline over its own copy of a cell's requests, driven a step at a time
    as `host_time.run_ours` drives it. (Its loop, written again here: the two sides take turns a
    step at a time, and an earlier commit's `host_time` has only the whole run.)"""

    def __init__(self, module, workload: str, batch: int, *, seed: int, k: int, answer: int, answers):
        # (the history workload's shared pool, and an output joining it each step, as `host_time` has them)
        earlier = module.earlier_outputs(HISTORY_TOKENS, 0)
        self.earlier = earlier if workload == "history" else []
        pool = np.concatenate([np.append(h, -1) for h in earlier])
        made = {"context": 1024, "answer": answer, "history": pool, "seed": seed}
        self.module, self.closed_batches = module, workload == "offline"
        self.runner = module.make_runner(workload, batch, made, answers, None)
        options = module.make_options({"lookup_history_unsalted": True} if self.earlier else {})
        self.pipeline = pipeline = module.DraftPipeline(options, k, module.FailSafe())
        module.pin_step_costs(pipeline.controller.costs, **module.GPU_8B)
        gate = pipeline.controller.lookup_gate
        pipeline.controller.observe_lookup = lambda rows, _: gate.observe_lookup(rows, rows * LOOKUP_SECONDS_PER_ROW)
        for output in self.earlier:
            pipeline.lookup.history.add(None, output)
        self.steps = 0
        self.drafts = [[] for _ in self.runner.rows]
        self.seconds: list[float] = []
        self.parts: dict[str, list[float]] = {}
        self.plans: list[list[int]] = []

    def _lookup_drafts(self, prepared, warm_up: bool) -> list[list[int]]:
        drafts = [[] for _ in range(prepared.step.num_rows)]
        plan = self.module.DraftPlan.from_ints(prepared.plan_ints, len(prepared.offers))
        self.pipeline.take_lookup_drafts(prepared, plan, drafts)
        self.pipeline.lessons.step_ended(drafted=True)
        self.plans.append([int(x) for x in prepared.plan_ints])
        return drafts

    def step(self, measured: bool) -> None:
        module, runner, pipeline = self.module, self.runner, self.pipeline
        output, sampled = runner.step(self.drafts)
        parts: dict[str, float] = {}
        start = time.perf_counter()
        clock = module.PartClock(parts)
        for req_id, request in runner.ended:
            pipeline.forget(req_id, request)
        tenants = tuple((r.req_id, None) for r in output.scheduled_new_reqs)
        pipeline.begin_step(module.SchedulerNote(tenants=tenants, closed_batches=self.closed_batches), runner.requests)
        if self.earlier:  # (another request ended: its output joins the pool)
            pipeline.lookup.history.add(None, self.earlier[self.steps % len(self.earlier)])
        self.steps += 1
        clock.lap("update_states")
        view = module.StepView(runner, output, sampled, pipeline.request_facts)
        self.drafts = pipeline.propose(view, clock, probed=(), warmed_up=True, draft=self._lookup_drafts)
        if measured:
            self.seconds.append(time.perf_counter() - start)
            for part, seconds in parts.items():
                self.parts.setdefault(part, []).append(seconds)


def compare(then, cell: tuple[str, int], *, rounds: int, steps: int, warm_up: int, k: int, answers) -> dict:
    """One cell's rounds, the two pipelines in turns: medians in ms, and the ratios."""
    workload, batch = cell
    answer = k * (warm_up + steps) + 64
    sides = {"then": [], "now": []}
    for round_ in range(rounds):
        pair = {
            name: Side(module, workload, batch, seed=round_, k=k, answer=answer, answers=answers)
            for name, module in (("then", then), ("now", now))
        }
        for i in range(warm_up + steps):
            for name in ("then", "now") if i % 2 else ("now", "then"):
                pair[name].step(measured=i >= warm_up)
        for name, side in pair.items():
            sides[name].append(side)
    ratios = [statistics.median(n.seconds) / statistics.median(t.seconds) for t, n in zip(sides["then"], sides["now"])]
    row = {
        "workload": workload,
        "batch": batch,
        "ratio": statistics.median(ratios),
        "ratios": (min(ratios), max(ratios)),
    }
    for name, runs in sides.items():
        row[name] = 1e3 * statistics.median(statistics.median(side.seconds) for side in runs)
        stages = dict.fromkeys(p for side in runs for p in side.parts)  # (a round may lack one)
        row[f"{name}_stages"] = {
            p: 1e3 * statistics.median(statistics.median(s.parts[p]) for s in runs if p in s.parts) for p in stages
        }
    row["same_plans"] = all(t.plans == n.plans for t, n in zip(sides["then"], sides["now"]))
    return row


def table(rows: list[dict], args) -> str:
    from benchmarks.run import cpu_model

    lines = [
        f"# The working tree's proposer against {args.against_commit[:12]}'s ({args.against}), step by step"
        f" ({cpu_model()}, {os.cpu_count()} CPUs)",
        "",
        f"K = {args.k}, {args.steps} steps measured after {args.warm_up}, {args.rounds} rounds; ms a step, the"
        " median of each round's median step; step costs pinned to an 8B model's H100 step. `python -m"
        " benchmarks.diagnostics.host_time_ab " + " ".join(sys.argv[1:]) + "`",
        "",
        "| workload | batch | then | now | now / then (rounds' range) | stages then -> now (ms) | same plans |",
        "|---|---|---|---|---|---|---|",
    ]
    ms = lambda stages, p: f"{stages[p]:.3f}" if p in stages else "none"  # noqa: E731 (a stage one side lacks)
    for r in rows:
        names = dict.fromkeys([*r["then_stages"], *r["now_stages"]])
        stages = ", ".join(f"{p} {ms(r['then_stages'], p)}->{ms(r['now_stages'], p)}" for p in names)
        low, high = r["ratios"]
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['then']:.3f} | {r['now']:.3f} | "
            f"{r['ratio']:.3f} ({low:.3f}-{high:.3f}) | {stages} | {r['same_plans']} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="the commit to compare the working tree with")
    parser.add_argument(
        "--cells", nargs="+", default=["recorded:16", "nothing:16", "recorded:64"], help="WORKLOAD:BATCH"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--warm-up", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--answers", type=Path, default=None, help="recorded answers (host_time's --answers)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for table.md, results.csv, environment.json")
    args = parser.parse_args(argv)
    try:
        args.cells = [(w, int(b)) for w, b in (cell.split(":") for cell in args.cells)]
    except ValueError:
        parser.error(f"--cells takes WORKLOAD:BATCH, e.g. recorded:16; got {args.cells}")
    unknown = {w for w, _ in args.cells} - set(now.WORKLOADS)
    if unknown:
        parser.error(f"--cells: unknown workloads {sorted(unknown)}; allowed: {list(now.WORKLOADS)}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.workloads = sorted({w for w, _ in args.cells})
    answers = now.recorded_answers(args)
    args.against_commit = resolved(args.against)
    then = copy_of(args.against_commit)
    rows = [
        compare(then, cell, rounds=args.rounds, steps=args.steps, warm_up=args.warm_up, k=args.k, answers=answers)
        for cell in args.cells
    ]
    text = table(rows, args)
    print(text)
    if args.out is not None:
        write(rows, text, args)
    return rows


def write(rows: list[dict], text: str, args) -> None:
    """table.md, results.csv (a cell a row, each stage's medians) and environment.json to --out."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    flat = []
    for row in rows:
        low, high = row["ratios"]
        cell = {k: row[k] for k in ("workload", "batch", "then", "now", "ratio", "same_plans")}
        cell.update(ratio_low=low, ratio_high=high)
        for name in ("then", "now"):
            cell.update({f"{name}_{part}": ms for part, ms in row[f"{name}_stages"].items()})
        flat.append(cell)
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for cell in flat for k in cell)))
        writer.writeheader()
        writer.writerows(flat)
    (args.out / "environment.json").write_text(json.dumps(now.environment(args), indent=2, default=str))


if __name__ == "__main__":
    main()
