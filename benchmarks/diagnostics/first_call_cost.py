"""What the eager draft path costs the first time, against later calls (benchmarks/NOTES.md).

An engine whose every row self-drafts (`adaptive: false, lookup: false`) decodes batches of
1-4 new prompts, 3 tokens each; after each batch it prints the probe and draft-step time the
proposer spent on it, and the start-up warm-up's time.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.diagnostics.first_call_cost
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # proposer_report via RPC

KEYS = ("warmup_seconds", "probe_seconds", "prompts_measured", "draft_seconds", "draft_steps")


def main(argv=None) -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm, choose_dtype
    from vllm_selfspec.report import proposer_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 1, 1, 2, 2, 3, 3, 4, 4])
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    args = parser.parse_args(argv)
    dtype = choose_dtype(args.dtype)
    print(f"dtype {dtype.reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    prompts = assets.load_prompts("humaneval")
    llm = build_llm(
        args.model,
        dtype=dtype.dtype,
        max_model_len=2048,
        max_num_seqs=max(args.batches),
        kv_cache_memory_bytes=1 << 30,
        speculative_config={"method": "self-admg", "num_speculative_tokens": 4, "adaptive": False, "lookup": False},
    )

    def counters() -> dict:
        report = llm.collective_rpc(proposer_report, kwargs={"measurements": False})[0]
        return {key: report[key] for key in KEYS}

    before, start = counters(), 0
    for batch in args.batches:
        llm.generate(prompts[start : start + batch], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        start += batch
        now = counters()
        d = {key: now[key] - before[key] for key in KEYS}
        before = now
        print(
            f"B={batch}: warm-up {d['warmup_seconds']:.2f} s, probe {d['probe_seconds']:.3f} s for "
            f"{d['prompts_measured']} prompts, draft {d['draft_seconds']:.3f} s in {d['draft_steps']} steps",
            flush=True,
        )


if __name__ == "__main__":
    main()
