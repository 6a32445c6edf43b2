# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Is a temperature-0 mismatch a near-tie? Plain decoding's top-2 log-probabilities at a token.

Arguments are `prompt@token` pairs, as the benchmark's lossless column prints them (the
prompt's index in the workload's prompt list, and the output token where outputs diverge):

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python -m benchmarks.diagnostics.tie_margin news 3@32 4@22

Pass the --dtype of the run that mismatched (both default to this machine's native dtype).
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm, choose_dtype

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=("humaneval", "news"))
    parser.add_argument("where", nargs="+", help="prompt@token pairs")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    args = parser.parse_args(argv)
    dtype = choose_dtype(args.dtype)
    print(f"dtype {dtype.reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    prompts = assets.load_prompts(args.workload)
    llm = build_llm(args.model, dtype=dtype.dtype, max_model_len=2048, max_num_seqs=1, kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    for pair in args.where:
        index, token = map(int, pair.split("@"))
        output = llm.generate([prompts[index]], params, use_tqdm=False)[0].outputs[0]
        first, second = sorted(output.logprobs[token].values(), key=lambda lp: -lp.logprob)[:2]
        print(
            f"{args.workload} prompt {index} token {token}: {first.decoded_token!r} {first.logprob:.4f}, "
            f"{second.decoded_token!r} {second.logprob:.4f}, margin {first.logprob - second.logprob:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
