# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A hostile `prediction`: does a prediction built to make following it expensive slow its own
request, or stall the server?

The prediction is three equal tokens and another, repeated to `max_prediction_tokens`, and the
request's answer is that token repeated (a regex holds it to that, with or without the
prediction): the output departs from the prediction at every fourth token, and its last three
tokens occur at every fourth place of the prediction, the case where finding the way back is
costliest (a scan of every such place cost about 23 ms a token before the cursor's index).
In alternating rounds, one self-admg server (default options) answers the same request with
the hostile prediction and without any, streamed; meanwhile a thread polls /health every 20 ms,
as a load balancer would. Prints and saves each round's time per output token with and without
the prediction, their ratio, and /health's 99th percentile and slowest answer.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.hostile_prediction --rounds 3

Writes table.md, results.csv, tpot.png and environment.json to --out (default: a dated folder
in the cache, outside the repository).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from benchmarks.hostile_neighbour import begin_run, save_run, streamed_tpot
from benchmarks.serve_load import VllmServer, server_flags

REPEATED, OTHER = " a", " b"  # words that tokenize to one token each, alone and repeated
CASES = ("none", "hostile")  # without a prediction, and with the hostile one


class HealthPoller:
    """/health asked every `interval` seconds on a thread; the seconds each answer took."""

    def __init__(self, server: VllmServer, interval: float = 0.02):
        import httpx

        self.client, self.url, self.interval = httpx.Client(timeout=30), server.url("/health"), interval
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            ok = self.client.get(self.url).status_code == 200
            self.seconds.append(time.perf_counter() - start if ok else float("inf"))
            self._stop.wait(self.interval)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def hostile_prediction(tokens: int) -> str:
    """Text of `tokens` tokens: three of REPEATED and one OTHER, over and over."""
    return (REPEATED * 3 + OTHER) * (tokens // 4)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="default: the CPU's native choice")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=512)
    parser.add_argument("--prediction-tokens", type=int, default=8192, help="the default max_prediction_tokens")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> Path:
    from benchmarks.engine import bind_worker_cores

    args = parse_args(argv)
    out, model = begin_run(args, "hostile-prediction", bind_worker_cores())
    prompt = REPEATED * args.prompt_tokens
    held = {"structured_outputs": {"regex": f"({REPEATED})+"}}  # the answer: the token repeated
    hostile = {"type": "content", "content": hostile_prediction(args.prediction_tokens)}
    cases = {"none": held, "hostile": {**held, "prediction": hostile}}
    common = server_flags(model, args.dtype, 4096, kv_cache_gb=2, seed=0)
    server = VllmServer(model, *common, "--speculative-model", "self-admg", log_path=out / "self-admg.log")
    rows = []
    with server:
        streamed_tpot(server, prompt, 32, extra_body=cases["hostile"])  # warm-up, unmeasured
        for round_ in range(args.rounds):
            for name in CASES if round_ % 2 == 0 else CASES[::-1]:
                with HealthPoller(server) as health:
                    tpot = streamed_tpot(server, prompt, args.output_tokens, extra_body=cases[name])
                rows.append(
                    {
                        "round": round_,
                        "prediction": name,
                        "tpot_ms": 1e3 * tpot,
                        "health_median_ms": 1e3 * statistics.median(health.seconds),
                        "health_p99_ms": 1e3 * statistics.quantiles(health.seconds, n=100)[98],
                        "health_max_ms": 1e3 * max(health.seconds),
                        "health_polls": len(health.seconds),
                    }
                )
                print(rows[-1], flush=True)
        answer = server.client().completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=args.output_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **cases["hostile"]},
        )
        ids, details = answer.choices[0].model_extra["token_ids"], answer.usage.completion_tokens_details
        print(f"the answer's distinct tokens: {sorted(set(ids))}; the prediction's usage: {details}", flush=True)
    write(rows, out, args)
    return out


def write(rows: list[dict], out: Path, args) -> None:
    by = {(r["round"], r["prediction"]): r for r in rows}
    lines = [
        f"One request ({args.prompt_tokens}-token prompt of one token, {args.output_tokens} tokens out, held to "
        f"that token) with a {args.prediction_tokens}-token hostile prediction and without one, on one self-admg "
        f"server (default options); {args.model}, {args.dtype}; ms per output token; /health polled every 20 ms "
        "meanwhile, its 99th percentile and slowest answer.",
        "",
        "| round | none | hostile | hostile / none | /health: none | /health: hostile |",
        "|---|---|---|---|---|---|",
    ]
    for round_ in range(args.rounds):
        none, hostile = by[(round_, "none")], by[(round_, "hostile")]
        health = [f"{r['health_p99_ms']:.0f}, {r['health_max_ms']:.0f} ms" for r in (none, hostile)]
        ratio = hostile["tpot_ms"] / none["tpot_ms"]
        times = f"{none['tpot_ms']:.1f} | {hostile['tpot_ms']:.1f} | {ratio:.2f}x"
        lines.append(f"| {round_} | {times} | {health[0]} | {health[1]} |")
    series = {f"prediction: {n}": [(r["round"], r["tpot_ms"]) for r in rows if r["prediction"] == n] for n in CASES}
    save_run(out, rows, lines, series, "a request with a hostile prediction and without")


if __name__ == "__main__":
    main()
