# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The first thing to run (`make demo`): the same HumanEval prompts through plain decoding and
through self-admg, one sequence at a time (batch 1, where speculative decoding is meant to
help), side by side.

    .venv/bin/python -m benchmarks.demo [--model smollm2-135m] [--prompts 4] [--max-tokens 64]

vLLM's own output (engine start-up, compilation, warnings) goes to demo.log in the asset cache;
--verbose shows it here instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.engine import bind_worker_cores, choose_dtype, engine

WHY = (
    "Where the speed comes from: drafts looked up in the prompt and earlier outputs, or made by the "
    "model with sublayers skipped; the full model verifies several per pass and keeps only what it "
    "would have written itself."
)


def run(model: str, prompts: list[str], args, speculative_config=None) -> dict:
    from vllm import SamplingParams

    from benchmarks.engine import spec_decode_counters

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    with engine(
        model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=1,
        kv_cache_memory_bytes=512 << 20,
        disable_log_stats=False,
        speculative_config=speculative_config,
    ) as llm:
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counters = spec_decode_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"outputs": outputs, "tokens_per_s": tokens / seconds, "counters": counters}


@contextlib.contextmanager
def output_to(log: Path | None) -> Iterator[None]:
    """Stdout and stderr of this process and the engine processes it starts into `log` (appended;
    None leaves them alone). At the file-descriptor level, since vLLM logs from its own processes."""
    if log is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as file:
        os.dup2(file.fileno(), 1), os.dup2(file.fileno(), 2)

    def restore() -> None:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)

    try:
        yield
    except BaseException:
        restore()
        print(f"\nfailed; vLLM's log is in {log}", file=sys.stderr)
        raise
    restore()


def main(argv=None) -> None:
    from benchmarks import assets

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2-135m", help="a model directory, or the name of a model benchmarks.assets fetches"
    )
    parser.add_argument("--prompts", type=int, default=4, help="number of HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default={"method": "self-admg", "num_speculative_tokens": 4},
        help="JSON, as for `vllm serve --speculative-config`",
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own output instead of logging it")
    args = parser.parse_args(argv)

    args.dtype, dtype_reason = choose_dtype(args.dtype)
    model = assets.model_or_path(args.model)  # fetched on first use, with progress shown
    prompts = assets.load_prompts("humaneval", limit=args.prompts)
    log = None if args.verbose else assets.cache_root() / "demo.log"
    print(f"plain decoding vs self-admg: {args.model}, {len(prompts)} HumanEval prompts, batch 1")
    print(f"dtype {dtype_reason}")
    print(f"cores {bind_worker_cores().reason}")
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        print(f"vLLM's own output goes to {log} (--verbose shows it here)")
    results = {}
    for name, spec in (("plain decoding", None), ("self-admg", args.speculative_config)):
        print(f"{name}: starting an engine, then decoding ...", end=" " if log else "\n", flush=True)
        with output_to(log):
            results[name] = run(model, prompts, args, spec)
        print("done", flush=True)
    plain, ours = results["plain decoding"], results["self-admg"]

    first = ours["outputs"][0].outputs[0]
    print("\n=== self-admg output for HumanEval/0 ===")
    print(prompts[0] + first.text)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain["outputs"], ours["outputs"]))
    c = ours["counters"]
    drafted, accepted, drafts = (c.get(k, 0) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
    print(f"\n=== {args.model}, {args.dtype}, batch 1, {len(prompts)} prompts x up to {args.max_tokens} tokens ===")
    print(f"{'':24}{'tokens/s':>10}")
    print(f"{'plain decoding':24}{plain['tokens_per_s']:>10.1f}")
    print(
        f"{'self-admg':24}{ours['tokens_per_s']:>10.1f}   ({ours['tokens_per_s'] / plain['tokens_per_s']:.2f}x plain)"
    )
    if drafted:
        print(
            f"acceptance rate {accepted / drafted:.1%} ({accepted:.0f} of {drafted:.0f} draft "
            f"tokens), mean acceptance length {1 + accepted / max(drafts, 1):.2f}"
        )
    print(
        f"greedy outputs identical to plain decoding: {same} of {len(prompts)}"
        + ("" if args.dtype == "float32" else " (bf16 may differ at near-ties; see docs/results.md)")
    )
    print(WHY)


if __name__ == "__main__":
    main()
