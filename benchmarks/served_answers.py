# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Real requests for the host-time benchmark's `recorded` workload: a workload's prompts, as the
serving benchmark sends them, and the model's greedy answers to them, as token ids. Greedy
verification accepts a draft token exactly when it is the answer's next token, so replaying
these answers (`benchmarks.host_time`) gives the proposer the steps a server would give it, with
real text to look up in, on a machine without vLLM or the model (a GPU host's CPU).

    .venv/bin/python -m benchmarks.served_answers                    # chat, SmolLM2-135M, 128 requests
    .venv/bin/python -m benchmarks.host_time --answers PATH --workloads recorded

Needs vLLM and the model to record; only numpy to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np


class Answer(NamedTuple):
    prompt: np.ndarray  # int64 token ids
    output: np.ndarray  # int64 token ids: the model's greedy answer


def save(path: Path, answers: list[Answer], about: dict) -> None:
    """One .npz: every prompt and output concatenated, with their lengths, and `about` (JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        prompts=np.concatenate([a.prompt for a in answers]).astype(np.int64),
        prompt_lengths=np.array([len(a.prompt) for a in answers], dtype=np.int64),
        outputs=np.concatenate([a.output for a in answers]).astype(np.int64),
        output_lengths=np.array([len(a.output) for a in answers], dtype=np.int64),
        about=np.array(json.dumps(about)),
    )


def load(path: Path) -> tuple[list[Answer], dict]:
    with np.load(path) as data:
        prompts = np.split(data["prompts"], np.cumsum(data["prompt_lengths"])[:-1])
        outputs = np.split(data["outputs"], np.cumsum(data["output_lengths"])[:-1])
        about = json.loads(str(data["about"]))
    return [Answer(p, o) for p, o in zip(prompts, outputs) if len(o)], about


def record(*, model: str, workload: str, requests: int, max_tokens: int, dtype: str | None) -> list[Answer]:
    """The first `requests` prompts of `workload` (`benchmarks.serving.first_prompts`) and the
    model's greedy answers, from a plain engine."""
    from vllm import SamplingParams

    from benchmarks.engine import bind_worker_cores, engine
    from benchmarks.serving import first_prompts

    bind_worker_cores()
    with engine(model, dtype=dtype, max_model_len=4096, max_num_seqs=32, kv_cache_memory_bytes=2 << 30) as llm:
        prompts = first_prompts(workload, llm.get_tokenizer())[:requests]
        done = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [Answer(np.array(d.prompt_token_ids), np.array(d.outputs[0].token_ids)) for d in done]


def default_path(model: str, workload: str) -> Path:
    from benchmarks.assets import cache_root

    return cache_root() / "served-answers" / f"{model}-{workload}.npz"


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workload", default="chat", help="a workload of benchmarks.serving (chat, code, ...)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="default: what this machine runs natively")
    parser.add_argument("--out", type=Path, help="default: the lab's cache, served-answers/MODEL-WORKLOAD.npz")
    args = parser.parse_args(argv)
    out = args.out or default_path(args.model, args.workload)
    answers = record(
        model=args.model, workload=args.workload, requests=args.requests, max_tokens=args.max_tokens, dtype=args.dtype
    )
    about = {"model": args.model, "workload": args.workload, "max_tokens": args.max_tokens, "greedy": True}
    save(out, answers, about)
    print(f"{len(answers)} answers, {sum(len(a.output) for a in answers)} tokens: {out}")
    return out


if __name__ == "__main__":
    main()
