"""Does the controller expect what verification then gives? Checks its lookup estimates.

Runs closed batches with self-admg only, logs each row's plan in the worker (the expected
accepted tokens of the lookup draft it chose, whether the batch was draining, the row's tokens
left) next to what verification accepted, and prints expected against accepted, by the
expected rate of the draft's first token and by draining. Also prints the steps each batch
took: a closed batch ends with its last row, so tokens accepted in a batch that still takes
max_tokens steps bought nothing.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so \
        .venv/bin/python -m benchmarks.diagnostics.plan_calibration --batch 8 --temperature 1
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import numpy as np

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions via collective_rpc


def install_log(worker) -> None:
    """Wrap the worker's controller so that each plan and each outcome is logged."""
    controller = worker.model_runner.drafter.controller
    log = {"plans": [], "outcomes": []}
    plan, observe_draft = controller.plan, controller.observe_draft

    def logged_plan(offers, self_budget, draining=False):
        result = plan(offers, self_budget, draining)
        if controller.costs.ready:
            step = controller.costs.target()
            rows = []
            for o, length in zip(offers, result.lookup_lengths):
                gains = controller.acceptance.lookup_gains(o) if o.lookup_tokens else []
                rows.append(
                    dict(
                        req=o.req_id,
                        offered=o.lookup_tokens,
                        length=length,
                        first=gains[0] if gains else None,
                        expected=float(sum(gains[:length])),
                        left=o.remaining,
                    )
                )
            log["plans"].append(
                dict(
                    draining=draining,
                    t0=step.t0,
                    t_row=step.t_row,
                    t_sampled=step.t_sampled,
                    t_verify=step.t_verify,
                    self_length=result.self_length,
                    rows=rows,
                )
            )
        return result

    def logged_observe_draft(req_id, source, drafted, accepted, bins=(), estimated=0.0):
        log["outcomes"].append(
            dict(
                req=req_id,
                source=str(getattr(source, "value", source)),
                drafted=drafted,
                accepted=accepted,
                plan=len(log["plans"]),
            )
        )
        return observe_draft(req_id, source, drafted, accepted, bins, estimated)

    controller.plan, controller.observe_draft = logged_plan, logged_observe_draft
    worker.model_runner.drafter._calibration_log = log


def read_log(worker) -> dict:
    return worker.model_runner.drafter._calibration_log


def main(argv=None) -> None:
    from vllm import SamplingParams

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, build_llm, choose_dtype

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--spec", default='{"method": "self-admg", "num_speculative_tokens": 4}')
    parser.add_argument("--out", help="write the raw log here (JSON)")
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    args = parser.parse_args(argv)
    dtype = choose_dtype(args.dtype)
    print(f"dtype {dtype.reason}", flush=True)
    print(f"cores {bind_worker_cores().reason}", flush=True)
    prompts = assets.load_prompts(args.workload)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    llm = build_llm(
        args.model,
        dtype=dtype.dtype,
        max_model_len=2048,
        max_num_seqs=args.batch,
        kv_cache_memory_bytes=2 << 30,
        speculative_config=json.loads(args.spec),
    )
    llm.generate(prompts[:1], params, use_tqdm=False)  # learn step costs before logging
    llm.collective_rpc(install_log)
    batch_steps, log = [], {"plans": []}
    for b in range(1, args.batches + 1):
        before = len(log["plans"])
        llm.generate(prompts[b * args.batch : (b + 1) * args.batch], params, use_tqdm=False)
        log = llm.collective_rpc(read_log)[0]
        batch_steps.append(len(log["plans"]) - before)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(log, f)

    # Pair each outcome with the plan row that chose it (the plan made just before it).
    expected_by = {}
    for n, plan in enumerate(log["plans"], start=1):
        for row in plan["rows"]:
            if row["length"]:
                expected_by[(n, row["req"])] = (row, plan["draining"])
    table = defaultdict(lambda: np.zeros(4))  # (draining, first-rate bucket): n, drafted, expected, accepted
    for out in log["outcomes"]:
        key = (out["plan"], out["req"])
        if key not in expected_by or out["source"] == "self":
            continue
        row, draining = expected_by[key]
        bucket = min(int(row["first"] * 10), 9) / 10
        table[(draining, bucket)] += (1, out["drafted"], row["expected"], out["accepted"])
    print("draining | first-token rate | drafts | tokens | expected accepted | accepted")
    for (draining, bucket), (n, drafted, expected, accepted) in sorted(table.items()):
        print(
            f"{draining} | {bucket:.1f}-{bucket + 0.1:.1f} | {n:.0f} | {drafted:.0f} | {expected:.1f} | {accepted:.0f}"
        )
    plans = log["plans"]
    print(
        f"plans: {len(plans)}, draining {sum(p['draining'] for p in plans)}; "
        f"last plan's t0 {plans[-1]['t0'] * 1e3:.0f} ms, t_row {plans[-1]['t_row'] * 1e3:.1f} ms, "
        f"t_sampled {plans[-1]['t_sampled'] * 1e3:.1f} ms, t_verify {plans[-1]['t_verify'] * 1e3:.1f} ms"
    )
    print(f"steps per batch of {args.batch} x {args.max_tokens} tokens: {batch_steps}")


if __name__ == "__main__":
    main()
