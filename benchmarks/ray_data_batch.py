# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Offline batch inference over several workers with Ray Data, self-admg in every replica.

    .venv/bin/python -m benchmarks.ray_data_batch --workers 2 --prompts 32
    .venv/bin/python -m benchmarks.ray_data_batch --address auto ...   # an existing Ray cluster

Each Ray actor owns one vLLM `LLM` with self-admg; Ray Data streams the prompts through the
actors in batches (`map_batches`), so replicas draft and verify independently and every row
carries its own output. The same script runs on a multi-node GPU cluster: start Ray on the
nodes, pass `--address auto` and `--num-gpus 1` (one GPU per replica), install
`vllm-selfspec[cuda]` on every node (each replica loads the plugin in its own processes), and
start from the root of the same checkout on every node: Ray puts the driver's working directory
on its workers' import path, which is how the replicas import this module. Without --dtype,
each replica takes its own machine's native dtype.
`--check` also runs plain decoding over the same rows and reports any row whose greedy output
differs (there should be none).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.engine import build_llm, native_dtype


class SelfAdmgReplica:
    """One vLLM engine per Ray actor; called with batches of rows {"id", "prompt"}."""

    def __init__(self, model: str, speculative_config: dict | None, sampling: dict, engine: dict):
        from vllm import SamplingParams

        self.llm = build_llm(model, speculative_config=speculative_config, **engine)
        self.params = SamplingParams(**sampling)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.llm.generate([str(p) for p in batch["prompt"]], self.params, use_tqdm=False)
        batch["text"] = np.array([o.outputs[0].text for o in outputs], dtype=object)
        batch["token_ids"] = np.array([list(o.outputs[0].token_ids) for o in outputs], dtype=object)
        batch["replica"] = np.full(len(outputs), os.getpid())
        return batch


def generate(
    prompts: list[str],
    model: str,
    speculative_config: dict | None,
    *,
    workers: int,
    sampling: dict,
    engine: dict,
    batch_size: int = 8,
    num_gpus: float = 0,
) -> list[dict]:
    """Rows {"id", "prompt", "text", "token_ids"} in prompt order, from `workers` replicas
    (`ray.init` must have been called)."""
    import ray

    # Ray Data hands batches to the first replica up while the others still build their engines,
    # and a short run can end before they are up: every replica starts before the rows flow. (A
    # dataset takes a copy of the context when it is made.)
    context = ray.data.DataContext.get_current()
    waited, context.wait_for_min_actors_s = context.wait_for_min_actors_s, REPLICAS_START_WITHIN_S
    try:
        dataset = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    finally:
        context.wait_for_min_actors_s = waited
    outputs = dataset.map_batches(
        SelfAdmgReplica,
        fn_constructor_kwargs=dict(
            model=model, speculative_config=speculative_config, sampling=sampling, engine=engine
        ),
        concurrency=workers,
        batch_size=batch_size,
        num_cpus=1,
        num_gpus=num_gpus,
    )
    rows = sorted(outputs.take_all(), key=lambda row: row["id"])
    return [{**row, "token_ids": [int(t) for t in row["token_ids"]]} for row in rows]


REPLICAS_START_WITHIN_S = 900  # (an engine's start, compiling included, on a slow 2-core VM)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an asset name or a model directory")
    parser.add_argument("--workload", choices=["humaneval", "news"], default="humaneval")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="replicas, one LLM each")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument("--speculative-config", default='{"method": "self-admg"}', help="default: its default options")
    parser.add_argument("--address", help="Ray cluster address (default: a local cluster)")
    parser.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica")
    parser.add_argument("--check", action="store_true", help="compare with plain decoding row by row")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    import ray

    from benchmarks import assets

    args = parse_args(argv)
    print(
        f"dtype {args.dtype} (--dtype)"
        if args.dtype
        else f"dtype: each replica's native one (here {native_dtype().reason})",
        flush=True,
    )
    model = assets.model_or_path(args.model)
    prompts = assets.load_prompts(args.workload, limit=args.prompts)
    sampling = dict(temperature=0, max_tokens=args.max_tokens)
    engine = dict(dtype=args.dtype, max_model_len=2048, kv_cache_memory_bytes=1 << 30)
    ray.init(address=args.address)
    start = time.perf_counter()
    rows = generate(
        prompts,
        model,
        json.loads(args.speculative_config),
        workers=args.workers,
        sampling=sampling,
        engine=engine,
        batch_size=args.batch_size,
        num_gpus=args.num_gpus,
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(r["token_ids"]) for r in rows)
    print(
        f"{len(rows)} rows, {tokens} tokens in {seconds:.1f} s on {args.workers} self-admg replicas "
        f"(engine start-up included)"
    )
    if args.check:
        plain = generate(
            prompts,
            model,
            None,
            workers=args.workers,
            sampling=sampling,
            engine=engine,
            batch_size=args.batch_size,
            num_gpus=args.num_gpus,
        )
        differ = [r["id"] for r, p in zip(rows, plain) if r["token_ids"] != p["token_ids"]]
        print(f"rows differing from plain decoding: {differ or 'none'}")
    for row in rows[:3]:
        print(f"--- {row['id']}: {row['prompt'][-60:]!r}\n{row['text']}")


if __name__ == "__main__":
    main()
