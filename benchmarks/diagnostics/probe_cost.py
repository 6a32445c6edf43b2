"""Cost of self-admg's statistics probe as a share of prefill time.

Runs the same prompts, one at a time, through a plain engine with max_tokens=1 (each request
is one prefill) and through a self-admg engine with max_tokens=3 (the shortest request that
gets drafts, hence a probe), and compares the plain prefill time with the probe time the
self-admg proposer records. Prints a table; the machine is noted.

    .venv/bin/python -m benchmarks.diagnostics.probe_cost [--model smollm2-135m] [--prompts 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def main() -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm, choose_dtype, close_llm
    from vllm_selfspec.report import proposer_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--dataset", default="humaneval", choices=["humaneval", "news"])
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    args = parser.parse_args()
    args.dtype, reason = choose_dtype(args.dtype)
    print(f"dtype {reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    model = assets.model_or_path(args.model)
    prompts = assets.load_prompts(args.dataset, limit=args.prompts)
    common = dict(
        dtype=args.dtype,
        max_model_len=4096,
        max_num_seqs=1,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
    )

    results = {}
    for name, spec, max_tokens in (("plain", None, 1), ("self-admg", {"method": "self-admg"}, 3)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm = build_llm(model, speculative_config=spec, **common)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        before = llm.collective_rpc(proposer_report)[0] if spec else {}
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        results[name] = {"seconds": time.perf_counter() - start}
        if spec:
            after = llm.collective_rpc(proposer_report)[0]
            results[name]["probe"] = after["probe_seconds"] - before["probe_seconds"]
            results[name]["tokens"] = after["prompt_tokens_measured"] - before["prompt_tokens_measured"]
        close_llm(llm)

    plain, ours = results["plain"], results["self-admg"]
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; model {args.model}, "
        f"{args.dtype}, {len(prompts)} {args.dataset} prompts ({ours['tokens']} tokens), batch 1"
    )
    print(f"{'':34}{'seconds':>9}")
    print(f"{'plain prefill (max_tokens=1)':34}{plain['seconds']:>9.2f}")
    print(f"{'self-admg probe passes':34}{ours['probe']:>9.2f}")
    print(f"probe / plain prefill: {ours['probe'] / plain['seconds']:.0%}")


if __name__ == "__main__":
    main()
