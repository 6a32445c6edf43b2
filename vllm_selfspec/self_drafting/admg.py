# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The Adaptive Draft Model Generator (ADMG): per-sequence statistics in, skip masks out.

Pure functions, no vLLM. The statistic (Metel et al., "Draft on the Fly", EMNLP Findings 2024)
is, for each decoder layer l and sublayer f in {attention, MLP}, the cosine similarity between
the residual stream entering f and the stream after f's output is added, averaged over the
prompt's tokens. A similarity near 1 means f barely changes the stream, so a draft may skip it.

Rules, applied in this order (each switchable through `SelfAdmgOptions`), unless a byte budget
is set (`skip_budget`, `budget_rule` below: rank by change per byte saved, skip until the budget
is met, edge layers kept):
1. threshold (the paper's rule): skip f when its similarity is above the threshold.
2. fill_gaps (structural, ours, in the paper's spirit of rules that remove more layers): a kept
   sublayer whose neighbours of the same kind, within `fill_gaps` layers on *both* sides, are
   skipped is skipped too. Redundancy comes in contiguous runs of depth; a lone kept sublayer
   inside a run is usually a similarity just under the threshold, and removing it saves a
   sublayer at little cost.
3. keep_edge_layers (structural, ours): nothing in the first and last N layers is skipped. The
   first layers turn token embeddings into features (their similarity is low on every model
   we measured, e.g. 0.05 at layer 0 of Qwen2.5-Coder-1.5B) and the last layer writes the
   features the LM head reads; skipping either hurts every later token, whatever the
   similarity says. Applied last so that no other rule can undo it.

The paper's exact wording of its two structural rules was not at hand; rules 2 and 3 are our
design and are tested for what they promise in tests/test_admg.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_selfspec.options import SelfAdmgOptions


@dataclass(frozen=True)
class SkipMask:
    """Which sublayers one sequence's draft skips, per decoder layer."""

    attention: tuple[bool, ...]
    mlp: tuple[bool, ...]

    @property
    def num_skipped(self) -> int:
        return sum(self.attention) + sum(self.mlp)

    @classmethod
    def keep_all(cls, num_layers: int) -> SkipMask:
        return cls((False,) * num_layers, (False,) * num_layers)


def threshold_rule(similarity: Sequence[float], threshold: float) -> list[bool]:
    """The paper's rule: skip where the similarity is strictly above the threshold."""
    return [float(s) > threshold for s in similarity]


def fill_gaps_rule(skip: Sequence[bool], max_gap: int) -> list[bool]:
    """Skip a kept sublayer that has a skipped one within `max_gap` layers on both sides."""
    if max_gap <= 0:
        return list(skip)
    n = len(skip)
    out = list(skip)
    for i in range(n):
        if skip[i]:
            continue
        before = any(skip[max(0, i - max_gap) : i])
        after = any(skip[i + 1 : min(n, i + 1 + max_gap)])
        out[i] = before and after
    return out


def keep_edge_layers_rule(skip: Sequence[bool], num_edge_layers: int) -> list[bool]:
    """Never skip in the first and last `num_edge_layers` layers."""
    out = list(skip)
    n = len(out)
    for i in list(range(min(num_edge_layers, n))) + list(range(max(0, n - num_edge_layers), n)):
        out[i] = False
    return out


def select_sublayers(similarity: Sequence[float], threshold: float, options: SelfAdmgOptions) -> list[bool]:
    """All rules for one kind of sublayer."""
    skip = threshold_rule(similarity, threshold)
    skip = fill_gaps_rule(skip, options.fill_gaps)
    return keep_edge_layers_rule(skip, options.keep_edge_layers)


def budget_rule(
    attention_similarity: Sequence[float],
    mlp_similarity: Sequence[float],
    attention_bytes: float,
    mlp_bytes: float,
    budget: float,
    skippable_attention: Sequence[bool],
    skippable_mlp: Sequence[bool],
) -> tuple[list[bool], list[bool]]:
    """Skip the sublayers that change the stream least per weight byte saved (1 - similarity
    over bytes), until `budget` of all the sublayers' bytes is saved: a fractional knapsack.
    A fixed threshold means a different draft cost on every model (similarities are inflated
    by a few huge residual dimensions, by different amounts); a byte budget does not."""
    if attention_bytes <= 0 or mlp_bytes <= 0:
        raise ValueError(f"sublayer weight bytes must be positive, got {attention_bytes}, {mlp_bytes}")
    n = len(attention_similarity)
    candidates = [
        ((1 - float(attention_similarity[i])) / attention_bytes, "attention", i, attention_bytes)
        for i in range(n)
        if skippable_attention[i]
    ]
    candidates += [
        ((1 - float(mlp_similarity[i])) / mlp_bytes, "mlp", i, mlp_bytes) for i in range(n) if skippable_mlp[i]
    ]
    skip = {"attention": [False] * n, "mlp": [False] * n}
    saved, target = 0.0, budget * n * (attention_bytes + mlp_bytes)
    for _, kind, i, cost in sorted(candidates):
        if saved >= target:
            break
        skip[kind][i] = True
        saved += cost
    return skip["attention"], skip["mlp"]


def select_skip_mask(
    attention_similarity: Sequence[float],
    mlp_similarity: Sequence[float],
    options: SelfAdmgOptions,
    sublayer_bytes: tuple[float, float] | None = None,
) -> SkipMask:
    """One sequence's draft: the sublayers its prompt's statistics say it can skip.
    `sublayer_bytes` (attention, MLP weight bytes per layer) is needed for `skip_budget`."""
    if len(attention_similarity) != len(mlp_similarity):
        raise ValueError("attention and MLP statistics must cover the same layers")
    if options.skip_budget > 0:
        if sublayer_bytes is None:
            raise ValueError("skip_budget needs the sublayers' weight bytes")
        n = len(attention_similarity)
        edges = keep_edge_layers_rule([True] * n, options.keep_edge_layers)
        attention, mlp = budget_rule(
            attention_similarity,
            mlp_similarity,
            *sublayer_bytes,
            options.skip_budget,
            edges,
            edges if options.skips_mlp else [False] * n,
        )
        return SkipMask(tuple(attention), tuple(mlp))
    attention = select_sublayers(attention_similarity, options.attention_threshold, options)
    if options.skips_mlp:
        mlp = select_sublayers(mlp_similarity, options.mlp_threshold, options)
    else:
        mlp = [False] * len(mlp_similarity)
    return SkipMask(tuple(attention), tuple(mlp))
