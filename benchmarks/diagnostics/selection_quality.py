# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""How good is ADMG's choice of sublayers? Draft/target agreement against the share of weight
bytes skipped, for three selections at equal byte budgets:

- admg: each prompt's own similarities (`budget_rule`, as `skip_budget` does in the engine),
- static: the same rule on the mean similarities of the *other* prompts (a calibrated,
  prompt-independent draft, as in Draft & Verify's offline search),
- random: random sublayers up to the same budget (mean of several draws).

Agreement is teacher-forced with plain transformers: the target's greedy continuation is fed
back with the sublayers skipped at every position, and a position agrees when the skipped
model's argmax equals the target's next token. Real drafts reuse the target's KV for verified
positions, so real acceptance is higher; this is a lower bound that ranks selections fairly.

    .venv/bin/python -m benchmarks.diagnostics.selection_quality --model qwen2.5-coder-1.5b --prompts 4
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from vllm_selfspec.self_drafting.admg import budget_rule, keep_edge_layers_rule
from vllm_selfspec.self_drafting.residual_stream import weight_bytes


class Skipper:
    """Hooks that leave chosen sublayers' outputs out of the residual stream."""

    def __init__(self, model):
        self.layers = model.model.layers
        self.attention = [False] * len(self.layers)
        self.mlp = [False] * len(self.layers)
        self.captured: dict[str, list] = {"in": [], "attn": [], "mlp": []}
        self.capture = False
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            layer.self_attn.register_forward_hook(lambda m, a, out, i=i: self._attn_hook(i, out))
            layer.mlp.register_forward_hook(lambda m, a, out, i=i: self._mlp_hook(i, out))

    def _pre_hook(self, module, args, kwargs):
        if self.capture:
            self.captured["in"].append(kwargs.get("hidden_states", args[0] if args else None))

    def _attn_hook(self, i, out):
        if self.capture:
            self.captured["attn"].append(out[0] if isinstance(out, tuple) else out)
        if self.attention[i]:
            return (torch.zeros_like(out[0]), *out[1:]) if isinstance(out, tuple) else torch.zeros_like(out)
        return None

    def _mlp_hook(self, i, out):
        if self.capture:
            self.captured["mlp"].append(out)
        return torch.zeros_like(out) if self.mlp[i] else None


def similarities(model, skipper: Skipper, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The ADMG statistic over a prompt (the same as the engine's probe)."""
    for v in skipper.captured.values():
        v.clear()
    skipper.capture = True
    with torch.no_grad():
        model(torch.tensor([ids]))
    skipper.capture = False
    attn, mlp = [], []
    for h, a, m in zip(*skipper.captured.values()):
        h, a, m = h[0].double(), a[0].double(), m[0].double()
        attn.append(torch.cosine_similarity(h, h + a, dim=-1).mean().item())
        mlp.append(torch.cosine_similarity(h + a, h + a + m, dim=-1).mean().item())
    return np.array(attn), np.array(mlp)


def agreement(model, skipper, prompt: list[int], continuation: list[int], mask) -> float:
    skipper.attention, skipper.mlp = list(mask[0]), list(mask[1])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0]
    skipper.attention, skipper.mlp = [False] * len(skipper.layers), [False] * len(skipper.layers)
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return float(np.mean([p == t for p, t in zip(predicted, continuation)]))


def random_mask(rng, n, attention_bytes, mlp_bytes, budget, skippable):
    """Random sublayers (outside the kept edge layers) until `budget` of the bytes is saved."""
    candidates = [("a", i, attention_bytes) for i in range(n) if skippable[i]]
    candidates += [("m", i, mlp_bytes) for i in range(n) if skippable[i]]
    rng.shuffle(candidates)
    attention, mlp, saved = [False] * n, [False] * n, 0.0
    for kind, i, cost in candidates:
        if saved >= budget * n * (attention_bytes + mlp_bytes):
            break
        (attention if kind == "a" else mlp)[i] = True
        saved += cost
    return attention, mlp


def skipped_share(mask, attention_bytes, mlp_bytes) -> float:
    n = len(mask[0])
    return (sum(mask[0]) * attention_bytes + sum(mask[1]) * mlp_bytes) / (n * (attention_bytes + mlp_bytes))


def main(argv=None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks import assets
    from benchmarks.engine import choose_dtype
    from benchmarks.output import default_out

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="an asset name or a model directory")
    parser.add_argument("--workload", choices=["humaneval", "news"], default="humaneval")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="target continuation length")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--random-draws", type=int, default=2)
    parser.add_argument("--dtype", help="default: bfloat16 where this machine runs it natively, else float32")
    parser.add_argument("--out", type=Path, help="default: selection-quality-<date> in the cache")
    args = parser.parse_args(argv)
    args.out = args.out or default_out("selection-quality")
    args.dtype, reason = choose_dtype(args.dtype)
    print(f"dtype {reason}", flush=True)
    path = assets.model_or_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    skipper = Skipper(model)
    n = len(skipper.layers)
    attention_bytes, mlp_bytes = weight_bytes(skipper.layers[0].self_attn), weight_bytes(skipper.layers[0].mlp)
    skippable = keep_edge_layers_rule([True] * n, 1)

    prompts = [tokenizer(p).input_ids for p in assets.load_prompts(args.workload, limit=args.prompts)]
    continuations, stats = [], []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)
        continuations.append(out[0, len(ids) :].tolist())
        stats.append(similarities(model, skipper, ids))

    rng = random.Random(0)
    rows = []
    for budget in args.budgets:
        for p, (ids, continuation) in enumerate(zip(prompts, continuations)):
            others = [s for q, s in enumerate(stats) if q != p]
            static = (np.mean([a for a, _ in others], 0), np.mean([m for _, m in others], 0))
            masks = {
                "admg": budget_rule(*stats[p], attention_bytes, mlp_bytes, budget, skippable, skippable),
                "static": budget_rule(*static, attention_bytes, mlp_bytes, budget, skippable, skippable),
            }
            for d in range(args.random_draws):
                masks[f"random {d}"] = random_mask(rng, n, attention_bytes, mlp_bytes, budget, skippable)
            for name, mask in masks.items():
                rows.append(
                    {
                        "budget": budget,
                        "prompt": p,
                        "selection": name.split()[0],
                        "skipped_share": skipped_share(mask, attention_bytes, mlp_bytes),
                        "agreement": agreement(model, skipper, ids, continuation, mask),
                    }
                )
            print(json.dumps(rows[-1]), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
    )
    table = summarize(rows)
    (args.out / "table.md").write_text(
        f"Teacher-forced greedy agreement, {args.model} ({args.dtype}), {args.prompts} {args.workload} prompts "
        f"x {args.tokens} tokens; command: `python -m benchmarks.diagnostics.selection_quality "
        f"{' '.join(argv or __import__('sys').argv[1:])}`\n\n{table}\n"
    )
    plot(rows, args.out / "selection_quality.png")
    print("\n" + table)
    return args.out


def summarize(rows) -> str:
    lines = ["| budget | selection | skipped share | agreement |", "|---|---|---|---|"]
    for budget in sorted({r["budget"] for r in rows}):
        for selection in ("admg", "static", "random"):
            sel = [r for r in rows if r["budget"] == budget and r["selection"] == selection]
            lines.append(
                f"| {budget} | {selection} | {np.mean([r['skipped_share'] for r in sel]):.3f} "
                f"| {np.mean([r['agreement'] for r in sel]):.3f} |"
            )
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for selection in ("admg", "static", "random"):
        budgets = sorted({r["budget"] for r in rows})
        sel = [[r for r in rows if r["budget"] == b and r["selection"] == selection] for b in budgets]
        ax.plot(
            [np.mean([r["skipped_share"] for r in s]) for s in sel],
            [np.mean([r["agreement"] for r in s]) for s in sel],
            marker="o",
            label=selection,
        )
    ax.set_xlabel("share of the layers' weight bytes skipped")
    ax.set_ylabel("draft/target agreement (teacher-forced)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
