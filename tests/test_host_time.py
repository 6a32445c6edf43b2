# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The host-time benchmark: its recorded workload (answers recorded from a model,
`benchmarks.served_answers`, replayed as a server at capacity runs them), what its replays show
of the pipeline, and the paired comparison of two checkouts (`benchmarks.diagnostics.host_time_ab`)."""

from __future__ import annotations

import numpy as np

from benchmarks import served_answers
from benchmarks.host_time import recorded_runner, run_ours
from benchmarks.served_answers import Answer


def copying_answers(count: int) -> list[Answer]:
    """Answers of different lengths that copy a span of their prompts, so lookup drafts them."""
    return [Answer(np.arange(1, 60) + i, np.tile(np.arange(10, 18) + i, 2 + i)) for i in range(count)]


def test_recorded_answers_keep_their_tokens(tmp_path):
    answers = copying_answers(3) + [Answer(np.array([7]), np.array([], dtype=np.int64))]
    path = tmp_path / "answers.npz"
    served_answers.save(path, answers, {"model": "none"})
    loaded, about = served_answers.load(path)
    assert about == {"model": "none"}
    assert len(loaded) == 3  # (an empty answer is no request to replay)
    for got, want in zip(loaded, answers):
        assert got.prompt.tolist() == want.prompt.tolist() and got.output.tolist() == want.output.tolist()


def test_a_replay_emits_every_answer_and_refills_each_ended_row():
    answers = copying_answers(4)
    runner = recorded_runner(answers, batch=2, seed=0)
    measured = run_ours(runner, k=8, steps=40, warm_up=0, options={}, history=None, lookup_seconds_per_row=5e-6)
    assert len(runner.finished) >= 4  # answers ended, and their rows were refilled
    order = np.random.default_rng(0).permutation(len(answers))  # (the runner's order for seed 0)
    for req_id, request in runner.finished:  # (each emitted its whole answer, its caught-up part first)
        n = int(req_id.rsplit("-", 1)[1])
        assert request.output_token_ids == answers[order[n % len(answers)]].output.tolist()
    assert len({req_id for req_id, _ in runner.finished}) == len(runner.finished)
    assert len(set(runner.input_batch.req_ids)) == 2
    assert measured.draft_tokens > 0  # (the answers copy their prompts: the replay drafts)


def test_the_pipeline_forgets_the_requests_a_replay_ends(monkeypatch):
    """What the proposer keeps per request is dropped when the runner drops the request: the
    replay forgets them as vLLM's runner does, so its steps cost what a long-running server's do."""
    from vllm_selfspec.draft_pipeline import DraftPipeline

    held = []  # at each forget: the requests whose facts the pipeline holds
    original = DraftPipeline.forget

    def forget(self, req_id, request=None):
        held.append(len(self.request_facts.slot_of))
        original(self, req_id, request)

    monkeypatch.setattr(DraftPipeline, "forget", forget)
    runner = recorded_runner(copying_answers(3), batch=2, seed=1)
    run_ours(runner, k=4, steps=60, warm_up=0, options={}, history=None, lookup_seconds_per_row=5e-6)
    assert len(held) == len(runner.finished) >= 3
    assert max(held) <= 2  # (never more than the rows in flight)


def test_writing_the_caches_between_steps_changes_no_plan():
    """`--evict-mb` writes a buffer after each step, as a CPU forward streams its weights through
    the caches: it moves the proposer's time only, never a plan or a draft (lookup costs pinned)."""
    runs, evicting = [], np.zeros(1 << 16, dtype=np.uint8)
    for buffer in (None, evicting):
        runner = recorded_runner(copying_answers(3), batch=2, seed=0)
        runner.evicting, plans = buffer, []
        run_ours(runner, k=8, steps=30, warm_up=0, options={}, history=None, plans=plans, lookup_seconds_per_row=5e-6)
        runs.append(plans)
    assert runs[0] == runs[1] and any(p["drafts"] != [[], []] for p in runs[0])
    assert (evicting == 30).all()  # (written once a step, every byte)


def test_the_counters_say_what_the_plan_was_offered(monkeypatch):
    """Rows looked up and draft tokens offered, summed over the steps: what tells a plan that
    declined drafts from one offered none (the lookup gate closed)."""
    from vllm_selfspec.draft_pipeline import DraftPipeline
    from vllm_selfspec.sources.row_lookup import RowLookup

    pipelines, per_step = [], []
    original_init, original_find = DraftPipeline.__init__, RowLookup.find

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        pipelines.append(self)

    def find(self, *args, **kwargs):
        found = original_find(self, *args, **kwargs)
        per_step.append((self.rows_looked_up, int(found.lengths.sum())))
        return found

    monkeypatch.setattr(DraftPipeline, "__init__", init)
    monkeypatch.setattr(RowLookup, "find", find)
    runner = recorded_runner(copying_answers(4), batch=2, seed=0)
    measured = run_ours(runner, k=8, steps=40, warm_up=0, options={}, history=None, lookup_seconds_per_row=5e-6)
    (counters,) = [p.counters for p in pipelines]
    assert counters.rows_looked_up == sum(rows for rows, _ in per_step) > len(per_step)  # (rows, not steps)
    assert counters.tokens_offered == sum(tokens for _, tokens in per_step) >= measured.draft_tokens > 0


def test_at_capacity_the_per_row_rule_keeps_every_request_within_its_slack():
    """Replayed at capacity with step costs pinned, so that a step that verifies drafts is
    longer for every row in it: half the requests copy their prompts (lookup drafts them whole),
    half write new text (nothing to look up). By default no request falls below 98% of plain
    decoding's rate over its decoding so far (the per-row rule's promise), though the batch
    gains less; the throughput objective drafts more and leaves the new-text requests below it."""
    from benchmarks.diagnostics import row_rule

    rng = np.random.default_rng(0)
    answers = []
    for i in range(24):
        prompt = rng.integers(100, 30_000, 200)
        answers.append(Answer(prompt, prompt[50:98].copy() if i % 2 else rng.integers(100, 30_000, 48)))
    run = {"batch": 8, "steps": 400, "costs": row_rule.CPU_1_5B, "seed": 0}
    default = row_rule.replay(answers, options={}, **run)
    throughput = row_rule.replay(answers, options={"objective": "throughput"}, **run)
    assert default["requests"] >= 40 and default["accepted"] > 0
    assert default["slowest_x"] >= 0.98
    assert throughput["slowest_x"] < 0.98 and throughput["batch_x"] > 1.2
    assert throughput["batch_x"] > default["batch_x"] > 1


def test_the_paired_comparison_runs_a_commit_beside_the_working_tree_and_sees_a_plan_change(
    monkeypatch, capsys, tmp_path
):
    """`benchmarks.diagnostics.host_time_ab`: HEAD's copy, imported under other names, takes
    turns with the working tree over the same requests; the plans agree, and a copy that plans
    otherwise (other pinned step costs) is told apart."""
    from benchmarks.diagnostics import host_time_ab

    args = ["--against", "HEAD", "--cells", "lookup:4", "--rounds", "2", "--steps", "12", "--warm-up", "4"]
    (row,) = host_time_ab.main([*args, "--out", str(tmp_path)])
    assert row["same_plans"] and row["then"] > 0 and row["now"] > 0 and 0 < row["ratio"]
    assert set(row["now_stages"]) == set(row["then_stages"]) >= {"look_up", "plan"}
    assert "| lookup | 4 |" in capsys.readouterr().out
    assert "| lookup | 4 |" in (tmp_path / "table.md").read_text()
    assert {"environment.json", "results.csv"} <= {p.name for p in tmp_path.iterdir()}
    then = host_time_ab.copy_of(host_time_ab.resolved("HEAD"))
    monkeypatch.setattr(then, "GPU_8B", {**then.GPU_8B, "t_verify": 0.0, "t_row": 0.0})  # (drafts cost nothing)
    (row,) = host_time_ab.main(args)
    assert not row["same_plans"]


def test_a_batch_where_some_requests_sent_a_prediction_plans_as_when_every_row_was_asked(monkeypatch):
    """Predictions are followed only for rows whose request sent one (`RequestFacts.predicted`);
    in a batch where half did, every step plans as when every drafting row was asked for its
    prediction, and the predictions are what drafts those rows (without them it plans otherwise)."""
    import dataclasses

    from benchmarks.host_time import MockedRunner, make_rows
    from vllm_selfspec.vllm_integration.runner_state import RequestFacts

    def replay(keep_predictions: bool) -> list:
        rows = make_rows("prediction", 8, context=256, answer=200, history=None, seed=3)
        for row in rows[1::2] if keep_predictions else rows:
            row.prediction = None
        plans: list = []
        run_ours(MockedRunner(rows, 200), k=8, steps=20, warm_up=0, options={}, history=None, plans=plans,
                 lookup_seconds_per_row=5e-6)  # fmt: skip
        return plans

    filtered = replay(keep_predictions=True)
    assert replay(keep_predictions=False) != filtered
    read = RequestFacts.of
    monkeypatch.setattr(RequestFacts, "of", staticmethod(lambda p: dataclasses.replace(read(p), predicted=True)))
    assert replay(keep_predictions=True) == filtered
