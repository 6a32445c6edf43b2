"""What the proposer hand-off costs every step, drafts or none (benchmarks/NOTES.md, "a wait
for requests is not a step").

Runs one engine in this process (vLLM's engine core in-process), times vLLM's
`propose_draft_token_ids` (for self-admg, the whole proposer: lookup, planning, probes and
self-drafts) and the runner's `execute_model`, and prints them per step with the decode speed.
It first serves `--history` prompts unmeasured, so that self-admg's lookup history is as full as
a server's, then `--rounds` batches of `--batch` HumanEval prompts.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.diagnostics.proposer_cost --method self-admg
    ... --method suffix --batch 16 --history 120
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process, to time it


def timed(cls, name: str, totals: dict) -> None:
    """Wrap cls.name to add its calls and seconds to totals[name]."""
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            totals[name][0] += 1
            totals[name][1] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def main(argv=None) -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="self-admg", help="a speculative method, or plain")
    parser.add_argument(
        "--spec-options",
        type=json.loads,
        default={},
        help="more of the speculative config, as JSON: '{\"prompt_lookup_min\": 16}' with "
        "ngram gives a speculative engine that drafts almost nothing",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10, help="measured batches")
    parser.add_argument("--history", type=int, default=2, help="prompts served first, unmeasured")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(bind_worker_cores().reason)
    spec = None if args.method == "plain" else {"method": args.method, "num_speculative_tokens": 4, **args.spec_options}
    llm = build_llm(
        args.model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=max(args.batch, 1),
        seed=0,
        speculative_config=spec,
        kv_cache_memory_bytes=1 << 30,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    totals = {"propose_draft_token_ids": [0, 0.0], "execute_model": [0, 0.0]}
    for name in totals:  # after the engine is built: self-admg patches the hand-off when it starts
        timed(GPUModelRunner, name, totals)
    prompts = assets.load_prompts("humaneval")
    if args.history + args.batch * args.rounds > len(prompts):
        raise SystemExit(f"--history + --batch x --rounds must be at most {len(prompts)}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(prompts[: args.history], params, use_tqdm=False)
    for pair in totals.values():
        pair[:] = [0, 0.0]
    start, tokens = time.perf_counter(), 0
    for i in range(args.rounds):
        batch = prompts[args.history + i * args.batch : args.history + (i + 1) * args.batch]
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False))
    wall = time.perf_counter() - start
    (steps, step_s), (calls, propose_s) = totals["execute_model"], totals["propose_draft_token_ids"]
    method = f"{args.method} {json.dumps(args.spec_options)}" if args.spec_options else args.method
    print(
        f"{method}, batch {args.batch}, after {args.history} prompts: {tokens} tokens in {wall:.2f} s "
        f"= {tokens / wall:.1f} tokens/s; {steps} steps of {1e3 * step_s / max(steps, 1):.2f} ms; proposer "
        f"{1e3 * propose_s / max(calls, 1):.2f} ms a step ({100 * propose_s / wall:.1f}% of the time)"
    )


if __name__ == "__main__":
    main()
