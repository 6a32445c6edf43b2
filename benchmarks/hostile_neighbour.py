# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A served request beside a hostile one: does a prompt of one repeated token slow everyone else?

Lookup runs for every row every step, and a context of one token repeated is its worst case
(every earlier position an occurrence). This starts a plain server and a self-admg server side
by side (the idle one waits without computing), and in alternating rounds sends each of them a
long hostile prompt (--hostile-tokens of one token, decoding --hostile-output tokens) and, once
its prefill is done, an ordinary request beside it: a HumanEval prompt (`--ordinary code`, which
gains from its own drafts) or an MT-Bench question through the chat template (`--ordinary chat`,
which gains little, and so shows what a neighbour's drafts cost a request). With `--neighbour
long-prompts` the neighbour is instead a stream of prompts of --hostile-tokens distinct tokens,
one after another, so that a prefill runs in every step (what drafts withheld beside prefills
cost). It prints and saves the ordinary request's time per output token (and the hostile one's,
or a long prompt's seconds) per round, self-admg over plain of the same round, with plain's own
spread across rounds beside it.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.hostile_neighbour
    ... --rounds 5 --hostile-tokens 7000
    ... --ordinary chat --ordinary-output 48 --hostile-tokens 6000 --dtype float32
    ... --ordinary chat --neighbour long-prompts --hostile-tokens 8000 --max-model-len 9000

Writes table.md, results.csv, tpot.png and environment.json to --out (default: a dated folder in
the cache, outside the repository).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import threading
import time
from pathlib import Path

from benchmarks.output import default_out
from benchmarks.serve_load import VllmServer, server_flags

SERVERS = ("plain", "self-admg")
HOSTILE_TOKEN = 11  # any single token id; its repetition is what makes the lookup's worst case


def streamed_tpot(
    server: VllmServer, prompt, max_tokens: int, started: threading.Event | None = None, extra_body: dict | None = None
) -> float:
    """Seconds per output token after the first, of one streamed greedy completion (a chat
    completion if `prompt` is a list of messages; `extra_body`: more request fields)."""
    client = server.client(timeout=600)
    chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
    stream = (client.chat.completions if chat else client.completions).create(
        model=server.model,
        **({"messages": prompt} if chat else {"prompt": prompt}),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **(extra_body or {})},
    )
    first = last = None
    tokens = 0
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content if chat else chunk.choices[0].text):
            last = time.perf_counter()
            first = first or last
            if started is not None:
                started.set()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return (last - first) / max(tokens - 1, 1)


def one_round(server: VllmServer, ordinary: str, args) -> dict[str, float]:
    if args.neighbour == "long-prompts":
        return beside_long_prompts(server, ordinary, args)
    hostile_prompt = [HOSTILE_TOKEN] * args.hostile_tokens
    started, result = threading.Event(), {}
    hostile = threading.Thread(
        target=lambda: result.update(hostile=streamed_tpot(server, hostile_prompt, args.hostile_output, started))
    )
    hostile.start()
    started.wait(600)  # its prefill done: from now on it decodes beside the ordinary request
    result["ordinary"] = streamed_tpot(server, ordinary, args.ordinary_output)
    hostile.join()
    return result


def beside_long_prompts(server: VllmServer, ordinary: str, args) -> dict[str, float]:
    """The ordinary request while another client sends prompts of --hostile-tokens distinct
    tokens, one after another, each for one output token: a prefill in chunks in every step.
    "hostile": the seconds each long prompt took, on average."""
    import random

    stop, seconds = threading.Event(), []

    def send_long_prompts():
        # Seeded afresh each round and server: a prompt met before would be prefilled from vLLM's
        # prefix cache, nearly free (a seed that repeated each round made every round's first
        # prompts the warm-up's).
        rng, client = random.Random(time.perf_counter_ns()), server.client(timeout=600)
        while not stop.is_set():
            prompt = [rng.randrange(1000, 20000) for _ in range(args.hostile_tokens)]  # no prefix cached
            start = time.perf_counter()
            client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
            seconds.append(time.perf_counter() - start)

    sender = threading.Thread(target=send_long_prompts)
    sender.start()
    time.sleep(1.0)  # the first long prompt is being prefilled
    result = {"ordinary": streamed_tpot(server, ordinary, args.ordinary_output)}
    stop.set()
    sender.join()
    result["hostile"] = statistics.mean(seconds) if seconds else float("nan")
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="default: the CPU's native choice")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hostile-tokens", type=int, default=7000, help="length of the repeated-token prompt")
    parser.add_argument("--hostile-output", type=int, default=384)
    parser.add_argument("--ordinary-output", type=int, default=128)
    parser.add_argument(
        "--ordinary", choices=["code", "chat"], default="code", help="the ordinary request: HumanEval or MT-Bench"
    )
    parser.add_argument(
        "--neighbour",
        choices=["repeated", "long-prompts"],
        default="repeated",
        help="a prompt of one repeated token decoding beside it, or a stream of long prompts (8k tokens, say)",
    )
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def begin_run(args, name: str, cores) -> tuple[Path, Path]:
    """A served run's start, its cores bound (`cores`: `engine.bind_worker_cores()`): the dtype
    chosen and both said, its folder (`args.out`, else a dated one named `name`) with
    environment.json, and the model's path."""
    from benchmarks import assets
    from benchmarks.engine import choose_dtype
    from benchmarks.run import environment

    args.dtype, args.dtype_reason = choose_dtype(args.dtype)
    print(f"cores {cores.reason}; dtype {args.dtype_reason}", flush=True)
    out = args.out or default_out(name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "environment.json").write_text(json.dumps(environment(args), indent=2, default=str))
    return out, assets.model_or_path(args.model)


def main(argv=None) -> Path:
    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores

    args = parse_args(argv)
    out, model = begin_run(args, "hostile-neighbour", bind_worker_cores())
    ordinary = (
        [{"role": "user", "content": assets.load_prompts("mtbench")[0]}]
        if args.ordinary == "chat"
        else assets.load_prompts("humaneval")[0]
    )
    common = server_flags(model, args.dtype, args.max_model_len, kv_cache_gb=2, seed=0)
    servers = {
        "plain": VllmServer(model, *common, log_path=out / "plain.log"),
        "self-admg": VllmServer(model, *common, "--speculative-model", "self-admg", log_path=out / "self-admg.log"),
    }
    rows = []
    try:
        for server in servers.values():
            server.start().wait_until_healthy()
            one_round(server, ordinary, args)  # warm-up, unmeasured
        for round_ in range(args.rounds):
            for name, server in servers.items():
                tpot = one_round(server, ordinary, args)
                rows.append(
                    {
                        "round": round_,
                        "server": name,
                        "ordinary_tpot_ms": 1e3 * tpot["ordinary"],
                        "hostile_tpot_ms": 1e3 * tpot["hostile"],
                    }
                )
                print(rows[-1], flush=True)
    finally:
        for server in servers.values():
            if hasattr(server, "process"):
                server.stop()
    write(rows, out, args)
    return out


def write(rows: list[dict], out: Path, args) -> None:
    neighbour = (
        f"a stream of prompts of {args.hostile_tokens} distinct tokens (1 token out; hostile: ms per prompt)"
        if args.neighbour == "long-prompts"
        else f"a prompt of {args.hostile_tokens} repeated tokens ({args.hostile_output} tokens out)"
    )
    lines = [
        f"Ordinary {args.ordinary} request ({args.ordinary_output} tokens) beside {neighbour}; {args.model}, "
        f"{args.dtype}; ms per output token; speed-up: plain's time per token over self-admg's in the same round; "
        "plain's spread: its time over its mean across rounds.",
        "",
        "| round | plain | self-admg | speed-up | plain's spread | hostile: plain | hostile: self-admg |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["round"], r["server"]): r for r in rows}
    plain_mean = statistics.mean(r["ordinary_tpot_ms"] for r in rows if r["server"] == "plain")
    for round_ in range(args.rounds):
        p, s = by[(round_, "plain")], by[(round_, "self-admg")]
        lines.append(
            f"| {round_} | {p['ordinary_tpot_ms']:.1f} | {s['ordinary_tpot_ms']:.1f} | "
            f"{p['ordinary_tpot_ms'] / s['ordinary_tpot_ms']:.2f}x | "
            f"{p['ordinary_tpot_ms'] / plain_mean:.2f} | {p['hostile_tpot_ms']:.1f} | "
            f"{s['hostile_tpot_ms']:.1f} |"
        )
    series = {
        n: [(r["round"], r["ordinary_tpot_ms"]) for r in rows if r["server"] == n] for n in ("plain", "self-admg")
    }
    save_run(out, rows, lines, series, "ordinary request beside a hostile prompt")


def save_run(out: Path, rows: list[dict], lines: list[str], series: dict[str, list[tuple]], title: str) -> None:
    """results.csv (`rows`), table.md (`lines`, printed too) and tpot.png: ms per output token by
    round, a line per series."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print("\n" + table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, points in series.items():
        ax.plot([r for r, _ in points], [ms for _, ms in points], "o-", label=name)
    ax.set(xlabel="round", ylabel="ms per output token", title=title)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tpot.png", dpi=120)


if __name__ == "__main__":
    main()
