# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Open-loop serving benchmark: vLLM's own `vllm bench serve` against one `vllm serve` per method.

    .venv/bin/python -m benchmarks.serving                  # quick: SmolLM2-135M
    .venv/bin/python -m benchmarks.serving --mode full      # Qwen2.5-Coder-1.5B, draft_model = its 0.5B sibling
    .venv/bin/python -m benchmarks.serving --methods plain self-admg --worker-cores all default
    .venv/bin/python -m benchmarks.serving --decide --model MODEL --prompts-file mine.jsonl   # for me, on my model?

Every server is started with the same flags (only `--speculative-config` differs), one at a time,
its CPU worker computing on every core (`--worker-cores default` adds vLLM's own binding). The
plain server runs again after each method, and each method is compared with the mean of the
plain runs beside it: this VM's speed drifts by up to half between servers minutes apart
(`--no-plain-between`: plain once per round).
For each workload, `vllm bench serve` first sends requests at an unlimited rate under a concurrency
cap (on the plain server, which runs first, this measures its capacity C), then at `--load` x C
requests/s with Poisson arrivals: from a rate at which requests rarely overlap to one beyond what
the plain server can serve. Every server gets the same rates, and every load point prompts of its
own: vLLM's suffix method and self-admg's lookup would otherwise draft a repeated prompt's answer
from what they served before. Multi-turn: each MT-Bench conversation's first turn is sent,
unmeasured, then its second turn, whose prompt holds the first answer as a chat client sends it;
the measured requests are the second turns. Workloads: code (HumanEval, raw completion
prompts), summarization (news articles), chat (IFBench instructions) and multi-turn (MT-Bench),
the last three through the model's chat template. Mixed workloads (code+chat, summarization+chat,
repeated+chat; not run unless named) take two workloads' prompts in turn, "repeated" being a long
raw prompt of one word: requests that gain from drafts beside requests that gain little.

Writes to --out (default: a dated folder in the cache, outside the repository: benchmarks/output.py):
raw/ (the JSON `vllm bench serve` saved, one file per run), workloads/ (the JSONL it was fed), the
servers' logs, table.md and results.csv (each ratio against the plain server of the same round),
throughput.png and tpot.png (one panel per workload, one line per method), and environment.json
(CPU, instruction set, dtype, versions). table.md ends with a verdict per cell: faster or slower
only where every round lies beyond plain's own spread there, else level.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import itertools
import json
import math
import random
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine import CORES_ENV_VAR
from benchmarks.output import default_out
from benchmarks.serve_load import VLLM, VllmServer, markdown_table, server_flags
from vllm_selfspec.operations.counters import PROPOSER_PARTS

WARMUP_REQUESTS = 8
# "own": the user's prompts (--prompts-file), to decide for their own workload (--decide).
# "X+chat": X's prompts and chat's taken in turn, so that requests which gain from drafts and
# requests which gain little share steps: what the controller must keep from costing the latter.
# "repeated" is a long prompt of one word repeated, whose answer is drafted almost surely.
UNMIXED = ("code", "summarization", "chat", "multiturn")
MIXED = ("code+chat", "summarization+chat", "repeated+chat")
WORKLOADS = (*UNMIXED, *MIXED, "own")
REPEATED_WORDS = 1500  # words in a repeated prompt: a long context that each verified token reads
MODES = {  # model, draft model for draft_model, prompts per load point, output tokens per request
    "quick": ("smollm2-135m", None, 12, 64),
    "full": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 12, 128),
}
# The unlimited-rate run gets this many times its concurrency cap in prompts (or what a workload
# has left after its rates: MT-Bench has 80 conversations), so that the run times a server kept
# full rather than its first and last waves. When most answers reach one token limit, plain
# decoding's requests of a wave still finish together however many waves there are: the next
# wave's prompts are prefilled while nobody decodes (first-token time, not TPOT), and a method
# whose requests finish at different times pays each prefill inside the others' decoding.
# So by default (`--output-spread`) each request has a token limit of its own, as real answers
# have lengths of their own; `--output-spread 0` gives every request the same limit.
SATURATION_PROMPTS_PER_SLOT = 6
PROPOSER_REPORT = "vllm_selfspec.operations.worker_extension.SelfAdmgWorkerExtension"
# What a self-admg server's proposer spent during a run (differences of its counters).
PROPOSER_COUNTERS = (
    "prompts_measured",
    "probe_seconds",
    "draft_steps",
    "draft_tokens",
    "draft_seconds",
    "rows_looked_up",  # (none while the lookup gate is closed)
    "tokens_offered",  # lookup and prediction draft tokens offered to the plan, before it chose
    "lookup_tokens",  # (predictions' included)
    "lookup_accepted",  # (predictions' not: prediction_accepted)
    "prediction_tokens",
    "prediction_accepted",
    "draft_tokens_withheld",  # made, but the scheduler did not verify them (beside a prefill)
    "steps_prompts_waiting",  # steps planned with nothing, for prompts the scheduler could admit
    "lookup_expected",
    "lookup_estimated",
    "faults",
    "propose_calls",
    "propose_seconds",
    "propose_cpu_seconds",
)
PROPOSER_COLUMNS = {  # column: what it reads of a run's proposer counters
    # (None where the run's server did not count it: folders from before a counter existed.)
    "probe_s": lambda p: p.get("probe_seconds"),
    "self_draft_s": lambda p: p.get("draft_seconds"),
    "self_draft_tokens": lambda p: p.get("draft_tokens"),
    # The proposer's own time per step (lookup, planning, probes and self-drafts), which every
    # step waits for.
    "propose_ms_per_step": lambda p: (
        1000 * p["propose_seconds"] / p["propose_calls"] if p.get("propose_calls") else None
    ),
    # ... of which its thread was on a core (the rest: descheduled or blocked).
    "propose_cpu_ms_per_step": lambda p: (
        1000 * p["propose_cpu_seconds"] / p["propose_calls"]
        if p.get("propose_calls") and "propose_cpu_seconds" in p
        else None
    ),
    # ... and by part (vllm_selfspec.operations.counters.PROPOSER_PARTS): where it goes.
    **{
        f"propose_ms_{part}": lambda p, part=part: (
            1000 * p["part_seconds"][part] / p["propose_calls"]
            if p.get("part_seconds") and p["part_seconds"].get(part) is not None and p.get("propose_calls")
            else None
        )
        for part in PROPOSER_PARTS
    },
    # Lookup tokens accepted over those the planner expected to be: below 1, it drafts on
    # hopes that verification does not bear out.
    "lookup_accepted_x_expected": lambda p: (
        p["lookup_accepted"] / p["lookup_expected"] if p.get("lookup_expected") else None
    ),
    # The same against the estimates before the planner scaled them by what verification bore
    # out: how far choosing among noisy estimates overrates the drafts chosen.
    "lookup_accepted_x_estimated": lambda p: (
        p["lookup_accepted"] / p["lookup_estimated"] if p.get("lookup_estimated") else None
    ),
}


DEFAULT_CORES = " (default cores)"  # a server name's mark of vLLM's own core binding


@dataclass(frozen=True)
class Server:
    """One `vllm serve` set-up: a method, and whether its CPU worker keeps vLLM's default cores
    (one core for the worker, the other for the engine process) instead of every core."""

    method: str
    speculative_config: dict | None
    default_cores: bool = False

    @property
    def name(self) -> str:
        return self.method + (DEFAULT_CORES if self.default_cores else "")

    @property
    def slug(self) -> str:
        """The name in file names (no spaces)."""
        return self.name.replace(" ", "_")

    @staticmethod
    def from_slug(slug: str) -> Server:
        """The set-up a file name names (its speculative config: the method's)."""
        from benchmarks.run import choose_methods, method_configs

        suffix = DEFAULT_CORES.replace(" ", "_")
        method = slug.removesuffix(suffix)
        known = method_configs(None)
        config = choose_methods(known, method, [method])[method] if method.partition("@")[0] in known else None
        return Server(method, config, slug.endswith(suffix))

    @property
    def reports_proposer(self) -> bool:
        """A self-admg server answers for its proposer (what its probes and self-drafts cost)."""
        return (self.speculative_config or {}).get("method") == "self-admg"

    def args(self, common: list[str]) -> list[str]:
        spec = ["--speculative-config", json.dumps(self.speculative_config)] if self.speculative_config else []
        report = ["--worker-extension-cls", PROPOSER_REPORT] if self.reports_proposer else []
        return [*common, *spec, *report]

    def env(self, every_core: str) -> dict[str, str]:
        """The worker's cores: `every_core` (a CORES_ENV_VAR value), or vLLM's default."""
        dev_mode = {"VLLM_SERVER_DEV_MODE": "1"} if self.reports_proposer else {}  # for /collective_rpc
        return {CORES_ENV_VAR: "auto" if self.default_cores else every_core, **dev_mode}


@dataclass(frozen=True)
class LoadPoint:
    """One `vllm bench serve` run's arrivals: a rate (inf: all at once) and a concurrency cap."""

    label: str  # "max" or the load as a fraction of the plain server's capacity, e.g. "0.3C"
    rate: float
    max_concurrency: int | None = None

    def flags(self) -> list[str]:
        flags = ["--request-rate", "inf" if math.isinf(self.rate) else f"{self.rate:.4g}"]
        return flags + (["--max-concurrency", str(self.max_concurrency)] if self.max_concurrency else [])


@dataclass
class Run:
    round: int
    server: Server
    workload: str
    point: LoadPoint
    result: dict  # what `vllm bench serve` saved ({} if it did not finish)
    error: str | None = None  # why the run did not finish
    identical_to_plain: int | None = None  # requests whose text equals the plain server's
    proposer: dict | None = None  # PROPOSER_COUNTERS spent during the run (self-admg servers)
    slot: int = 0  # the server's place in its round: a method is compared with the plain runs beside it
    engine: dict | None = None  # ENGINE_COUNTERS spent during the run

    def metric(self, key: str) -> float | None:
        return self.result.get(key)

    @property
    def clean(self) -> bool:
        """Finished with every request served: only such runs are compared."""
        return self.error is None and self.result.get("failed") == 0 and bool(self.result.get("completed"))

    def baseline_key(self) -> tuple:
        """The plain run this one is compared with: the plain server with the same cores (plain
        with vLLM's default cores is compared with plain on every core)."""
        default_cores = self.server.default_cores and self.server.method != "plain"
        return self.round, self.workload, self.point.label, default_cores


@dataclass
class Plan:
    """What every server is sent, fixed by the first (plain) server: the load points of each
    workload (from its capacity) and the first answers of the multi-turn conversations."""

    points: dict[str, list[LoadPoint]] = field(default_factory=dict)
    first_answers: list[str] | None = None


# ---- workloads ------------------------------------------------------------------------------


def chat_text(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def first_prompts(workload: str, tokenizer, prompts_file: Path | None = None) -> list[str]:
    """The prompts of a workload in fixed order (for multi-turn: the first turns). Code is sent
    as a raw completion prompt, the others through the model's chat template; the user's own
    (`prompts_file`, JSON lines) as each line's "prompt", or its "messages" through the template."""
    from benchmarks import assets

    if workload == "own":
        if prompts_file is None:
            raise SystemExit("the 'own' workload needs --prompts-file FILE.jsonl")
        lines = enumerate(prompts_file.read_text().splitlines(), start=1)
        return [own_prompt(tokenizer, prompts_file, number, line) for number, line in lines if line.strip()]
    if workload in MIXED:
        first, second = (first_prompts(part, tokenizer) for part in workload.split("+"))
        return [prompt for pair in zip(first, second) for prompt in pair]
    if workload == "repeated":
        return repeated_prompts(len(assets.load_prompts("humaneval")))
    if workload == "code":
        return assets.load_prompts("humaneval")
    # (The news corpus repeats a few articles: a repeat would be drafted from its first answer.)
    texts = list(
        dict.fromkeys(assets.load_prompts({"summarization": "news", "chat": "ifbench"}.get(workload, "mtbench")))
    )
    return [chat_text(tokenizer, [{"role": "user", "content": text}]) for text in texts]


def own_prompt(tokenizer, path: Path, number: int, line: str) -> str:
    """One line of the user's prompts file: {"prompt": text} sent as is, or {"messages": [...]}
    through the model's chat template; anything else stops the run, naming the line."""
    where = f"--prompts-file {path}, line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise SystemExit(f"{where}: not JSON ({err})") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"]
    if not (isinstance(item, dict) and isinstance(item.get("messages"), list)):
        raise SystemExit(f'{where}: needs "prompt" (a string) or "messages" (a list of chat messages)')
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f'{where}: "messages" needs a chat template, and this model has none: send "prompt"')
    return chat_text(tokenizer, item["messages"])


def repeated_prompts(count: int) -> list[str]:
    """Raw prompts of one word repeated about REPEATED_WORDS times, each prompt its own word and
    length (no two alike, as every load point gets prompts of its own)."""
    words = ("yes", "no", "ok", "go", "la", "ha", "up", "on", "so", "hi", "oh", "me", "we", "be", "do", "to")
    return [" ".join([words[i % len(words)]] * (REPEATED_WORDS + i)) for i in range(count)]


def warmup_prompts() -> list[str]:
    """Prompts no load point uses (HumanEval's last), to warm each server up unmeasured."""
    from benchmarks import assets

    return assets.load_prompts("humaneval")[-WARMUP_REQUESTS:]


def warm_up(server: VllmServer) -> None:
    """The unmeasured warm-up every server gets before its first measured request."""
    asyncio.run(complete_all(server, warmup_prompts(), 16, WARMUP_REQUESTS))


def second_turn_prompt(tokenizer, turns: list[str], answer: str) -> str:
    return chat_text(
        tokenizer,
        [
            {"role": "user", "content": turns[0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": turns[1]},
        ],
    )


def output_range(mean: int, spread: float) -> tuple[int, int]:
    """The fewest and most max_tokens a request gets: mean * [1 - spread, 1 + spread]."""
    return max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))


def output_lengths(count: int, mean: int, spread: float, seed: str) -> list[int]:
    """Each request's max_tokens, drawn uniformly from output_range (as vLLM's random dataset
    draws them with its range ratio; with `spread` 0, `mean` for all), the same for every
    server: answers that end at different lengths, as real ones do, instead of every request
    running to the same limit (see SATURATION_PROMPTS_PER_SLOT)."""
    rng = random.Random(seed)  # a str seed is stable across processes and runs
    low, high = output_range(mean, spread)
    return [rng.randint(low, high) for _ in range(count)]


def write_jsonl(path: Path, prompts: list[str], output_tokens: list[int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p, n in zip(prompts, output_tokens, strict=True)
        )
    )
    return path


def slices(prompts: list, sizes: list[int], workload: str) -> list[list]:
    """Disjoint runs of prompts, in order, one of each size."""
    if sum(sizes) > len(prompts):
        raise SystemExit(
            f"{workload}: load points of {'+'.join(map(str, sizes))} prompts need {sum(sizes)}; "
            f"it has {len(prompts)} (lower --prompts-per-point or --max-concurrency)"
        )
    ends = list(itertools.accumulate(sizes))
    return [prompts[end - size : end] for size, end in zip(sizes, ends)]


def point_sizes(args, available: int) -> list[int]:
    """Prompts per load point of a workload with `available` prompts: the unlimited-rate run's,
    then each rate's."""
    rates = [args.prompts_per_point] * len(args.load)
    saturation = args.saturation_prompts
    if saturation is None:
        saturation = min(SATURATION_PROMPTS_PER_SLOT * args.max_concurrency, available - sum(rates))
    if saturation < args.max_concurrency:
        raise SystemExit(
            f"the unlimited-rate run needs at least --max-concurrency ({args.max_concurrency}) "
            f"prompts, it gets {saturation} (of {available}: lower --prompts-per-point or the loads)"
        )
    return [saturation, *rates]


async def complete_all(server: VllmServer, prompts: list[str], max_tokens: int, concurrency: int) -> list[str]:
    """Greedy completions of `prompts` (the unmeasured first turns), `concurrency` at a time."""
    client, gate = server.async_client(max_retries=0, timeout=3600), asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> str:
        async with gate:
            response = await client.completions.create(
                model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0
            )
            return response.choices[0].text

    try:
        return list(await asyncio.gather(*map(one, prompts)))
    finally:
        await client.close()


# ---- runs -----------------------------------------------------------------------------------


def bench_command(
    server: VllmServer,
    tokenizer: str,
    dataset: Path,
    point: LoadPoint,
    num_prompts: int,
    result_dir: Path,
    result_name: str,
    temperature: float,
) -> list[str]:
    """A `vllm bench serve` command: the dataset's prompts in file order, sent as they are (already
    templated), each with its own output length, seeded arrivals, results saved as JSON."""
    return [
        VLLM,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        server.url(),
        "--model",
        server.model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--custom-output-len",
        "-1",
        "--skip-chat-template",
        "--disable-shuffle",
        "--no-oversample",
        "--num-prompts",
        str(num_prompts),
        *point.flags(),
        "--seed",
        "0",
        "--temperature",
        str(temperature),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
        "--disable-tqdm",
    ]


def bench(command: list[str], log: Path, timeout: float) -> dict:
    with open(log, "a") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=True)
    result_dir, name = Path(command[command.index("--result-dir") + 1]), command[command.index("--result-filename") + 1]
    return json.loads((result_dir / name).read_text())


def unlimited_point(cap: int) -> LoadPoint:
    return LoadPoint("max", math.inf, cap)


def capacity_points(capacity: float, loads: list[float], cap: int) -> list[LoadPoint]:
    return [unlimited_point(cap), *(LoadPoint(f"{f:g}C", f * capacity) for f in loads)]


def run_timeout(point: LoadPoint, prompts: int, floor: float) -> float:
    """Arrivals alone take prompts / rate seconds at a finite rate."""
    return floor if math.isinf(point.rate) else max(floor, 3 * prompts / point.rate + 600)


def proposer_state(server: VllmServer, spec: Server) -> dict | None:
    """The proposer's counters, or None (other methods; or the server did not answer, which
    costs only this diagnostic, not the run)."""
    import httpx

    try:
        return server.rpc("self_admg_state")[0] if spec.reports_proposer else None
    except (httpx.HTTPError, KeyError, IndexError):
        return None


# vLLM's own counters a run reads from /metrics (differences over the run): how much of the
# prompts its prefix cache held, and where the first tokens waited (the engine's queue, the
# prefill; the rest of a first token's time is the front end's).
ENGINE_COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:time_to_first_token_seconds_count",
    "first_token_s": "vllm:time_to_first_token_seconds_sum",
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    # The proposer's time, as an operator reads it (self-admg servers; 0 on others).
    "proposer_s": "vllm:self_admg_proposer_seconds_total",
}
ENGINE_COLUMNS = {  # column: what it reads of a run's engine counters
    "prefix_cache_hit_rate": lambda e: e["prefix_cache_hits"] / e["prefix_cache_queries"],
    "queue_ms": lambda e: 1000 * e["queue_s"] / e["requests"],
    "prefill_ms": lambda e: 1000 * e["prefill_s"] / e["requests"],
    "front_end_ms": lambda e: 1000 * (e["first_token_s"] - e["queue_s"] - e["prefill_s"]) / e["requests"],
}


def engine_state(server: VllmServer) -> dict | None:
    """The server's ENGINE_COUNTERS, or None (only this diagnostic is lost)."""
    import httpx

    try:
        metrics = server.metrics()
    except (httpx.HTTPError, ValueError):
        return None
    return {key: metrics.get(sample, 0.0) for key, sample in ENGINE_COUNTERS.items()}


def save_steps(server: VllmServer, before: dict | None, after: dict | None, path: Path) -> None:
    """The run's steps as a self-admg server's controller timed them (prompt tokens, logit rows,
    sampled rows, draft tokens, seconds), to check its step-cost fit against: the server keeps
    its last few thousand steps, and this run's are the last `steps_timed` after less before."""
    import httpx

    if before is None or after is None:
        return
    try:
        steps = server.rpc("self_admg_steps")[0]
    except (httpx.HTTPError, KeyError, IndexError):
        return
    path.write_text(json.dumps(run_steps(steps, after["steps_timed"] - before["steps_timed"])))


def run_steps(kept: list, timed_during_run: int) -> list:
    """The steps of one run from the server's last `kept` steps."""
    return kept[len(kept) - min(timed_during_run, len(kept)) :]


def save_run_notes(run: Run, raw: Path, slug: str) -> None:
    """What `vllm bench serve`'s own JSON does not hold, beside it, so that a folder can be
    summarized again (`--summarize`): why a run failed (then there is no JSON of its own) and
    what a self-admg server's proposer spent."""
    if run.error:
        (raw / f"{slug}-error.txt").write_text(run.error)
    if run.proposer is not None:
        (raw / f"{slug}-proposer.json").write_text(json.dumps(run.proposer))
    if run.engine is not None:
        (raw / f"{slug}-engine.json").write_text(json.dumps(run.engine))


# r<round>-<slot>-<server>-<workload>-<load>.json (folders written before servers had slots: no slot)
RAW_NAME = re.compile(rf"r(\d+)-(?:(\d+)-)?(.+)-({'|'.join(map(re.escape, WORKLOADS))})-(max|[\d.]+C)$")


def runs_from_folder(out: Path) -> list[Run]:
    """The runs a results folder holds, from raw/: each with its result, error and proposer's
    counters. A run that saved no result takes its rate from the runs of its load point."""
    raw = out / "raw"
    names = sorted({p.name.removesuffix(".json").removesuffix("-error.txt") for p in raw.iterdir()})
    found = [(name, match.groups()) for name in names if (match := RAW_NAME.fullmatch(name))]
    read = lambda path, parse: parse(path.read_text()) if path.exists() else None  # noqa: E731
    results = {name: read(raw / f"{name}.json", json.loads) or {} for name, _ in found}
    rates = {
        (workload, label): result["request_rate"]
        for (name, (*_, workload, label)) in found
        if "request_rate" in (result := results[name])
    }
    runs = []
    for name, (round_, slot, server, workload, label) in found:
        rate = rates.get((workload, label), math.nan)
        point = LoadPoint(label, math.inf if rate == "inf" else float(rate), results[name].get("max_concurrency"))
        runs.append(
            Run(
                int(round_),
                Server.from_slug(server),
                workload,
                point,
                results[name],
                error=read(raw / f"{name}-error.txt", str),
                proposer=read(raw / f"{name}-proposer.json", json.loads),
                engine=read(raw / f"{name}-engine.json", json.loads),
                slot=int(slot or 0),
            )
        )
    # In the order they ran: round, server, workload, then the unlimited rate before the others.
    return sorted(
        runs, key=lambda r: (r.round, r.slot, WORKLOADS.index(r.workload), -math.isinf(r.point.rate), r.point.rate)
    )


def spent(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    spent_ = {key: round(after[key] - before[key], 3) for key in PROPOSER_COUNTERS}
    if "part_seconds" in after:  # (servers from before the proposer's time was split by part)
        begun, ended = before.get("part_seconds", {}), after["part_seconds"]
        # (a part a server did not count yet stays unknown, not 0)
        spent_["part_seconds"] = {
            p: round(ended[p] - begun.get(p, 0), 4) if p in ended else None for p in PROPOSER_PARTS
        }
    return spent_


def load_slices(server: VllmServer, workload: str, plan: Plan, args, tokenizer) -> list[list[str]]:
    """The prompts of each load point. Multi-turn: the first turns are sent now, unmeasured, and
    the second turns carry the first server's answers, so every server measures the same prompts."""
    prompts = first_prompts(workload, tokenizer, args.prompts_file)
    prompt_slices = slices(prompts, point_sizes(args, len(prompts)), workload)
    if workload != "multiturn":
        return prompt_slices
    from benchmarks import assets

    answers = asyncio.run(
        complete_all(server, [p for s in prompt_slices for p in s], args.output_tokens, args.max_concurrency)
    )
    plan.first_answers = plan.first_answers or answers
    conversations = iter(assets.mtbench_conversations())
    answers_left = iter(plan.first_answers)
    return [[second_turn_prompt(tokenizer, next(conversations), next(answers_left)) for _ in s] for s in prompt_slices]


def serve_workload(
    server: VllmServer, spec: Server, workload: str, plan: Plan, args, tokenizer, out: Path, round_: int, slot: int = 0
) -> list[Run]:
    runs = []
    for index, prompts in enumerate(load_slices(server, workload, plan, args, tokenizer)):
        if workload in plan.points:
            point = plan.points[workload][index]
        elif index == 0:  # the first server's capacity run, which sets the rates
            point = unlimited_point(args.max_concurrency)
        else:
            raise RuntimeError(f"{workload}: no rates, the first server's unlimited-rate run failed")
        slug = f"r{round_}-{slot}-{spec.slug}-{workload}-{point.label}"  # read back by RAW_NAME
        lengths = output_lengths(len(prompts), args.output_tokens, args.output_spread, f"{workload}-{index}")
        dataset = write_jsonl(out / "workloads" / f"{slug}.jsonl", prompts, lengths)
        command = bench_command(
            server, args.model_path, dataset, point, len(prompts), out / "raw", f"{slug}.json", args.temperature
        )
        try:
            before, engine_before = proposer_state(server, spec), engine_state(server)
            result = bench(command, out / "bench.log", run_timeout(point, len(prompts), args.run_timeout))
            after, engine_after = proposer_state(server, spec), engine_state(server)
            run = Run(round_, spec, workload, point, result, proposer=spent(before, after), slot=slot)
            if engine_before is not None and engine_after is not None:
                run.engine = {key: engine_after[key] - engine_before[key] for key in ENGINE_COUNTERS}
            save_steps(server, before, after, out / "raw" / f"{slug}-steps.json")
        except (subprocess.SubprocessError, OSError, ValueError) as error:
            run = Run(round_, spec, workload, point, {}, error=f"{type(error).__name__}: {error}"[:300], slot=slot)
        if server.process.poll() is not None:
            run.error = f"the server exited with {server.process.returncode}"
        save_run_notes(run, out / "raw", slug)
        runs.append(run)
        print(
            f"  {slug}: "
            + (
                run.error
                or f"{run.metric('completed')} done, {run.metric('failed')} failed, "
                f"{run.metric('output_throughput'):.1f} tok/s, TPOT {run.metric('mean_tpot_ms') or 0:.0f} ms"
            ),
            flush=True,
        )
        if index == 0 and workload not in plan.points and run.clean:
            plan.points[workload] = capacity_points(run.metric("request_throughput"), args.load, args.max_concurrency)
        if server.process.poll() is not None or workload not in plan.points:
            break
    return runs


def run_server(spec: Server, plan: Plan, args, tokenizer, out: Path, round_: int, slot: int = 0) -> list[Run]:
    """Every workload's load points on one fresh server, after an unmeasured warm-up."""
    common = server_flags(args.model_path, args.dtype, args.max_model_len, args.kv_cache_gb, seed=0)
    common += ["--enable-logging-iteration-details"] if args.log_steps else []
    log = out / f"server-r{round_}-{slot}-{spec.slug}.log"
    print(f"round {round_}: {spec.name}", flush=True)
    runs: list[Run] = []
    with VllmServer(args.model_path, *spec.args(common), log_path=log, env=spec.env(args.every_core)) as server:
        warm_up(server)
        for workload in args.workloads:
            runs += serve_workload(server, spec, workload, plan, args, tokenizer, out, round_, slot)
            if server.process.poll() is not None:
                break
    return runs


# ---- summary --------------------------------------------------------------------------------


def plain_runs(runs: list[Run]) -> dict[tuple, list[Run]]:
    """The plain servers' runs, by the key other runs name as their baseline (Run.baseline_key)."""
    plain: dict[tuple, list[Run]] = {}
    for r in runs:
        if r.server.method == "plain":
            plain.setdefault(r.baseline_key()[:3] + (r.server.default_cores,), []).append(r)
    return plain


def baselines(run: Run, plain: dict[tuple, list[Run]]) -> list[Run]:
    """The plain runs `run` is compared with: of those it names (Run.baseline_key), the ones
    beside it in its round if any (this VM's speed drifts between servers minutes apart), else all."""
    named = [base for base in plain.get(run.baseline_key(), []) if base is not run]
    if not named and run.server.method == "plain" and run.server.default_cores:
        # No plain run on every core to compare with: its own others, the noise.
        named = [base for base in plain.get(run.baseline_key()[:3] + (True,), []) if base is not run]
    return [base for base in named if abs(base.slot - run.slot) == 1] or named


def mark_identical(runs: list[Run]) -> None:
    """Count each run's requests whose generated text equals its baseline's (both served)."""
    plain = plain_runs(runs)
    for run in runs:
        base = next(iter(baselines(run, plain)), None)
        if base is None or "generated_texts" not in run.result or "generated_texts" not in base.result:
            continue
        served = lambda r: [not e for e in r.result.get("errors") or [""] * len(r.result["generated_texts"])]  # noqa: E731
        run.identical_to_plain = sum(
            a == b and ok_a and ok_b
            for a, b, ok_a, ok_b in zip(
                run.result["generated_texts"], base.result["generated_texts"], served(run), served(base)
            )
        )


RATIOS = {  # name: (metric, True for the run's value over plain's, False for plain's over the run's)
    "throughput_x": ("output_throughput", True),  # above 1 is faster
    "mean_tpot_x": ("mean_tpot_ms", False),  # a time, inverted: above 1 is faster
    "p99_tpot_x": ("p99_tpot_ms", False),
    "p99_ttft_x": ("p99_ttft_ms", True),  # a time as it is: below 1 is faster
    # A request's whole time, first token and the rest: at capacity a method can trade one
    # for the other (requests admitted sooner decode beside more prefills).
    "mean_e2el_x": ("mean_e2el_ms", False),
}


def ratio(run: Run, bases: list[Run], metric: str, run_over_base: bool) -> float | None:
    """The run's metric against the mean of its baselines'."""
    a, b = run.metric(metric), [base.metric(metric) for base in bases]
    if not a or not b or not all(b):
        return None
    return a / statistics.mean(b) if run_over_base else statistics.mean(b) / a


def spread(values: list[float]) -> str:
    """Ratios over rounds as min-max ('' for none)."""
    if not values:
        return ""
    return f"{min(values):.2f}" if len(values) == 1 else f"{min(values):.2f}-{max(values):.2f}"


def paired_ttft_ratio(run: Run, bases: list[Run]) -> float | None:
    """The median, over the run's requests, of each request's TTFT against the same prompt's
    mean TTFT on its baselines (below 1 is faster). Every server gets the same prompts per load
    point in the same order, so requests pair up; with a dozen requests a p99 is nearly the
    slowest one, which one late arrival decides."""
    lens = run.result.get("input_lens")

    def paired_ttfts(r: Run) -> list | None:
        values = r.result.get("ttfts")
        return values if values and lens is not None and r.result.get("input_lens") == lens else None

    mine, theirs = paired_ttfts(run), [paired_ttfts(base) for base in bases]
    if not mine or not theirs or None in theirs or not all(map(all, theirs)):
        return None
    return statistics.median(t / statistics.mean(others) for t, *others in zip(mine, *theirs))


def request_tpots(result: dict) -> list[float | None] | None:
    """Each request's time per output token after its first, in seconds (None where it emitted
    one token or none), from what `vllm bench serve --save-detailed` saved (a run's result)."""
    latencies, ttfts, lens = (result.get(k) for k in ("latencies", "ttfts", "output_lens"))
    if not latencies or not ttfts or not lens:
        return None
    return [(e - t) / (n - 1) if n and n > 1 else None for e, t, n in zip(latencies, ttfts, lens)]


def paired_request_speeds(run: Run, bases: list[Run]) -> list[float] | None:
    """Each request's speed against the same prompt's on its baselines: their mean time per
    output token over its own (above 1 is faster). vLLM users time requests one by one: the
    batch's mean can gain while some requests pay for others' drafts."""
    lens = run.result.get("input_lens")
    if lens is None or any(base.result.get("input_lens") != lens for base in bases):
        return None
    mine, theirs = request_tpots(run.result), [request_tpots(base.result) for base in bases]
    if mine is None or None in theirs:
        return None
    return [statistics.mean(others) / own for own, *others in zip(mine, *theirs) if own and all(others)] or None


def low_end(speeds: list[float], share: float = 0.1) -> float:
    """The `share` quantile of per-request speeds (the slower end), by the nearest rank."""
    ordered = sorted(speeds)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def summarize(runs: list[Run]) -> list[dict]:
    """One row per (workload, load point, server): medians over rounds; ratio ranges over the
    rounds whose runs, and their baseline's, served every request. Plain's own row, where its
    round ran it more than once, has each plain run against the others: the noise floor."""
    plain = plain_runs(runs)
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.point.label, run.server.name), []).append(run)
    rows = []
    for (workload, label, server), group in groups.items():
        rate = group[0].point.rate
        row = {
            "workload": workload,
            "load": label,
            "server": server,
            "rate_req_s": "inf" if math.isinf(rate) else float(f"{rate:.4g}"),
            "rounds": len(group),
            "failed": sum(r.metric("failed") or 0 for r in group),
            "errors": sum(r.error is not None for r in group),
        }
        for key in (
            "output_throughput",
            "total_output_tokens",
            "mean_tpot_ms",
            "p90_tpot_ms",
            "p99_tpot_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
            "spec_decode_acceptance_length",
        ):
            values = [r.metric(key) for r in group if r.metric(key) is not None]
            row[key] = round(statistics.median(values), 2) if values else None
        for name, read in PROPOSER_COLUMNS.items():
            values = [v for r in group if r.proposer and (v := read(r.proposer)) is not None]
            row[name] = round(statistics.median(values), 2) if values else None
        for name, read in ENGINE_COLUMNS.items():
            values = [
                read(r.engine) for r in group if r.engine and r.engine["prefix_cache_queries"] and r.engine["requests"]
            ]
            row[name] = round(statistics.median(values), 3) if values else None
        # The proposer's share of the run's time, from /metrics: what every step waited for it.
        values = [
            100 * r.engine["proposer_s"] / r.metric("duration")
            for r in group
            if r.engine and r.engine.get("proposer_s") and r.metric("duration")
        ]
        row["proposer_pct_of_run"] = round(statistics.median(values), 3) if values else None
        pairs = [
            (r, bases)
            for r in group
            if (bases := baselines(r, plain)) and r.clean and all(base.clean for base in bases)
        ]
        for name, (metric, run_over_base) in RATIOS.items():
            values = [v for r, bases in pairs if (v := ratio(r, bases, metric, run_over_base)) is not None]
            row[name] = spread(values)
        values = [v for r, bases in pairs if (v := paired_ttft_ratio(r, bases)) is not None]
        row["ttft_paired_x"] = spread(values)
        speeds = [v for r, bases in pairs if (v := paired_request_speeds(r, bases)) is not None]
        row["request_speed_p10_x"] = spread([low_end(s) for s in speeds])
        row["request_speed_min_x"] = spread([min(s) for s in speeds])
        identical = [r.identical_to_plain for r in group if r.identical_to_plain is not None]
        row["identical_to_plain"] = (
            f"{sum(identical)}/{sum(r.metric('completed') or 0 for r in group)}" if identical else ""
        )
        rows.append(row)
    return rows


def _range(text: str) -> tuple[float, float] | None:
    """A ratio range as the table writes it ("0.97-1.02", "1.01" or "") as (low, high)."""
    if not text:
        return None
    low, _, high = text.partition("-")
    return float(low), float(high or low)


VERDICT_METRICS = (
    ("throughput_x", "throughput", True),
    ("mean_tpot_x", "mean TPOT", True),
    ("p99_ttft_x", "p99 first token", False),
)  # (column, name, above 1 is faster)


def verdicts(rows: list[dict]) -> list[str]:
    """Per workload, load point and method, each metric's rounds against plain's own spread
    there (plain runs against each other): faster or slower only when every round lies beyond
    it, else level. With one plain run a round there is no spread: the verdict says so."""

    def key(row):  # a server's name is its method, then its cores if not every core: "plain (default cores)"
        return row["workload"], row["load"], row["server"].partition(" ")[2]

    plain = {key(r): r for r in rows if r["server"].partition(" ")[0] == "plain"}
    lines = []
    for row in rows:
        if row["server"].partition(" ")[0] == "plain" or key(row) not in plain:
            continue
        noise_row, parts = plain[key(row)], []
        for column, name, above_is_faster in VERDICT_METRICS:
            mine, noise = _range(row.get(column, "")), _range(noise_row.get(column, ""))
            if mine is None:
                continue
            noise = noise or (1.0, 1.0)
            low, high = mine if above_is_faster else (1 / mine[1], 1 / mine[0])
            floor, ceiling = noise if above_is_faster else (1 / noise[1], 1 / noise[0])
            word = "faster" if low > max(ceiling, 1.0) else "slower" if high < min(floor, 1.0) else "level"
            parts.append(f"{name} {row[column]} ({word}; plain {noise_row.get(column) or 'ran once'})")
        lines.append(f"- {row['workload']} at {row['load']}, {row['server']}: " + "; ".join(parts))
    return lines


def unlimited_sizes(runs: list[Run]) -> str:
    """The unlimited-rate run's prompts per workload, as `vllm bench serve` reported them."""
    sizes = {
        r.workload: r.metric("num_prompts")
        for r in runs
        if math.isinf(r.point.rate) and r.metric("num_prompts") is not None
    }
    return ", ".join(f"{workload} {size}" for workload, size in sizes.items())


def plot(rows: list[dict], workloads: list[str], out: Path) -> None:
    """throughput.png and tpot.png: one panel per workload, x the request rate (the unlimited
    rate drawn at the right end), one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def x_of(row, finite_max):
        return finite_max * 2 if row["rate_req_s"] == "inf" else row["rate_req_s"]

    for name, series in (
        ("throughput", [("output_throughput", "-")]),
        ("tpot", [("mean_tpot_ms", "-"), ("p99_tpot_ms", ":")]),
    ):
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            mine = [r for r in rows if r["workload"] == workload]
            finite = [r["rate_req_s"] for r in mine if r["rate_req_s"] != "inf"] or [1.0]
            for i, server in enumerate(dict.fromkeys(r["server"] for r in mine)):
                points = sorted(
                    ((x_of(r, max(finite)), r) for r in mine if r["server"] == server), key=lambda point: point[0]
                )
                for key, style in series:
                    ax.plot(
                        [x for x, _ in points],
                        [r[key] for _, r in points],
                        style,
                        marker="o",
                        color=f"C{i}",
                        label=server if style == "-" else None,
                    )
            ax.set_title(workload)
            ax.set_xscale("log")
            ticks = {x_of(r, max(finite)): r["load"] for r in mine}  # each load point by its name
            ax.set_xticks(list(ticks), list(ticks.values()))
            ax.minorticks_off()
            ax.set_xlabel("requests/s, as a share of plain's capacity C\n(max: unlimited, capped)")
        axes[0][0].set_ylabel("output tokens/s" if name == "throughput" else "TPOT ms (solid mean, dotted p99)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


# ---- command line ---------------------------------------------------------------------------


def round_order(specs: list[Server], round_: int, plain_between: bool) -> list[Server]:
    """The servers of one round: plain first, the methods in reverse order every other round, and
    with `plain_between` the plain server on the same cores again after each method, so every
    method has plain runs beside it in time."""
    plain = [s for s in specs if s.method == "plain"]
    methods = [s for s in specs if s.method != "plain"]
    methods = methods if round_ % 2 == 0 else methods[::-1]
    if not plain_between:
        return [*plain, *methods]
    order = [s for s in plain if not any(m.default_cores == s.default_cores for m in methods)]
    for method in methods:
        beside = next(s for s in plain if s.default_cores == method.default_cores)
        order += [beside, method, beside] if not order or order[-1] != beside else [method, beside]
    return order


def servers(args) -> list[Server]:
    from benchmarks.run import choose_methods, method_configs

    others = [m for m in args.methods if m != "plain"]
    chosen = choose_methods(method_configs(args.draft_path), "plain", others or ["plain"])
    return [Server(m, config, default) for default in args.default_cores for m, config in chosen.items()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="quick")
    parser.add_argument(
        "--model",
        help="any model your vLLM can load (a local directory or a model name) instead of the "
        "mode's; its max_model_len is capped at what the model supports",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "suffix", "draft_model", "self-admg-paper", "self-admg"],
        help="besides plain, which always runs first (draft_model only in full mode); NAME@K runs NAME "
        "with draft length K, e.g. self-admg@8",
    )
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(UNMIXED))
    parser.add_argument(
        "--prompts-file",
        type=Path,
        help='your own prompts, one JSON object a line with "prompt" (sent as is) or "messages" '
        "(through the chat template): the 'own' workload, the only one unless --workloads says",
    )
    parser.add_argument(
        "--decide",
        action="store_true",
        help="should I use self-admg? plain against self-admg only, in alternating rounds (3 unless "
        "--rounds says), at light load and past capacity (unless --load says), with a verdict "
        "per cell against plain's own noise",
    )
    parser.add_argument(
        "--load",
        nargs="*",
        type=float,
        default=[0.1, 0.3, 0.6, 1.5],
        help="request rates as fractions of the plain server's capacity C (none: the unlimited-rate run only)",
    )
    parser.add_argument("--max-concurrency", type=int, default=16, help="the cap of the unlimited-rate run")
    parser.add_argument("--prompts-per-point", type=int, help="default: by --mode")
    parser.add_argument(
        "--saturation-prompts",
        type=int,
        help=f"prompts of the unlimited-rate run; default: {SATURATION_PROMPTS_PER_SLOT} x --max-concurrency",
    )
    parser.add_argument("--output-tokens", type=int, help="max_tokens of every request; default: by --mode")
    parser.add_argument(
        "--output-spread",
        type=float,
        default=0.5,
        help="each request's max_tokens drawn from --output-tokens x [1 - S, 1 + S] (0 <= S < 1), "
        "the same for every server; 0: every request runs to --output-tokens",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1, help="every server again, in reverse order each round")
    parser.add_argument(
        "--plain-between",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the plain server again after each method, and each method compared with the plain "
        "runs beside it: this VM's speed drifts between servers minutes apart",
    )
    parser.add_argument(
        "--worker-cores",
        nargs="+",
        choices=["all", "default"],
        default=["all"],
        help="all: the CPU worker computes on every core (or on VLLM_CPU_OMP_THREADS_BIND "
        "if set); default: vLLM's binding, which keeps a core for the engine process",
    )
    parser.add_argument(
        "--log-steps",
        action="store_true",
        help="every server logs each engine step's prompt and decode tokens and time (vLLM's "
        "--enable-logging-iteration-details), which benchmarks.diagnostics.prefill_steps reads",
    )
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds per `vllm bench serve` run")
    parser.add_argument("--out", type=Path, help="default: serving-<mode>-<date> in the cache")
    parser.add_argument(
        "--summarize",
        type=Path,
        metavar="FOLDER",
        help="start no server: write FOLDER's table, CSV and plots again from what it saved",
    )
    explicit = {
        a.dest
        for a in parser._actions
        if any(o in (argv if argv is not None else sys.argv[1:]) for o in a.option_strings)
    }
    args = parser.parse_args(argv)
    if args.prompts_file and "workloads" not in explicit:
        args.workloads = ["own"]
    if args.decide:
        args.methods = ["self-admg"]
        args.rounds = args.rounds if "rounds" in explicit else 3
        args.load = args.load if "load" in explicit else [0.1, 1.5]
    if not 0 <= args.output_spread < 1:
        parser.error(f"--output-spread must be at least 0 and below 1, not {args.output_spread:g}")
    model, draft, per_point, tokens = MODES[args.mode]
    if args.model:
        model, draft = args.model, None  # (draft_model needs a smaller sibling of the model)
    args.out = args.out or default_out(f"serving-{args.mode}")
    args.prompts_per_point = args.prompts_per_point or per_point
    args.output_tokens = args.output_tokens or tokens
    args.model, args.draft = model, draft
    args.default_cores = [choice == "default" for choice in args.worker_cores]
    # In WORKLOADS order whatever the command line says: multi-turn's first turns must not be
    # sent before a workload that could draft them from history.
    args.workloads = [w for w in WORKLOADS if w in args.workloads]
    if draft is None and "draft_model" in args.methods:
        args.methods.remove("draft_model")  # SmolLM2-135M has no smaller sibling to draft with
    return args


def load_model_facts(model_path: str, max_model_len: int):
    """The model's tokenizer, and `max_model_len` capped at the model's own limit; a model that
    cannot be loaded stops the run here, before any server starts, with its name."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        raise SystemExit(f"--model {model_path}: cannot load its tokenizer and config ({why})") from None
    limit = getattr(config, "max_position_embeddings", None)
    return tokenizer, min(max_model_len, limit) if isinstance(limit, int) and limit > 0 else max_model_len


def main(argv=None) -> Path:
    import os

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, choose_dtype
    from benchmarks.run import environment

    args = parse_args(argv)
    if args.summarize:
        summarize_folder(args.summarize)
        return args.summarize
    args.dtype, args.dtype_reason = choose_dtype(args.dtype)
    cores = bind_worker_cores()
    args.every_core = cores.binding
    print(f"cores {cores.reason}", flush=True)
    args.cpus = os.cpu_count()
    args.model_path = assets.model_or_path(args.model)
    args.draft_path = assets.model_or_path(args.draft) if args.draft else None
    tokenizer, args.max_model_len = load_model_facts(args.model_path, args.max_model_len)
    out = args.out
    (out / "raw").mkdir(parents=True, exist_ok=True)
    specs = servers(args)
    # (each server's speculative config as sent, so that a kept folder says which K it measured)
    configs = {"speculative_configs": {s.name: s.speculative_config for s in specs}}
    (out / "environment.json").write_text(json.dumps(environment(args) | configs, indent=2, default=str))
    print(f"dtype {args.dtype_reason}; results in {out}", flush=True)
    for workload in args.workloads:  # before hours of serving, not after
        prompts = first_prompts(workload, tokenizer, args.prompts_file)
        slices(prompts, point_sizes(args, len(prompts)), workload)
    plan, runs = Plan(), []
    command = "python -m benchmarks.serving " + " ".join(sys.argv[1:])
    for round_ in range(args.rounds):
        for slot, spec in enumerate(round_order(specs, round_, args.plain_between)):
            try:
                runs += run_server(spec, plan, args, tokenizer, out, round_, slot)
            except Exception as error:  # a server that fails to start or serve; the others still run
                print(f"round {round_}: {spec.name} failed: {type(error).__name__}: {error}"[:2000], flush=True)
            if runs:
                write_summary(runs, args, out, command)
    print((out / "table.md").read_text() + f"\nresults in {out}")
    return out


def summarize_folder(out: Path) -> None:
    """Write a results folder's table, CSV and plots again from what it saved."""
    environment = json.loads((out / "environment.json").read_text())
    args = argparse.Namespace(**{"cpus": environment["cpus"], **environment["settings"]})
    write_summary(
        runs_from_folder(out),
        args,
        out,
        "python -m benchmarks.serving " + " ".join(environment["argv"][1:]),
        environment["date"],
    )
    print((out / "table.md").read_text())


def load_note(loads: list[float]) -> str:
    if not loads:
        return "the unlimited rate only"
    return f"loads {', '.join(f'{f:g}C' for f in loads)} of the plain server's capacity C and unlimited"


def output_note(tokens: int, spread: float) -> str:
    if not spread:
        return f"{tokens} output tokens"
    low, high = output_range(tokens, spread)
    return f"at most {low}-{high} output tokens (each request's limit drawn from that range)"


def write_summary(runs: list[Run], args, out: Path, command: str, started: str | None = None) -> None:
    mark_identical(runs)
    rows = summarize(runs)
    header = (
        f"`vllm bench serve`, {args.mode} mode: {args.model} ({args.dtype}), {args.prompts_per_point} "
        f"prompts per load point ({unlimited_sizes(runs)} at the unlimited rate), "
        f"{output_note(args.output_tokens, getattr(args, 'output_spread', 0))}, "
        f"temperature {args.temperature:g}, "
        f"{load_note(args.load)} with at most {args.max_concurrency} in flight; {args.cpus} CPUs; "
        f"{started or dt.datetime.now().isoformat(timespec='minutes')}.\n"
        f"Ratios against plain in the same round (min-max over rounds); above 1 is better, except p99 TTFT "
        f"(below 1 is better), and ttft_paired_x, the median over requests of each one's TTFT against the "
        f"same prompt's on plain (below 1 is better); request_speed_p10_x and request_speed_min_x, the "
        f"10th percentile and the slowest of each request's time per output token on plain over its own "
        f"(above 1 is faster); plain's own ratios, where it ran more than once a "
        f"round, are each plain run against its others: the noise. Below capacity the output throughput "
        f"follows the arrival rate (the last request is sent at prompts / rate): there TPOT and TTFT tell "
        f"methods apart.\n"
        f"Command: `{command}`\n\n"
    )
    verdict = "\n\nVerdicts (every round beyond plain's own spread, or level):\n" + "\n".join(verdicts(rows))
    (out / "table.md").write_text(header + markdown_table(rows) + verdict + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, [w for w in args.workloads if any(r["workload"] == w for r in rows)], out)


if __name__ == "__main__":
    main()
