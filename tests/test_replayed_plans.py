# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Plans unchanged: the proposer's model-free stages, replayed over the host-time benchmark's
synthetic batches (`benchmarks.host_time`), make the plans and drafts recorded in
tests/data/replayed_plans.json, step by step. A change that makes the pipeline faster must make
the same plans; one that means to change them records them anew and says why in its commit:

    REPLAY_RECORD=1 .venv/bin/python -m pytest tests/test_replayed_plans.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_controller import closed, lookup_rows, self_rows, trained

from benchmarks.host_time import MockedRunner, earlier_outputs, make_rows, run_ours
from vllm_selfspec.control.step_costs import StepCostModel

RECORDED = Path(__file__).parent / "data" / "replayed_plans.json"
CASES = [(w, b) for w in ("nothing", "lookup", "prediction", "history") for b in (1, 8)]
CASES += [("prediction", 32), ("offline", 3), ("offline", 8)]
K, STEPS, ANSWER = 8, 24, 400


def replay(workload: str, batch: int) -> list[dict]:
    history = earlier_outputs(4096, 0)
    pool = np.concatenate([np.append(h, -1) for h in history])
    rows = make_rows(
        "lookup" if workload == "offline" else workload, batch, context=256, answer=ANSWER, history=pool, seed=7
    )
    plans: list[dict] = []
    run_ours(
        MockedRunner(rows, ANSWER),
        k=K,
        steps=STEPS,
        warm_up=0,
        options={"lookup_history_unsalted": True} if workload == "history" else {},
        history=history if workload == "history" else None,
        plans=plans,
        lookup_seconds_per_row=20e-6,
        closed_batches=workload == "offline",  # (a draining batch after its first steps)
    )
    return plans


@pytest.fixture(scope="module")
def recorded() -> dict:
    if os.environ.get("REPLAY_RECORD"):
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps({f"{w}/{b}": replay(w, b) for w, b in CASES}) + "\n")
    return json.loads(RECORDED.read_text())


@pytest.mark.parametrize(("workload", "batch"), CASES)
def test_plans_replay_as_recorded(recorded, workload, batch):
    expected = recorded[f"{workload}/{batch}"]
    for step, (now, then) in enumerate(zip(replay(workload, batch), expected, strict=True)):
        assert now == then, f"{workload}, {batch} rows: step {step} planned differently"


def test_the_plan_and_gains_kernels_compile_once():
    """Every plan, every step's budgets, gains, predictions and lessons call their compiled kernels with the types their
    warm-ups compiled at the engine's start: a second signature would be compiled in the middle
    of a serving step."""
    from vllm_selfspec.control import acceptance, cost_fit, draining_plan, lookup_plan, request_rates
    from vllm_selfspec.sources import request_predictions
    from vllm_selfspec.vllm_integration import runner_state

    runner_state.warm_up()
    lookup_plan.warm_up()
    acceptance.warm_up()
    request_predictions.warm_up()
    cost_fit.warm_up()
    draining_plan.warm_up()
    for workload in ("lookup", "prediction"):
        replay(workload, 8)
    costs = StepCostModel()  # (the replays' costs are pinned: learned ones update their sums)
    for rows in range(1, 12):
        costs.observe_step(0, rows, 0, 1e-3 * rows, draft_tokens=rows // 2, context_read=100.0 * rows)
        costs.observe_self_step(rows, 1e-4 * rows)
    offline = trained(t0=0.28, t1=0.0088, self_step=0.05, lookup_rate=0.99, self_rate=0.95)
    draining = closed(lookup_rows(4, 2) + self_rows(1), [30, 29, 30])
    assert offline.plan(draining, self_budget=4, draining=True).self_length
    assert len(lookup_plan.greedy_lookup_plan.signatures) == 1, lookup_plan.greedy_lookup_plan.signatures
    assert len(lookup_plan.steady_lookup_plan.signatures) == 1, lookup_plan.steady_lookup_plan.signatures
    assert len(acceptance._lookup_gains.signatures) == 1, acceptance._lookup_gains.signatures
    assert len(acceptance._sums_in_order.signatures) == 1, acceptance._sums_in_order.signatures
    assert len(request_rates.learn_verified.signatures) == 1, request_rates.learn_verified.signatures
    assert len(request_predictions.follow_rows.signatures) == 1, request_predictions.follow_rows.signatures
    assert len(cost_fit.ridge_nonnegative_fit.signatures) == 1, cost_fit.ridge_nonnegative_fit.signatures
    assert len(cost_fit.add_decayed.signatures) == 1, cost_fit.add_decayed.signatures
    assert len(draining_plan.finish_lines.signatures) == 1, draining_plan.finish_lines.signatures
    assert len(runner_state.draft_budgets.signatures) == 1, runner_state.draft_budgets.signatures


def test_the_recording_drafts():
    """The replay is worth something only if its steps plan drafts of every kind it covers."""
    recorded = json.loads(RECORDED.read_text())
    for workload in ("lookup", "prediction", "history"):
        for batch in (1, 8):
            drafted = sum(len(d) for step in recorded[f"{workload}/{batch}"] for d in step["drafts"])
            assert drafted > STEPS, f"{workload}, {batch} rows drafted {drafted} tokens in {STEPS} steps"
