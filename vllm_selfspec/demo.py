"""A short demo: the same HumanEval prompts through plain decoding and through self-admg, one
sequence at a time (batch 1, where speculative decoding is meant to help), side by side.

    .venv/bin/python -m vllm_selfspec.demo [--model smollm2-135m] [--prompts 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import time


def run(model: str, prompts: list[str], args, speculative_config=None) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_selfspec.proposer import spec_decode_counters

    llm = LLM(model=model, dtype=args.dtype, max_model_len=2048, max_num_seqs=1,
              kv_cache_memory_bytes=512 << 20, disable_log_stats=False,
              speculative_config=speculative_config)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = spec_decode_counters(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"outputs": outputs, "tokens_per_s": tokens / seconds, "counters": counters}


def main(argv=None) -> None:
    from vllm_selfspec import assets

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help="a model directory, or the name of a model vllm_selfspec.assets fetches")
    parser.add_argument("--prompts", type=int, default=4, help="number of HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--speculative-config", type=json.loads,
                        default={"method": "self-admg", "num_speculative_tokens": 4},
                        help="JSON, as for `vllm serve --speculative-config`")
    args = parser.parse_args(argv)

    model = str(assets.model_path(args.model)) if args.model in assets.ASSETS else args.model
    prompts = assets.load_prompts("humaneval", limit=args.prompts)
    plain = run(model, prompts, args)
    ours = run(model, prompts, args, args.speculative_config)

    first = ours["outputs"][0].outputs[0]
    print("\n=== self-admg output for HumanEval/0 ===")
    print(prompts[0] + first.text)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(plain["outputs"], ours["outputs"]))
    c = ours["counters"]
    drafted, accepted, drafts = (c.get(k, 0)
                                 for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
    print(f"=== {args.model}, {args.dtype}, batch 1, {len(prompts)} prompts x up to "
          f"{args.max_tokens} tokens ===")
    print(f"{'':24}{'tokens/s':>10}")
    print(f"{'plain decoding':24}{plain['tokens_per_s']:>10.1f}")
    print(f"{'self-admg':24}{ours['tokens_per_s']:>10.1f}   "
          f"({ours['tokens_per_s'] / plain['tokens_per_s']:.2f}x plain)")
    if drafted:
        print(f"acceptance rate {accepted / drafted:.1%} ({accepted:.0f} of {drafted:.0f} draft "
              f"tokens), mean acceptance length {1 + accepted / max(drafts, 1):.2f}")
    print(f"greedy outputs identical to plain decoding: {same} of {len(prompts)}"
          + ("" if args.dtype == "float32" else " (bf16 may differ at near-ties; see README)"))


if __name__ == "__main__":
    main()
