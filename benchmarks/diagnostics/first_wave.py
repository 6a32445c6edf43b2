# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A wave of prompts sent at once into a server: how long the first tokens take, plain against
self-admg (benchmarks/NOTES.md, entry 32). A run at the unlimited rate opens with such a wave, and
with a few dozen requests its slowest first token is the run's p99.

Each server starts and warms up as `benchmarks.serving` does, then gets --waves waves of
--rows prompts at once (each wave new prompts, the same on every server), a few tokens each.
Each wave follows a two-second pause; on multi-turn it also follows its own first turns,
unmeasured (64 tokens, all at once), and carries the first server's answers, as
`benchmarks.serving` does. Servers alternate, in --rounds rounds. With --behind, each wave is
sent while one long request decodes, so that the engine, busy with a step, admits the whole wave
in its next one, as it does at the start of a `vllm bench serve` run; alone, an idle engine starts
a step with the first prompt to arrive and the wave spreads over several.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.diagnostics.first_wave
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

# Not a prompt of any wave, so that the wave's prefix-cache hits are the same without --behind.
BEHIND_PROMPT = "Write a long story about a lighthouse keeper and the sea."


async def wave(server, prompts: list[str], max_tokens: int, behind: bool = False) -> list[float]:
    """Each prompt's time to its first streamed token, all sent at once (with `behind`, while
    another request decodes)."""
    client = server.async_client(max_retries=0, timeout=600)
    decoding = asyncio.Event()

    async def long_request() -> None:
        stream = await client.completions.create(
            model=server.model,
            prompt=BEHIND_PROMPT,
            max_tokens=512,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            decoding.set()

    async def one(prompt: str) -> float:
        start = time.perf_counter()
        stream = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        )
        first = None
        async for _ in stream:
            first = first or time.perf_counter() - start
        return first

    background = asyncio.create_task(long_request()) if behind else None
    try:
        if background is not None:  # (bounded: a long request that failed never decodes)
            await asyncio.wait_for(decoding.wait(), timeout=120)
            await asyncio.sleep(0.2)
        return list(await asyncio.gather(*map(one, prompts)))
    finally:
        if background is not None:
            background.cancel()
        await client.close()


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, choose_dtype
    from benchmarks.output import default_out
    from benchmarks.run import method_configs
    from benchmarks.serve_load import VllmServer, server_flags
    from benchmarks.serving import Server, complete_all, first_prompts, parse_args, second_turn_prompt, warm_up

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["plain", "self-admg"])
    parser.add_argument("--workload", default="multiturn", choices=["multiturn", "chat", "summarization", "code"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--behind", action="store_true", help="send each wave while a long request decodes")
    parser.add_argument("--dtype")
    parser.add_argument("--default-cores", action="store_true", help="vLLM's binding, not every core")
    parser.add_argument("--out", type=Path, help="default: first-wave-<date> in the cache")
    args = parser.parse_args(argv)
    args.out = args.out or default_out("first-wave")
    dtype, _ = choose_dtype(args.dtype)
    every_core = bind_worker_cores().binding
    model = assets.model_or_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = first_prompts(args.workload, tokenizer)
    waves = [prompts[i * args.rows : (i + 1) * args.rows] for i in range(args.waves)]
    conversations = assets.mtbench_conversations() if args.workload == "multiturn" else []
    first_answers: list[list[str]] = []  # per wave, the first server's
    configs = method_configs(None)
    args.out.mkdir(parents=True, exist_ok=True)
    serving = parse_args([])  # the serving benchmark's defaults: its servers' flags
    common = server_flags(model, dtype, serving.max_model_len, serving.kv_cache_gb, seed=0)
    results: dict[str, list[list[float]]] = {m: [] for m in args.methods}
    for round_ in range(args.rounds):
        order = args.methods if round_ % 2 == 0 else args.methods[::-1]
        for method in order:
            spec = Server(method, configs.get(method), args.default_cores)
            log = args.out / f"server-r{round_}-{spec.slug}.log"
            with VllmServer(model, *spec.args(common), log_path=log, env=spec.env(every_core)) as server:
                warm_up(server)
                for w, prompts_ in enumerate(waves):
                    time.sleep(2)
                    if conversations:
                        answers = asyncio.run(complete_all(server, prompts_, 64, len(prompts_)))
                        if len(first_answers) == w:
                            first_answers.append(answers)
                        turns = conversations[w * args.rows : (w + 1) * args.rows]
                        prompts_ = [second_turn_prompt(tokenizer, t, a) for t, a in zip(turns, first_answers[w])]
                    ttfts = asyncio.run(wave(server, prompts_, args.max_tokens, args.behind))
                    results[method].append(ttfts)
                    print(
                        f"round {round_} {method}: wave of {len(ttfts)}, first tokens "
                        f"{min(ttfts) * 1000:.0f}-{max(ttfts) * 1000:.0f} ms",
                        flush=True,
                    )
    (args.out / "first_wave.json").write_text(json.dumps(results))
    print("\n| method | wave | slowest first token ms, per round |\n|---|---|---|")
    for method, runs in results.items():
        for w in range(args.waves):
            slowest = [max(runs[r * args.waves + w]) * 1000 for r in range(args.rounds)]
            print(f"| {method} | {w} | {', '.join(f'{s:.0f}' for s in slowest)} |")
    for method, runs in results.items():
        print(f"{method}: median slowest {statistics.median(max(r) for r in runs) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
