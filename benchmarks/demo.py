# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The first thing to run (`make demo`): plain decoding against self-admg, one request at a
time (batch 1), side by side, on what a user would send:

1. HumanEval prompts, completed;
2. one code edit (a function of Python's standard library and an instruction), sent without
   and with the code as OpenAI's `prediction`: the same answer, and what the prediction buys.

Each engine warms up on a prompt and an edit that no timed request shares: a timed request
that repeated the warm-up could draft its own earlier answer, which no real workload offers.

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
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine import bind_worker_cores, choose_dtype, engine

WHY = (
    "Where the speed comes from: drafts looked up in the prompt and earlier outputs, or made by the "
    "model with sublayers skipped; the full model verifies several per pass and keeps only what it "
    "would have written itself."
)


WARM_UP_PROMPT = 40  # a HumanEval prompt no timed request shares (the timed ones are the first --prompts)


@dataclass
class Timed:
    """What one engine did with the timed requests: outputs and tokens per second."""

    outputs: list
    tokens_per_s: float
    counters: dict = field(default_factory=dict)


def run(model: str, work: dict, args, speculative_config=None) -> dict[str, Timed]:
    """The HumanEval prompts, then the edit (and, on a self-admg engine, the edit with its code
    as the prediction), each timed apart, after a warm-up on requests none of them shares."""
    from vllm import SamplingParams

    from benchmarks.engine import spec_decode_counters
    from vllm_selfspec import with_prediction

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    edit_params = SamplingParams(temperature=0, max_tokens=work["edit_tokens"])
    timed = {}
    with engine(
        model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=1,
        kv_cache_memory_bytes=512 << 20,
        disable_log_stats=False,
        speculative_config=speculative_config,
    ) as llm:
        llm.generate([work["warm_up_prompt"]], params, use_tqdm=False)
        llm.chat([work["warm_up_edit"]], edit_params, use_tqdm=False)
        before = spec_decode_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(work["prompts"], params, use_tqdm=False)
        timed["humaneval"] = Timed(outputs, tokens(outputs) / (time.perf_counter() - start))
        after = spec_decode_counters(llm)
        timed["humaneval"].counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        variants = {"edit": edit_params}
        if speculative_config is not None:
            variants["edit + prediction"] = with_prediction(edit_params, work["edit_code"])
        for name, variant in variants.items():
            start = time.perf_counter()
            outputs = llm.chat([work["edit"]], variant, use_tqdm=False)
            timed[name] = Timed(outputs, tokens(outputs) / (time.perf_counter() - start))
    return timed


def tokens(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


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
    from benchmarks.predicted_edits import chat_messages, edits
    from benchmarks.run import cpu_model

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
        default={"method": "self-admg"},
        help="JSON, as for `vllm serve --speculative-config` (default: self-admg's default options)",
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own output instead of logging it")
    args = parser.parse_args(argv)

    args.dtype, dtype_reason = choose_dtype(args.dtype)
    model = assets.model_or_path(args.model)  # fetched on first use, with progress shown
    humaneval = assets.load_prompts("humaneval", limit=WARM_UP_PROMPT + 1)
    edit, warm_up_edit = edits(2, seed=0)

    work = {
        "prompts": humaneval[: args.prompts],
        "warm_up_prompt": humaneval[WARM_UP_PROMPT],
        "edit": chat_messages(edit),
        "edit_code": edit.code,
        "warm_up_edit": chat_messages(warm_up_edit),
        "edit_tokens": 512,
    }
    log = None if args.verbose else assets.cache_root() / "demo.log"
    print(f"plain decoding vs self-admg: {args.model}, one request at a time (batch 1)")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; dtype {dtype_reason}")
    print(f"cores {bind_worker_cores().reason}")
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        print(f"vLLM's own output goes to {log} (--verbose shows it here)")
    results = {}
    for name, spec in (("plain decoding", None), ("self-admg", args.speculative_config)):
        print(f"{name}: starting an engine, then decoding ...", end=" " if log else "\n", flush=True)
        with output_to(log):
            results[name] = run(model, work, args, spec)
        print("done", flush=True)
    report(results, work, edit, args)


def report(results: dict, work: dict, edit, args) -> None:
    plain, ours = results["plain decoding"], results["self-admg"]
    first = ours["humaneval"].outputs[0].outputs[0]
    print("\n=== self-admg output for HumanEval/0 ===")
    print(work["prompts"][0] + first.text)

    def same(a: Timed, b: Timed) -> int:
        return sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a.outputs, b.outputs))

    print(f"\n=== {args.model}, {args.dtype}, one request at a time; tokens per second ===")
    print(f"{'':34}{'plain':>8}{'self-admg':>11}")
    rows = [
        (f"HumanEval, {len(work['prompts'])} prompts x {args.max_tokens} tokens", "humaneval", "humaneval"),
        (f"code edit ({edit.kind}, {edit.name})", "edit", "edit"),
        ("the same edit with its prediction", "edit", "edit + prediction"),
    ]
    for label, plain_key, our_key in rows:
        p, o = plain[plain_key], ours[our_key]
        print(f"{label[:33]:34}{p.tokens_per_s:>8.1f}{o.tokens_per_s:>11.1f}   {o.tokens_per_s / p.tokens_per_s:.2f}x")
    c = ours["humaneval"].counters
    drafted, accepted, drafts = (c.get(k, 0) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
    if drafted:
        print(
            f"HumanEval: acceptance rate {accepted / drafted:.1%} ({accepted:.0f} of {drafted:.0f} draft tokens), "
            f"mean acceptance length {1 + accepted / max(drafts, 1):.2f}"
        )
    identical = same(plain["humaneval"], ours["humaneval"]) + same(plain["edit"], ours["edit"])
    identical += same(plain["edit"], ours["edit + prediction"])
    print(
        f"greedy outputs identical to plain decoding: {identical} of {len(work['prompts']) + 2}"
        + ("" if args.dtype == "float32" else " (bf16 may differ at near-ties; see docs/results.md)")
    )
    print(WHY)


if __name__ == "__main__":
    main()
