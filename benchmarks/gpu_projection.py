# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The GPU projection of docs/gpu.md: speedups of self-drafts, lookup drafts and both, per model size and
batch, from step costs measured on one H200 and acceptance measured here or published. Arithmetic only,
not a measurement: no GPU, no vLLM, no engine. Prints the markdown tables the doc shows.

    python -m benchmarks.gpu_projection

The model, in units of one plain decode step at the same batch:
- A step verifying k drafts per row costs c_verify(k) = 1 + k (c_verify(4) - 1) / 4: only k = 4 was
  measured, and verification grows with the tokens it scores.
- A self-draft step skipping a share s of the layers' bytes costs 1 - s (1 - c_half) / 0.5, c_half being
  the measured cost with half of the attention and MLP sublayers skipped (the 25% column agrees within 0.01).
- A lookup draft costs no GPU time. Tokens are accepted one after another with probability a each, so k
  drafts yield (1 - a^(k+1)) / (1 - a) tokens a step.
- The controller (`vllm_selfspec/control/planner.py`) adds draft tokens, best expected tokens per cost
  first, while each beats the plan's tokens per step-cost so far by its 20% margin.
"""

from __future__ import annotations

DRAFT_MARGIN = 0.2  # as vllm_selfspec.control.planner.DRAFT_MARGIN
K = 4  # num_speculative_tokens the projection assumes (the verification costs below are of 4 drafts)

# Measured on one H200 (docs/gpu.md says where): bf16, every step in a CUDA graph, real shapes with random
# weights and 1,024 tokens of context a row. Per batch: (verify 4 drafts, skip half of attention and MLP),
# each over a plain one-token step at that batch.
COSTS = {
    "1.5B (Qwen2.5-1.5B)": {1: (1.24, 0.53), 8: (1.22, 0.53), 64: (2.35, 0.52)},
    "8B (Llama-3.1-8B)": {1: (1.11, 0.52), 8: (1.17, 0.52), 64: (2.47, 0.52)},
    "32B (Qwen2.5-32B)": {1: (1.07, 0.51), 8: (1.15, 0.51), 64: (2.63, 0.51)},
}
BATCHES = (1, 8, 64)

# Self-draft acceptance measured here: teacher-forced greedy agreement by share of layer bytes skipped,
# Qwen2.5-Coder-1.5B, HumanEval (selection-quality-qwen, in git at f82f2b0), the better of ADMG and static.
MEASURED_CURVE = [(0.032, 0.969), (0.063, 0.917), (0.126, 0.875), (0.221, 0.766), (0.315, 0.552)]
# 8B and larger: none measured here. A band around what self-speculative papers report for 13B-70B models
# with 37-49% of the layers' bytes skipped (docs/gpu.md gives the sources and what was verified).
PUBLISHED_BAND = (0.80, 0.85, 0.90)  # at half of the sublayers skipped, where the costs were measured

# Lookup drafts, greedy: (mean acceptance length per drafting step, draft tokens per drafting step).
# Code and summarization: Qwen2.5-Coder-1.5B at batch 1 on HumanEval and news (batch1-2026-11-23, in git at f82f2b0).
# Chat: SmolLM2-135M served at light load (serving-refills, serving-quick: 1.71-2.31, median about 1.9);
# its draft tokens per step were not recorded, so 2 is assumed, as on news.
LOOKUP = {"code": (1.686, 1.505), "summarization": (2.198, 2.033), "chat": (1.9, 2.0)}
LOOKUP_DEPTH = 2  # what lookup offered a step, rounded: the CPU's controller took nearly all of it
# Share of steps (batch 1) or rows (larger batches) that find a lookup draft: not counted in any kept run.
# The CPU's batch-1 speedups imply about 0.36 (HumanEval) and 0.59 (news), with a verified token at 3% of a
# step, and less than the truth since their time includes prefill; 0.5 is assumed.
LOOKUP_SHARE = 0.5


def expected_tokens(a: float, k: float) -> float:
    """Tokens a step yields with k drafts accepted one after another with probability a each."""
    return k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def verify_cost(k: float, verify4: float) -> float:
    return 1 + k * (verify4 - 1) / 4


def draft_cost(skip: float, half: float) -> float:
    return 1 - skip * (1 - half) / 0.5


def speedup(a: float, k: int, c_draft: float, c_verify: float) -> float:
    """Self-drafts alone: tokens a step over the step's cost, k draft steps and one verification."""
    return expected_tokens(a, k) / (k * c_draft + c_verify)


def fit_acceptance(length: float, drafted: float) -> float:
    """The per-token acceptance a with expected_tokens(a, drafted) == length, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, drafted) < length else (lo, mid)
    return (lo + hi) / 2


def greedy(verify4, lookup=None, self_draft=None):
    """The controller's plan for one step, per row of the batch: (tokens, cost, lookup depth, self depth).
    lookup: (share of rows, a); self_draft: (share of rows, a, draft step cost). A draft step runs once for
    all its rows, so it costs the same whatever their share (at batch 8 and more a step is bound by
    reading the weights, and this overstates it at 64, where nothing pays anyway)."""
    per_token = (verify4 - 1) / 4
    tokens, cost, depth = 1.0, 1.0, {"lookup": 0, "self": 0}
    while True:
        offers = []
        if lookup and depth["lookup"] < LOOKUP_DEPTH:
            share, a = lookup
            offers.append((share * a ** (depth["lookup"] + 1), share * per_token, "lookup"))
        if self_draft and depth["self"] < K:
            share, a, c_draft = self_draft
            offers.append((share * a ** (depth["self"] + 1), c_draft + share * per_token, "self"))
        offers = [o for o in offers if o[0] / o[1] > (1 + DRAFT_MARGIN) * tokens / cost]
        if not offers:
            return tokens, cost, depth["lookup"], depth["self"]
        gain, extra, source = max(offers, key=lambda o: o[0] / o[1])
        tokens, cost, depth[source] = tokens + gain, cost + extra, depth[source] + 1


def plan(batch, verify4, lookup_a=None, self_draft=None, share=LOOKUP_SHARE):
    """(speedup, lookup depth, self depth). lookup_a: lookup's acceptance, found for a share of rows;
    self_draft: (a, draft step cost) for every row without a lookup draft (or every row, without lookup).
    At batch 1 the share is one of steps, and each kind of step is planned on its own."""
    self_share = 1 - share if lookup_a is not None else 1.0
    if batch == 1 and lookup_a is not None:
        t_l, c_l, k_l, _ = greedy(verify4, lookup=(1.0, lookup_a))
        t_s, c_s, _, k_s = greedy(verify4, self_draft=(1.0, *self_draft)) if self_draft else (1.0, 1.0, 0, 0)
        tokens, cost = share * t_l + (1 - share) * t_s, share * c_l + (1 - share) * c_s
        return tokens / cost, k_l, k_s
    tokens, cost, k_l, k_s = greedy(
        verify4,
        lookup=(share, lookup_a) if lookup_a is not None else None,
        self_draft=(self_share, *self_draft) if self_draft else None,
    )
    return tokens / cost, k_l, k_s


def best_k(a, c_draft, verify4):
    """Self-drafts alone at the k that pays best: (speedup, k)."""
    return max((speedup(a, k, c_draft, verify_cost(k, verify4)), k) for k in range(1, K + 1))


def cell(result) -> str:
    value, lookup_depth, self_depth = result
    return f"{value:.2f} ({lookup_depth}+{self_depth})"


def best_measured(batch, verify4, half, lookup_a=None):
    """The plan at the best point of the measured 1.5B curve."""
    return max(
        (plan(batch, verify4, lookup_a, (a, draft_cost(s, half))) for s, a in MEASURED_CURVE),
        key=lambda result: result[0],
    )


def main() -> None:
    lookup_a = {name: fit_acceptance(*measured) for name, measured in LOOKUP.items()}
    print("Lookup acceptance a token, fitted: " + ", ".join(f"{n} {a:.2f}" for n, a in lookup_a.items()))
    print()
    print(
        "| model shape | batch | draft step, half skipped | verify 4 | a needed, half skipped | a used | "
        "best k | the controller | the controller, a = 0.80-0.90 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, by_batch in COSTS.items():
        for batch in BATCHES:
            verify4, half = by_batch[batch]
            need = (1 + DRAFT_MARGIN) * (half + (verify4 - 1) / 4)  # the first self token's test
            needed = f"{need:.2f}" if need < 1 else "over 1"
            if model.startswith("1.5B"):  # the measured curve, at its best point
                best, k, skip, a = max((*best_k(a, draft_cost(s, half), verify4), s, a) for s, a in MEASURED_CURVE)
                chosen = best_measured(batch, verify4, half)
                used, band = f"{a:.2f} at {skip:.0%} skipped, measured", "-"
            else:
                a = PUBLISHED_BAND[1]
                best, k = best_k(a, half, verify4)
                chosen = plan(batch, verify4, self_draft=(a, half))
                low, high = (plan(batch, verify4, self_draft=(end, half))[0] for end in PUBLISHED_BAND[::2])
                used, band = f"{a:.2f}, published", f"{low:.2f}-{high:.2f}" if high > low else f"{low:.2f}"
            print(
                f"| {model} | {batch} | {half:.2f} | {verify4:.2f} | {needed} | {used} | {best:.2f} (k={k}) | "
                f"{chosen[0]:.2f} (k={chosen[2]}) | {band} |"
            )
    print()
    names = list(LOOKUP)
    print(
        "| model shape | batch | "
        + " | ".join(f"lookup, {n}" for n in names)
        + " | "
        + " | ".join(f"both, {n}" for n in names)
        + " |"
    )
    print("|---|---|" + "---|" * (2 * len(names)))
    for model, by_batch in COSTS.items():
        for batch in BATCHES:
            verify4, half = by_batch[batch]
            lookups, both = [], []
            for name in names:
                lookups.append(cell(plan(batch, verify4, lookup_a[name])))
                if model.startswith("1.5B"):
                    both.append(cell(best_measured(batch, verify4, half, lookup_a[name])))
                else:
                    both.append(cell(plan(batch, verify4, lookup_a[name], (PUBLISHED_BAND[1], half))))
            print(f"| {model} | {batch} | " + " | ".join(lookups + both) + " |")


if __name__ == "__main__":
    main()
