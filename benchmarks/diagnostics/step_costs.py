# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What does a verification step cost, by what it carries? Checks the controller's cost model.

Runs one batch with plain decoding and one with self-admg (same prompts), reads the steps the
proposer logged (prompt tokens, logit rows, sampled rows, draft tokens, seconds), and prints
the mean step time by number of draft tokens in the step, next to plain decoding's mean step.
A jump from 0 to 1 draft token that the per-token slope does not explain is a fixed cost of
verifying anything at all, which a per-token model cannot see.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so \
        .venv/bin/python -m benchmarks.diagnostics.step_costs --batch 32 --temperature 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # proposer_report via RPC


def main(argv=None) -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm, choose_dtype, close_llm
    from vllm_selfspec.operations.worker_extension import proposer_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--spec", default='{"method": "self-admg"}', help="default: its default options")
    args = parser.parse_args(argv)
    dtype = choose_dtype(args.dtype)
    print(f"dtype {dtype.reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    model = assets.model_or_path(args.model)
    prompts = assets.load_prompts(args.workload)
    warmup, batches = prompts[: args.batch], [prompts[args.batch * i : args.batch * (i + 1)] for i in (1, 2)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    for name, spec in (("plain", None), ("self-admg", json.loads(args.spec))):
        llm = build_llm(
            model,
            dtype=dtype.dtype,
            max_model_len=2048,
            max_num_seqs=args.batch,
            kv_cache_memory_bytes=2 << 30,
            speculative_config=spec,
        )
        llm.generate(warmup, params, use_tqdm=False)
        seconds, tokens = 0.0, 0
        for batch in batches:
            start = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            f"{name}: {tokens / seconds:.1f} tok/s, {seconds / (2 * args.max_tokens) * 1000:.0f} ms "
            f"per plain-equivalent step",
            flush=True,
        )
        if spec:
            report = llm.collective_rpc(proposer_report)[0]
            steps = np.array(report["steps"], dtype=float)
            print(
                f"logged steps: {len(steps)} ({steps[:, 4].sum():.1f} s, {(steps[:, 0] > 0).sum()} with "
                f"prompt tokens); probes: {report['prompts_measured']} prompts, {report['probe_seconds']:.1f} s; "
                f"self-drafts: {report['draft_steps']} steps, {report['draft_seconds']:.1f} s; "
                f"lookup tokens: {report['lookup_tokens']}"
            )
            decode = steps[steps[:, 0] == 0]  # steps without prompt tokens
            print("draft tokens in step | steps | mean rows | mean ms")
            for low, high in ((0, 0), (1, 1), (2, 4), (5, 16), (17, 10**6)):
                sel = decode[(decode[:, 3] >= low) & (decode[:, 3] <= high)]
                if len(sel):
                    print(
                        f"{low}-{high} | {len(sel)} | {sel[:, 1].mean() - sel[:, 3].mean():.1f} | "
                        f"{sel[:, 4].mean() * 1000:.0f}"
                    )
            x = np.column_stack([np.ones(len(decode)), decode[:, 1], decode[:, 3] > 0])
            coef, *_ = np.linalg.lstsq(x, decode[:, 4], rcond=None)
            print(
                f"fit over decode steps: {coef[0] * 1000:.0f} ms + {coef[1] * 1000:.1f} ms per logit row "
                f"+ {coef[2] * 1000:.0f} ms if any draft"
            )
        close_llm(llm)


if __name__ == "__main__":
    main()
