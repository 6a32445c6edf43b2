# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The proposer's host time per step, by stage, beside vLLM's own `ngram` proposer on the same
token histories. On a GPU a decode step takes a few milliseconds, and whatever the proposer does
on the host adds to every one of them: this measures that part alone, with no model.

Synthetic batches of B rows decode their answers step by step as vLLM would run them: each
step a row emits the draft tokens its answer bears out plus one, and the proposer's model-free
stages (`vllm_selfspec.draft_pipeline`: requests admitted and dropped, read, learn, look up,
offer, plan, hand over the lookup drafts) run over vLLM's runner state, mocked as plain arrays.
Step costs are pinned to an H100 step of an 8B model (`../shared/gpu/verify_costs_h100.md`), so
that the plans are the ones a GPU would get, whatever this machine's speed. Workloads:
  nothing     random prompts and answers: lookup finds little, nothing pays;
  lookup      answers that copy their prompts with edits (code edits, summaries);
  prediction  the same, each request sending its answer, edited, as OpenAI's `prediction`;
  history     answers copied from earlier outputs, in a --history-token pool shared by
              unsalted requests (`lookup_history_unsalted`), another request's output of 256
              tokens joining it each step (a busy server's requests ending);
  offline     the lookup workload in a closed batch, as `LLM.generate` runs it: admitting
              nobody after its first step, it counts as draining a few steps later (only
              its end counts: the planner's finish-line plan);
  recorded    real prompts and the model's answers to them (`benchmarks.served_answers`,
              --answers), B in flight as at a server's capacity: each request that ends
              gives its place to the next, whose prompt the step prefills.
Needs numpy and numba, not vLLM: vLLM's `ngram` proposer is run where vLLM is installed,
or from a copy of its source file (--ngram-source) where it is not, a GPU host say.

    .venv/bin/python -m benchmarks.host_time
    .venv/bin/python -m benchmarks.host_time --batches 1 16 --workloads lookup --steps 32
    .venv/bin/python -m benchmarks.host_time --workloads recorded --answers PATH

Writes table.md, results.csv, host_time.png and environment.json to --out (default: a dated
folder in the cache, outside the repository).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vllm_selfspec.control import DraftPlan
from vllm_selfspec.control.step_costs import pin_step_costs
from vllm_selfspec.draft_pipeline import DraftPipeline
from vllm_selfspec.operations.counters import PROPOSER_PARTS, PartClock
from vllm_selfspec.operations.fail_safe import FailSafe
from vllm_selfspec.options import make_options
from vllm_selfspec.scheduler_note import SchedulerNote
from vllm_selfspec.sources.prediction import PREDICTION_KEY
from vllm_selfspec.vllm_integration.runner_state import StepView

WORKLOADS = ("nothing", "lookup", "prediction", "history", "offline", "recorded")
VOCAB = 32000
# An H100 step of an 8B model at context 1024 (verify_costs_h100.md): 7.56 ms at batch 16,
# 9.95 ms at 64; verifying a draft of 4 at batch 16 costs 1.24x.
# Self-drafting is priced out (a draft step of a second): there is no model here to draft with.
GPU_8B = {"t0": 6.76e-3, "t_row": 5e-5, "t_verify": 3e-4, "self_step": 1.0}


@dataclass
class Row:
    """One request: its prompt, the answer it will emit, and its prediction, if any."""

    req_id: str
    prompt: np.ndarray
    answer: np.ndarray
    prediction: list[int] | None = None
    emitted: int = 0  # answer tokens emitted so far


def make_rows(workload: str, batch: int, *, context: int, answer: int, history: np.ndarray | None, seed: int):
    """B requests of a workload (module docstring)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(batch):
        prompt = rng.integers(1, VOCAB, context)
        if workload == "nothing":
            text = rng.integers(1, VOCAB, answer)
        elif workload == "history":
            start = int(rng.integers(0, len(history) - answer))
            text = history[start : start + answer].copy()
            text[text < 0] = 1
        else:  # copies of the prompt's spans, an edited token now and then
            starts = rng.integers(0, context - 64, answer // 32 + 1)
            text = np.concatenate([prompt[s : s + 32] for s in starts])[:answer]
            edits = rng.random(answer) < 0.03
            text[edits] = rng.integers(1, VOCAB, int(edits.sum()))
        prediction = None
        if workload == "prediction":
            guess = text.copy()
            edits = rng.random(answer) < 0.02
            guess[edits] = rng.integers(1, VOCAB, int(edits.sum()))
            prediction = guess.tolist()
        rows.append(Row(f"req-{seed}-{i}", prompt, np.asarray(text, dtype=np.int64), prediction))
    return rows


def earlier_outputs(tokens: int, seed: int) -> list[np.ndarray]:
    """Outputs of earlier requests, `tokens` in all, of 256 tokens each."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(1, VOCAB, 256) for _ in range(max(1, tokens // 257))]


def recorded_runner(answers: list, batch: int, seed: int) -> MockedRunner:
    """`batch` requests in flight from recorded answers (`benchmarks.served_answers`), each ended
    one replaced by the next, in an order that `seed` shuffles. The first `batch` are caught at
    random points of their answers, as a server at capacity holds its requests, not all at their
    first token (with more rows than answers, an answer is in flight more than once, at other
    points)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(answers))

    def request(n: int) -> Row:
        answer = answers[order[n % len(answers)]]
        return Row(f"rec-{seed}-{n}", answer.prompt, answer.output)

    running = [request(n) for n in range(batch)]
    for row in running:
        row.emitted = int(rng.integers(0, len(row.answer)))
    width = max(len(a.prompt) for a in answers) + max(len(a.output) for a in answers) + 1
    return MockedRunner(running, 0, (request(n) for n in itertools.count(batch)), width)


class MockedRunner:
    """vLLM 0.32's model runner and scheduler output as `StepView` reads them, over plain arrays:
    the rows decode their answers, emitting in each step the draft tokens the answer bears out
    and one more (greedy verification). `waiting`: requests that take the place of those whose
    answer ended (a server at capacity), each one's prompt scheduled in the step it is admitted."""

    def __init__(self, rows: list[Row], max_tokens: int, waiting: Iterator[Row] | None = None, width: int = 0):
        self.rows = list(rows)
        self.waiting = waiting
        self.max_tokens = max_tokens
        self.ended: list[tuple[str, object]] = []  # (req_id, request) the last step replaced
        self.finished: list[tuple[str, object]] = []  # ... and every step before it
        n = len(rows)
        width = max(width, max(len(r.prompt) for r in rows) + max_tokens + 1)
        self.input_batch = SimpleNamespace(
            req_ids=[r.req_id for r in rows],
            req_id_to_index={},
            token_ids_cpu=np.zeros((n, width), dtype=np.int32),
            num_tokens_no_spec=np.zeros(n, dtype=np.int32),
            num_prompt_tokens=np.zeros(n, dtype=np.int32),
        )
        self.requests = {}
        for i, r in enumerate(rows):
            self._admit(i, r)
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB)
        self.admitted = list(rows)  # (in the first step's scheduler output)
        self.evicting: np.ndarray | None = None  # written through after each step (--evict-mb)

    def _admit(self, i: int, r: Row) -> None:
        batch = self.input_batch
        batch.req_ids[i] = r.req_id
        batch.req_id_to_index[r.req_id] = i
        # (a request caught mid-answer holds what it emitted so far: `Row.emitted`)
        emitted = r.answer[: r.emitted]
        batch.token_ids_cpu[i, : len(r.prompt)] = r.prompt
        batch.token_ids_cpu[i, len(r.prompt) : len(r.prompt) + len(emitted)] = emitted
        batch.num_prompt_tokens[i] = len(r.prompt)
        batch.num_tokens_no_spec[i] = len(r.prompt) + len(emitted)
        params = SimpleNamespace(
            max_tokens=self.max_tokens if self.waiting is None else len(r.answer),
            temperature=0.0,
            seed=None,
            min_p=0.0,
            logit_bias=None,
            stop=None,
            stop_token_ids=[],
            eos_token_id=0,
            extra_args={PREDICTION_KEY: r.prediction} if r.prediction else None,
        )
        self.requests[r.req_id] = SimpleNamespace(
            sampling_params=params, output_token_ids=emitted.tolist(), prompt_token_ids=r.prompt.tolist()
        )

    def _refill(self, drafts: list[list[int]]) -> list[list[int]]:
        """Rows whose answers ended give their place to waiting requests (none of whose drafts
        run); the drafts of the rest."""
        self.ended, drafts = [], list(drafts)
        for i, row in enumerate(self.rows):
            if self.waiting is not None and row.emitted >= len(row.answer):
                new = next(self.waiting)
                del self.input_batch.req_id_to_index[row.req_id]
                self.ended.append((row.req_id, self.requests.pop(row.req_id)))
                self.finished.append(self.ended[-1])
                self.rows[i] = new
                self._admit(i, new)
                self.admitted.append(new)
                drafts[i] = []
        return drafts

    def step(self, drafts: list[list[int]]) -> tuple[object, list[list[int]]]:
        """Run one step verifying `drafts`: the scheduler output and each row's sampled tokens."""
        drafts = self._refill(drafts)
        batch, sampled = self.input_batch, []
        for i, (row, draft) in enumerate(zip(self.rows, drafts)):
            truth = row.answer[row.emitted : row.emitted + len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and accepted + 1 < len(truth) and draft[accepted] == truth[accepted]:
                accepted += 1
            emitted = truth[: accepted + 1].tolist()
            end = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, end : end + len(emitted)] = emitted
            batch.num_tokens_no_spec[i] = end + len(emitted)
            self.requests[row.req_id].output_token_ids.extend(emitted)
            row.emitted += len(emitted)
            sampled.append(emitted)
        new = {r.req_id for r in self.admitted}
        scheduled = {r.req_id: len(r.prompt) if r.req_id in new else 1 + len(d) for r, d in zip(self.rows, drafts)}
        cached = [r for r in scheduled if r not in new]
        output = SimpleNamespace(
            scheduled_new_reqs=self.admitted,
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached, resumed_req_ids=set()),
            total_num_scheduled_tokens=sum(scheduled.values()),
            num_scheduled_tokens=scheduled,
            scheduled_spec_decode_tokens={r.req_id: d for r, d in zip(self.rows, drafts) if d},
        )
        self.admitted = []
        if self.evicting is not None:  # (as a forward on the CPU streams its weights through the caches)
            self.evicting += 1
        return output, sampled


@dataclass
class Measured:
    seconds: list[float] = field(default_factory=list)  # per step
    # Per part, its seconds in each step (medians are read: this machine's noise comes in bursts
    # that a mean takes whole).
    parts: dict[str, list[float]] = field(default_factory=lambda: {part: [] for part in PROPOSER_PARTS})
    draft_tokens: int = 0
    requests_ended: int = 0  # and replaced by waiting ones (the recorded workload)
    tokens_offered: int = 0  # lookup and prediction draft tokens offered to the plan


def run_ours(
    runner: MockedRunner,
    *,
    k: int,
    steps: int,
    warm_up: int,
    options: dict,
    history,
    finishing: list | None = None,
    plans: list | None = None,
    lookup_seconds_per_row: float | None = None,
    closed_batches: bool = False,
    step_costs: dict | None = None,
) -> Measured:
    """The pipeline as the proposer drives it each step (`DraftPipeline.propose`), minus
    self-drafting (which needs the model). `finishing`: outputs of other requests, one ending
    each step (its output kept in the shared history, in the step's time, as the proposer keeps
    it when vLLM drops the request). `plans`: each step's plan and drafts are appended
    to it; `lookup_seconds_per_row`: what the lookup gate is told lookups cost, instead of
    their time (so that plans replay exactly, tests/test_replayed_plans.py); `closed_batches`:
    an offline engine's (`SchedulerNote.closed_batches`); `step_costs`: the costs pinned
    (`pin_step_costs`' arguments; default GPU_8B)."""
    pipeline = DraftPipeline(make_options(options), k, FailSafe())
    pin_step_costs(pipeline.controller.costs, **(step_costs or GPU_8B))
    if lookup_seconds_per_row is not None:
        gate = pipeline.controller.lookup_gate
        pipeline.controller.observe_lookup = lambda rows, _: gate.observe_lookup(rows, rows * lookup_seconds_per_row)
    for output in history or ():
        pipeline.lookup.history.add(None, output)
    measured, drafts = Measured(), [[] for _ in runner.rows]
    made: list = []  # this step's PreparedStep, for `plans`

    def lookup_drafts(prepared, warm_up: bool) -> list[list[int]]:
        """The proposer's `_draft` without self-drafts: the planned lookup drafts."""
        made.append(prepared)
        drafts = [[] for _ in range(prepared.step.num_rows)]
        pipeline.take_lookup_drafts(prepared, DraftPlan.from_ints(prepared.plan_ints, len(prepared.offers)), drafts)
        pipeline.lessons.step_ended(drafted=True)
        return drafts

    offered_in_warm_up = 0
    for step_index in range(warm_up + steps):
        if step_index == warm_up:
            offered_in_warm_up = pipeline.counters.tokens_offered
        output, sampled = runner.step(drafts)
        parts: dict[str, float] = {}
        start = time.perf_counter()
        clock = PartClock(parts)
        for req_id, request in runner.ended:  # (vLLM dropped them: what the proposer keeps goes)
            pipeline.forget(req_id, request)
        tenants = tuple((r.req_id, None) for r in output.scheduled_new_reqs)
        note = SchedulerNote(tenants=tenants, closed_batches=closed_batches)
        pipeline.begin_step(note, runner.requests)
        if finishing:
            pipeline.lookup.history.add(None, finishing[step_index % len(finishing)])
        clock.lap("update_states")
        step = StepView(runner, output, sampled, pipeline.request_facts)
        made.clear()
        drafts = pipeline.propose(step, clock, probed=(), warmed_up=True, draft=lookup_drafts)
        if step_index >= warm_up:
            measured.seconds.append(time.perf_counter() - start)
            measured.draft_tokens += sum(map(len, drafts))
            measured.requests_ended += len(runner.ended)
            for part, seconds in measured.parts.items():
                seconds.append(parts.get(part, 0.0))
        if plans is not None:
            plans.append({"plan": [int(x) for x in made[0].plan_ints] if made else None, "drafts": drafts})
    measured.tokens_offered = pipeline.counters.tokens_offered - offered_in_warm_up
    return measured


def ngram_proposer(k: int, max_model_len: int, source: Path | None):
    """vLLM's NgramProposer (prompt_lookup_min 2, max 4, as the lab's `ngram`), from vLLM or,
    where vLLM is absent, from a copy of vllm/v1/spec_decode/ngram_proposer.py; None if neither."""
    try:
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    except ImportError:
        if source is None or not source.exists():
            return None
        text = source.read_text().replace("from vllm.config import VllmConfig", "VllmConfig = object")
        namespace = {"__name__": "ngram_proposer"}
        exec(compile(text, str(source), "exec"), namespace)  # noqa: S102 (vLLM's own file, named by the user)
        NgramProposer = namespace["NgramProposer"]
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=4, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=1024),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return NgramProposer(config)


def run_ngram(proposer, runner: MockedRunner, *, k: int, steps: int, warm_up: int) -> Measured:
    measured, drafts = Measured(), [[] for _ in runner.rows]
    batch = runner.input_batch
    for step_index in range(warm_up + steps):
        _, sampled = runner.step(drafts)
        start = time.perf_counter()
        drafts = proposer.propose(k, sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
        if step_index >= warm_up:
            measured.seconds.append(time.perf_counter() - start)
            measured.draft_tokens += sum(map(len, drafts))
    return measured


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="default: every one (recorded: with answers)")
    parser.add_argument(
        "--answers", type=Path, help="recorded answers (benchmarks.served_answers; default: its default path, if there)"
    )
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--history-tokens", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=48, help="measured steps per run")
    parser.add_argument("--warm-up", type=int, default=16, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ngram-source", type=Path, help="vLLM's ngram_proposer.py, where vLLM is not installed")
    parser.add_argument(
        "--lookup-seconds-per-row",
        type=float,
        help="what the lookup gate is told a row's lookup costs, instead of its time: the same plans "
        "in every run, so that two checkouts compare by their time alone",
    )
    parser.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="write this many MiB after each step, outside the timed part, as a model's forward on the "
        "CPU streams its weights through the caches (0: caches left warm, as a GPU host's are)",
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    answers = recorded_answers(args)
    if args.out is None:
        from benchmarks.output import default_out

        args.out = default_out("host-time")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "environment.json").write_text(json.dumps(environment(args), indent=2, default=str))
    answer = args.k * (args.warm_up + args.steps) + 64  # (every row still decoding at the last step)
    longest = max((len(a.prompt) + len(a.output) + 1 for a in answers or ()), default=0)
    ngram = ngram_proposer(args.k, max(args.context + answer + 1, longest), args.ngram_source)
    history = earlier_outputs(args.history_tokens, 0)
    pool = np.concatenate([np.append(h, -1) for h in history])
    evicting = np.zeros(args.evict_mb << 20, dtype=np.uint8) if args.evict_mb else None
    rows = []
    for round_ in range(args.rounds):
        for workload in args.workloads:
            for batch in args.batches:
                options = {"lookup_history_unsalted": True} if workload == "history" else {}
                made = {"context": args.context, "answer": answer, "history": pool, "seed": round_}
                run = {"k": args.k, "steps": args.steps, "warm_up": args.warm_up}
                runner = make_runner(workload, batch, made, answers, evicting)
                earlier = history if workload == "history" else None
                ours = run_ours(
                    runner,
                    options=options,
                    history=earlier,
                    finishing=earlier,
                    lookup_seconds_per_row=args.lookup_seconds_per_row,
                    closed_batches=workload == "offline",
                    **run,
                )
                runner = make_runner(workload, batch, made, answers, evicting)  # (the same rows, anew)
                theirs = run_ngram(ngram, runner, **run) if ngram is not None else None
                rows.append(result_row(round_, workload, batch, args.steps, ours, theirs))
                print(rows[-1], flush=True)
    write(rows, args)
    return args.out


def recorded_answers(args) -> list | None:
    """The recorded answers the `recorded` workload replays (and `args.workloads` set: every
    workload, `recorded` only if answers are there); an error naming --answers if it needs them."""
    from benchmarks import served_answers

    path = args.answers
    if path is None:
        try:
            path = served_answers.default_path("smollm2-135m", "chat")
        except ImportError:  # (the lab's assets need packages a GPU host may lack)
            path = None
    found = path is not None and path.exists()
    if args.workloads is None:
        args.workloads = [w for w in WORKLOADS if w != "recorded" or found]
    if "recorded" not in args.workloads:
        return None
    if not found:
        raise SystemExit(f"--workloads recorded needs --answers FILE (benchmarks.served_answers); not found: {path}")
    return served_answers.load(path)[0]


def make_runner(workload: str, batch: int, made: dict, answers: list | None, evicting=None) -> MockedRunner:
    """`evicting`: the buffer written after each step (--evict-mb), or None."""
    if workload == "recorded":
        runner = recorded_runner(answers, batch, made["seed"])
    else:
        rows = make_rows("lookup" if workload == "offline" else workload, batch, **made)
        runner = MockedRunner(rows, made["answer"])
    runner.evicting = evicting
    return runner


def result_row(round_: int, workload: str, batch: int, steps: int, ours: Measured, theirs: Measured | None) -> dict:
    median = statistics.median(ours.seconds)
    row = {
        "round": round_,
        "workload": workload,
        "batch": batch,
        "ms_per_step": round(1e3 * median, 4),
        "us_per_row": round(1e6 * median / batch, 2),
        **{f"ms_{part}": round(1e3 * statistics.median(ours.parts[part]), 4) for part in PROPOSER_PARTS},
        "draft_tokens_per_step": round(ours.draft_tokens / steps, 2),
        "requests_ended": ours.requests_ended,
        "pct_of_8b_step": round(100 * median / gpu_step_seconds(batch), 2),
        "ngram_ms_per_step": None if theirs is None else round(1e3 * statistics.median(theirs.seconds), 4),
        "ngram_draft_tokens_per_step": None if theirs is None else round(theirs.draft_tokens / steps, 2),
    }
    return row


def gpu_step_seconds(batch: int) -> float:
    """A plain decode step of an 8B model on one H100 (the pinned costs)."""
    return GPU_8B["t0"] + GPU_8B["t_row"] * batch


def write(rows: list[dict], args) -> None:
    from benchmarks.serve_load import markdown_table

    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = []
    for workload in args.workloads:
        for batch in args.batches:
            runs = [r for r in rows if r["workload"] == workload and r["batch"] == batch]
            ms = sorted(r["ms_per_step"] for r in runs)
            ngram = sorted(r["ngram_ms_per_step"] for r in runs if r["ngram_ms_per_step"] is not None)
            summary.append(
                {
                    "workload": workload,
                    "batch": batch,
                    "ms per step (median of rounds; range)": f"{statistics.median(ms):.3f} ({ms[0]:.3f}-{ms[-1]:.3f})",
                    "us per row": f"{1e3 * statistics.median(ms) / batch:.1f}",
                    "% of an 8B H100 step": f"{100 * statistics.median(ms) / 1e3 / gpu_step_seconds(batch):.1f}",
                    "stages, ms a step (" + ", ".join(PROPOSER_PARTS) + ")": ", ".join(
                        f"{statistics.median(r[f'ms_{p}'] for r in runs):.3f}" for p in PROPOSER_PARTS
                    ),
                    "draft tokens per step": statistics.median(r["draft_tokens_per_step"] for r in runs),
                    "ngram ms per step": f"{statistics.median(ngram):.3f}" if ngram else "n/a",
                    "ngram draft tokens per step": (
                        statistics.median(r["ngram_draft_tokens_per_step"] for r in runs) if ngram else "n/a"
                    ),
                }
            )
    env = environment(args)
    lines = [
        f"# The proposer's host time per step ({env['cpu_model']}, {env['cpus']} CPUs)",
        "",
        f"K = {args.k}, {args.context}-token prompts, {args.steps} steps measured after {args.warm_up}, "
        f"{args.rounds} rounds; step costs pinned to an 8B model's H100 step; "
        + (f"{args.evict_mb} MiB written between steps. " if args.evict_mb else "caches warm between steps. ")
        + "`python -m benchmarks.host_time "
        + " ".join(os.sys.argv[1:])
        + "`",
        "",
        markdown_table(summary),
    ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, args)


def plot(summary: list[dict], args) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for workload in args.workloads:
        points = [(s["batch"], float(s["ms per step (median of rounds; range)"].split()[0])) for s in summary]
        points = [p for p, s in zip(points, summary) if s["workload"] == workload]
        ax.plot(*zip(*points), "o-", label=f"self-admg, {workload}")
    ngram = [(s["batch"], float(s["ngram ms per step"])) for s in summary if s["workload"] == args.workloads[0]]
    if all(s["ngram ms per step"] != "n/a" for s in summary):
        ax.plot(*zip(*ngram), "k--", label=f"vLLM ngram, {args.workloads[0]}")
    ax.plot(args.batches, [1e3 * 0.02 * gpu_step_seconds(b) for b in args.batches], ":", label="2% of an 8B H100 step")
    ax.set(xscale="log", yscale="log", xlabel="rows in the batch", ylabel="host ms per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "host_time.png", dpi=120)


def environment(args) -> dict:
    from benchmarks.run import cpu_model, measured_commit

    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "commit": os.environ.get("MEASURED_COMMIT") or measured_commit(),  # (set where no .git travels)
        "arguments": vars(args),
    }


if __name__ == "__main__":
    main()
