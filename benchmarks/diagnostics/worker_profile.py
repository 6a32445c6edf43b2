"""Where a server's worker spends a light-load step: py-spy on the worker process of one
`vllm serve`, under streamed batch-1 requests (benchmarks/NOTES.md, "Six waves at capacity").

Starts the server as `benchmarks.serving` does (same flags, the worker on every core), serves
`--history` HumanEval prompts 16 at a time (so that lookups search a server's history), then
sends one streamed request at a time for `--seconds` while py-spy samples the worker. Prints
the mean time per streamed step and the share of samples in the functions that matter, and
leaves py-spy's raw profile (flamegraph.pl's input) in `--out`. Needs `pip install py-spy`.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.diagnostics.worker_profile self-admg
    ... suffix
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import statistics
import subprocess
import time
from pathlib import Path

# Frames whose share of the worker's samples is printed.
SHOWN = (
    "GPUModelRunner.execute_model",
    "GPUModelRunner._model_forward",
    "LlamaForCausalLM.compute_logits",
    "GPUModelRunner._prepare_inputs",
    "GPUModelRunner.sample_tokens",
    "RejectionSampler.forward",
    "GPUModelRunner.propose_draft_token_ids",
    "SelfAdmgProposer.propose_for_runner",
    "MessageQueue.dequeue",
)


def shares(raw: Path) -> tuple[int, collections.Counter]:
    """Samples in all, and per frame (function name) the samples with it on the stack."""
    total, inclusive = 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for frame in {f.split(" (")[0] for f in stack.split(";")}:
            inclusive[frame] += int(count)
    return total, inclusive


def main(argv=None) -> None:
    import psutil
    from openai import OpenAI

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores
    from benchmarks.output import default_out
    from benchmarks.run import method_configs
    from benchmarks.serve_load import VllmServer, server_flags
    from benchmarks.serving import Server, complete_all

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", help="plain or a speculative method of benchmarks.run")
    parser.add_argument("--history", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--out", type=Path, help="default: worker-profile-<date> in the cache")
    args = parser.parse_args(argv)
    args.out = args.out or default_out("worker-profile")
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy not found: pip install py-spy")
    cores = bind_worker_cores()
    print(f"cores {cores.reason}", flush=True)
    model = str(assets.model_path("smollm2-135m"))
    spec = Server(args.method, method_configs(None).get(args.method))
    common = server_flags(model, "float32", max_model_len=4096, kv_cache_gb=2, seed=0)
    prompts = assets.load_prompts("humaneval")
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"{args.method}.txt"
    with VllmServer(
        model, *spec.args(common), log_path=args.out / f"{args.method}.log", env=spec.env(cores.binding)
    ) as server:
        asyncio.run(complete_all(server, prompts[: args.history], 64, 16))
        worker = next(p for p in psutil.Process(server.process.pid).children(recursive=True) if "Worker" in p.name())
        recorder = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(worker.pid),
                "--duration",
                str(int(args.seconds) + 5),
                "--rate",
                "100",
                "--format",
                "raw",
                "--nonblocking",
                "-o",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client, steps, start = OpenAI(base_url=server.url() + "/v1", api_key="-"), [], time.perf_counter()
        for prompt in prompts[args.history :]:
            times = [
                time.perf_counter()
                for _ in client.completions.create(
                    model=model, prompt=prompt, max_tokens=64, temperature=0, stream=True
                )
            ]
            if len(times) > 2:
                steps.append((times[-1] - times[0]) / (len(times) - 1))
            if time.perf_counter() - start > args.seconds:
                break
        recorder.wait()
    total, inclusive = shares(raw)
    print(
        f"{args.method}: {len(steps)} requests, {1e3 * statistics.mean(steps):.1f} ms a streamed step; "
        f"{total} samples of the worker ({raw}):"
    )
    for frame in SHOWN:
        print(f"  {100 * inclusive[frame] / max(total, 1):5.1f}%  {frame}")


if __name__ == "__main__":
    main()
