# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Does the controller's step-cost fit hold under open-loop load? Replays a server's timed steps.

`benchmarks.serving` saves, for each self-admg run, the steps as the server's controller timed
them (raw/*-steps.json: prompt tokens, logit rows, sampled rows, draft tokens, seconds, context
tokens read). This
feeds them, in order, to a fresh StepCostModel, the one the controller uses, and prints what it
predicted for each step before seeing it against what the step took, by kind of step, then the
fit it ended with, and what the drafts verified in steps that carry prompt tokens cost those
steps: a new prompt's first token waits for them. No engine runs.

    .venv/bin/python -m benchmarks.diagnostics.step_fit \
        ~/.cache/vllm-selfspec/results/serving-quick-.../raw/r0-self-admg-chat-max-steps.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import numpy as np

from vllm_selfspec.control.step_costs import StepCostModel

# (label, prompt tokens in the step?, fewest draft tokens, most draft tokens)
KINDS = (
    ("with prompt tokens", True, 0, 10**9),
    ("decode, no drafts", False, 0, 0),
    ("decode, 1-24 draft tokens", False, 1, 24),
    ("decode, 25+ draft tokens", False, 25, 10**9),
)


def replay(steps: list[list[float]]) -> tuple[np.ndarray, StepCostModel]:
    """Rows (prompt tokens, logit rows, sampled rows, draft tokens, seconds, predicted seconds;
    NaN before the fit is ready) and the model after the last step. A step's sixth field, the
    context tokens its logit rows read, is priced as the server prices it (0 in older logs)."""
    model, rows = StepCostModel(), []
    for prompt, logit_rows, sampled, drafts, seconds, *context in steps:
        context_read = float(context[0]) if context else 0.0
        prompt, logit_rows, sampled, drafts = int(prompt), int(logit_rows), int(sampled), int(drafts)
        features = model.step_features(prompt, logit_rows, sampled, drafts, context_read)
        predicted = model.step.predict(features) if model.ready else np.nan
        rows.append((prompt, logit_rows, sampled, drafts, seconds, predicted))
        model.observe_step(prompt, logit_rows, sampled, seconds, drafts, context_read)
    return np.array(rows, dtype=float).reshape(-1, 6), model


def draft_share_of_prompt_steps(rows: np.ndarray, model: StepCostModel) -> tuple[float, float]:
    """(Seconds the drafts verified in steps with prompt tokens cost by the model's fit, seconds
    those steps took.)"""
    c = model.target()
    prompt_steps = rows[rows[:, 0] > 0]
    drafts = prompt_steps[:, 3]
    return float((c.t_row * drafts + c.t_verify * (drafts > 0)).sum()), float(prompt_steps[:, 4].sum())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", help="a *-steps.json that benchmarks.serving saved")
    args = parser.parse_args(argv)
    with open(args.steps) as f:
        rows, model = replay(json.load(f))
    prompt, drafts, seconds, predicted = rows[:, 0], rows[:, 3], rows[:, 4], rows[:, 5]
    print(
        f"{len(rows)} steps, {seconds.sum():.1f} s; steps with prompt tokens: {(prompt > 0).sum()}, "
        f"{seconds[prompt > 0].sum():.1f} s"
    )
    print("step | steps | measured ms (mean) | predicted ms (mean) | predicted / measured")
    for label, prefill, low, high in KINDS:
        chosen = ((prompt > 0) == prefill) & (drafts >= low) & (drafts <= high) & ~np.isnan(predicted)
        if chosen.any():
            measured, guessed = seconds[chosen].mean(), predicted[chosen].mean()
            print(f"{label} | {chosen.sum()} | {measured * 1e3:.0f} | {guessed * 1e3:.0f} | {guessed / measured:.2f}")
    print("final fit, ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in asdict(model.target()).items()))
    drafts, total = draft_share_of_prompt_steps(rows, model)
    if total:
        print(
            f"drafts verified in steps with prompt tokens: {drafts:.2f} s of their {total:.1f} s "
            f"({100 * drafts / total:.1f}%, by the final fit)"
        )


if __name__ == "__main__":
    main()
