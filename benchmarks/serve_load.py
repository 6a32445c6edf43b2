# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Load test of `vllm serve`: the same requests against a plain server and a self-admg server,
one server at a time, side by side in one run.

    .venv/bin/python -m benchmarks.serve_load                        # SmolLM2-135M, 480 requests
    .venv/bin/python -m benchmarks.serve_load --model qwen2.5-coder-1.5b --requests 200

Each server is started with the plain `vllm` command, warmed up, then sent `--requests`
completions, each with a prompt of its own (HumanEval and news alternating), from
`--concurrency` concurrent clients (the official openai client) under a hard `--time-limit`.
Reported per server: failed requests, requests/s, output tokens/s, p50/p99 latency, resident
memory of the server's processes after warm-up and at the end, acceptance from vLLM's
`vllm:spec_decode_*` counters on /metrics, and /health afterwards. Writes results.json,
table.md, latency.png, memory.png and the servers' logs to --out (default: a dated folder in the
cache, outside the repository: benchmarks/output.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.output import default_out

VLLM = str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(model, dtype: str, max_model_len: int, kv_cache_gb: int, seed: int | None = None) -> list[str]:
    """The `vllm serve` flags every server of a comparison shares (the method's come on top)."""
    return [
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_gb << 30),
        "--served-model-name",
        str(model),
        *(["--seed", str(seed)] if seed is not None else []),
    ]


class VllmServer:
    """`vllm serve MODEL ARGS...` on a free loopback port, for as long as the `with` block."""

    def __init__(self, model, *args: str, log_path: Path, env: dict | None = None, startup_timeout: float = 600):
        self.command = [VLLM, "serve", str(model), "--host", "127.0.0.1", *args]
        self.log_path, self.env, self.startup_timeout = Path(log_path), env or {}, startup_timeout
        self.model = str(model)

    def __enter__(self) -> VllmServer:
        return self.start().wait_until_healthy()

    def start(self) -> VllmServer:
        """Launch without waiting (several servers can then start at once)."""
        self.port = free_port()
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*self.command, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        return self

    def wait_until_healthy(self) -> VllmServer:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n" + self.log()[-3000:])
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout} s:\n" + self.log()[-3000:])
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key="EMPTY", **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key="EMPTY", **kwargs)

    def healthy(self) -> bool:
        import httpx

        return httpx.get(self.url("/health"), timeout=10).status_code == 200

    def metrics(self) -> dict[str, float]:
        """Prometheus samples on /metrics, summed over labels: {sample name: value}."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url("/metrics"), timeout=10).text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it started (engine core, workers)."""
        import psutil

        root = psutil.Process(self.process.pid)
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def rpc(self, method: str) -> list:
        """A worker method by name through /collective_rpc (needs VLLM_SERVER_DEV_MODE=1)."""
        import httpx

        response = httpx.post(self.url("/collective_rpc"), json={"method": method}, timeout=60)
        response.raise_for_status()
        return response.json()["results"]


# ---- the load -------------------------------------------------------------------------------


@dataclass
class LoadResult:
    requests: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    output_tokens: int = 0
    aborted: int = 0  # streams the client closed on purpose (the soak's aborts)
    rss_samples: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, completed, bytes)


SOAK_SALTS = ("tenant-a", "tenant-b")
SOAK_PROMPT_CHARS = (100, 200, 400, None)  # None: the whole prompt


def soak_request(i: int) -> tuple[dict, int | None]:
    """Request i of the soak mix: mixed lengths and temperatures, stop strings, two tenants,
    min_p and logit_bias now and then, and every 7th one aborted by its client mid-stream.
    Returns the completion arguments and, for an abort, after how many chunks to close."""
    kwargs = {
        "max_tokens": (8, 16, 32, 64)[i % 4],
        "temperature": (0.0, 0.7, 1.0)[i % 3],
        "extra_body": {"cache_salt": SOAK_SALTS[i % 2]},
    }
    if i % 5 == 0:
        kwargs["stop"] = ["\n\n", "."]
    else:
        kwargs["extra_body"]["ignore_eos"] = True
    if i % 11 == 0:
        kwargs["extra_body"]["min_p"] = 0.1
    if i % 13 == 0:
        kwargs["logit_bias"] = {"13": 2.0}
    return kwargs, (3 if i % 7 == 0 else None)


async def run_load(
    server: VllmServer,
    prompts: list[str],
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    temperatures=(0.0, 1.0),
    time_limit: float = 600,
    rss_every: int = 50,
    progress: bool = True,
    soak: bool = False,
) -> LoadResult:
    """`num_requests` completions from `concurrency` clients, cycling through prompts and
    temperatures (or, with `soak`, through `soak_request`'s mix). A request that fails or is
    still running at `time_limit` counts as failed."""
    from tqdm import tqdm

    client = server.async_client(max_retries=0, timeout=time_limit)
    result = LoadResult(num_requests, 0.0)
    next_index = iter(range(num_requests))
    bar = tqdm(total=num_requests, desc=f"load {server.model.split('/')[-1]}", disable=not progress)
    load_start = time.perf_counter()

    async def one_client():
        for i in next_index:
            start = time.perf_counter()
            kwargs, abort_after = (
                soak_request(i)
                if soak
                else (
                    {
                        "max_tokens": max_tokens,
                        "temperature": temperatures[i % len(temperatures)],
                        "extra_body": {"ignore_eos": True},
                    },
                    None,
                )
            )
            try:
                if abort_after is None:
                    response = await client.completions.create(
                        model=server.model, prompt=prompts[i % len(prompts)], **kwargs
                    )
                    result.output_tokens += response.usage.completion_tokens
                else:
                    stream = await client.completions.create(
                        model=server.model, prompt=prompts[i % len(prompts)], stream=True, **kwargs
                    )
                    chunks = 0
                    async for _ in stream:
                        chunks += 1
                        if chunks >= abort_after:
                            break
                    await stream.close()
                    result.aborted += 1
                result.latencies.append(time.perf_counter() - start)
            except Exception as err:  # every failure is reported, none is fatal to the load
                result.failures.append(f"request {i}: {type(err).__name__}: {err}"[:300])
            bar.update()
            done = len(result.latencies) + len(result.failures)
            if done % rss_every == 0:
                result.rss_samples.append((time.perf_counter() - load_start, done, server.rss_bytes()))

    start = load_start = time.perf_counter()
    try:
        async with asyncio.timeout(time_limit):
            await asyncio.gather(*(one_client() for _ in range(concurrency)))
    except TimeoutError:
        unfinished = num_requests - len(result.latencies) - len(result.failures)
        result.failures += [f"time limit of {time_limit} s reached"] * unfinished
    result.seconds = time.perf_counter() - start
    bar.close()
    await client.close()
    return result


def percentile(values: list[float], q: int) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else None


def summarize(
    name: str, load: LoadResult, rss_after_warmup: int, rss_end: int, metrics: dict[str, float], healthy: bool
) -> dict:
    drafts = metrics.get("vllm:spec_decode_num_drafts_total", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    return {
        "server": name,
        "requests": load.requests,
        "failed": len(load.failures),
        "requests_per_s": round(len(load.latencies) / load.seconds, 2),
        "output_tokens_per_s": round(load.output_tokens / load.seconds, 1),
        "p50_latency_s": round(percentile(load.latencies, 50) or 0, 3),
        "p99_latency_s": round(percentile(load.latencies, 99) or 0, 3),
        "aborted_by_client": load.aborted,
        "rss_after_warmup_gb": round(rss_after_warmup / 2**30, 3),
        "rss_end_gb": round(rss_end / 2**30, 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "healthy_after": healthy,
    }


def load_one_server(server: VllmServer, name: str, prompts, args, warmup_prompts=None) -> tuple[dict, LoadResult]:
    soak = getattr(args, "soak", False)
    warmup = asyncio.run(
        run_load(
            server,
            warmup_prompts or prompts,
            args.warmup,
            args.concurrency,
            args.max_tokens,
            time_limit=args.time_limit,
            progress=False,
            soak=soak,
        )
    )
    if warmup.failures:
        raise RuntimeError(f"{name}: warm-up requests failed: {warmup.failures[:3]}")
    rss_after_warmup = server.rss_bytes()
    load = asyncio.run(
        run_load(
            server, prompts, args.requests, args.concurrency, args.max_tokens, time_limit=args.time_limit, soak=soak
        )
    )
    row = summarize(name, load, rss_after_warmup, server.rss_bytes(), server.metrics(), server.healthy())
    return row, load


def markdown_table(rows: list[dict], columns=None) -> str:
    """Rows as a markdown table: `columns` (default: the first row's keys), empty where None."""
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_latencies(loads: dict[str, LoadResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, load in loads.items():
        values = sorted(load.latencies)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(loads: dict[str, LoadResult], path: Path) -> None:
    """Resident memory of each server's processes over the measured load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, load in loads.items():
        ax.plot([t for t, _, _ in load.rss_samples], [b / 2**30 for _, _, b in load.rss_samples], label=name)
    ax.set_xlabel("seconds into the load (after warm-up)")
    ax.set_ylabel("resident memory (GiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an asset name or a model directory")
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument(
        "--workload",
        choices=["mixed", "humaneval", "news"],
        default="mixed",
        help="mixed: HumanEval and news prompts alternating (514 prompts)",
    )
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--warmup", type=int, default=32, help="requests before measuring (a plain server's memory settles over ~500)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--soak",
        action="store_true",
        help="the soak mix instead (prompts cut to 100/200/400 characters or whole; "
        "soak_request: lengths 8-64, temperatures 0/0.7/1, stop strings, two cache_salt "
        "tenants, min_p, logit_bias, aborts mid-stream); prompts may repeat",
    )
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds per server")
    parser.add_argument("--speculative-config", default='{"method": "self-admg"}', help="default: its default options")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=int, default=2)
    parser.add_argument("--out", type=Path, help="results folder; default: serve-load-<date> in the cache")
    args = parser.parse_args(argv)
    args.out = args.out or default_out("serve-load")
    return args


def main(argv=None) -> Path:
    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, choose_dtype

    args = parse_args(argv)
    args.dtype, reason = choose_dtype(args.dtype)
    print(f"dtype {reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = assets.model_or_path(args.model)
    # Every request gets a prompt of its own: a server that drafts from earlier answers (vLLM's
    # suffix method, self-admg's history lookup) would otherwise copy its answer to a repeat.
    names = ["humaneval", "news"] if args.workload == "mixed" else [args.workload]
    prompts = [p for group in itertools.zip_longest(*map(assets.load_prompts, names)) for p in group if p]
    if args.soak:  # a soak measures stability and memory, not speed: prompts may come again,
        # cut to mixed lengths (prefill is most of a request's cost on a CPU)
        prompts = [
            p[: SOAK_PROMPT_CHARS[(i // 4) % len(SOAK_PROMPT_CHARS)]]
            for i, p in enumerate(itertools.islice(itertools.cycle(prompts), args.warmup + args.requests))
        ]
    if args.warmup + args.requests > len(prompts):
        raise SystemExit(
            f"--warmup {args.warmup} + --requests {args.requests} needs that many distinct "
            f"prompts; {args.workload} has {len(prompts)}"
        )
    warmup_prompts, prompts = prompts[: args.warmup], prompts[args.warmup : args.warmup + args.requests]
    common = server_flags(model, args.dtype, args.max_model_len, args.kv_cache_gb)
    servers = {"plain": common, "self-admg": [*common, "--speculative-config", args.speculative_config]}
    rows, loads = [], {}
    for name, server_args in servers.items():
        with VllmServer(model, *server_args, log_path=out / f"{name}.log") as server:
            row, loads[name] = load_one_server(server, name, prompts, args, warmup_prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    plain_rps = rows[0]["requests_per_s"]
    for row in rows:
        row["speedup_requests_per_s"] = round(row["requests_per_s"] / plain_rps, 3) if plain_rps else None
    mix = (
        "the soak mix: prompts cut to 100/200/400 characters or whole, 8-64 tokens, temperatures "
        "0/0.7/1, stop strings, two cache_salt tenants, min_p, logit_bias, every 7th aborted mid-stream"
        if args.soak
        else f"{args.max_tokens} tokens, temperatures 0 and 1 alternating"
    )
    header = (
        f"`vllm serve` load: {args.requests} requests after {args.warmup} warm-up ({args.workload}, {mix}) "
        f"from {args.concurrency} clients; model {args.model} "
        f"({args.dtype}); {os.cpu_count()} CPUs; {dt.datetime.now().isoformat(timespec='seconds')}.\n"
        f"Command: `{' '.join(['python -m benchmarks.serve_load', *sys.argv[1:]])}`\n"
    )
    table = header + "\n" + markdown_table(rows)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "rows": rows,
                "loads": {name: asdict(load) for name, load in loads.items()},
            },
            indent=2,
        )
    )
    plot_latencies(loads, out / "latency.png")
    plot_memory(loads, out / "memory.png")
    print("\n" + table + f"\n\nresults in {out}")
    return out


if __name__ == "__main__":
    main()
