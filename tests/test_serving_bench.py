# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The serving benchmark's own logic (benchmarks/serving.py): load points, prompt slices, the
`vllm bench serve` command, the ratios in its table, and the replay of a server's timed steps
(benchmarks/diagnostics/step_fit.py). No server is started here."""

import json
import math
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import serving
from benchmarks.serving import LoadPoint, Run, Server
from vllm_selfspec.operations.counters import PROPOSER_PARTS


def run(server, point, round_=0, workload="code", default_cores=False, slot=0, **result):
    return Run(
        round_, Server(server, None, default_cores), workload, point, {"completed": 2, "failed": 0, **result}, slot=slot
    )


def test_load_points_scale_the_plain_capacity_and_start_with_the_capped_unlimited_run():
    points = serving.capacity_points(2.0, [0.1, 1.5], cap=16)
    assert [p.label for p in points] == ["max", "0.1C", "1.5C"]
    assert points[0].flags() == ["--request-rate", "inf", "--max-concurrency", "16"]
    assert points[1].flags() == ["--request-rate", "0.2"]
    assert points[2].rate == pytest.approx(3.0)


def test_every_load_point_gets_prompts_of_its_own():
    parts = serving.slices(list(range(10)), [4, 3, 3], workload="code")
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(SystemExit, match=r"code: load points of 4\+3\+3\+3 prompts need 13; it has 10"):
        serving.slices(list(range(10)), [4, 3, 3, 3], workload="code")


def test_the_unlimited_rate_keeps_the_server_full_for_several_waves_of_requests():
    args = serving.parse_args(["--max-concurrency", "8", "--load", "0.1", "0.5"])
    assert serving.point_sizes(args, available=164) == [48, 12, 12]
    assert serving.point_sizes(args, available=50) == [26, 12, 12]  # what the rates leave
    with pytest.raises(SystemExit, match="at least --max-concurrency"):
        serving.point_sizes(args, available=30)
    args = serving.parse_args(["--max-concurrency", "8", "--load", "0.1", "--saturation-prompts", "9"])
    assert serving.point_sizes(args, available=164) == [9, 12]


def test_both_modes_fit_the_smallest_workload_with_two_waves_at_the_unlimited_rate():  # MT-Bench: 80
    for mode in serving.MODES:
        args = serving.parse_args(["--mode", mode])
        sizes = serving.point_sizes(args, available=80)
        assert sum(sizes) <= 80 and sizes[0] >= 2 * args.max_concurrency


def test_dataset_lines_are_what_the_custom_dataset_reads(tmp_path):
    path = serving.write_jsonl(tmp_path / "w" / "a.jsonl", ["p1", "p\n2"], [64, 40])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"prompt": "p1", "output_tokens": 64},
        {"prompt": "p\n2", "output_tokens": 40},
    ]


def test_output_lengths_spread_around_the_limit_the_same_for_every_server():
    assert serving.output_lengths(5, 64, 0.0, "code-0") == [64] * 5
    spread = serving.output_lengths(400, 64, 0.5, "code-0")
    assert spread == serving.output_lengths(400, 64, 0.5, "code-0")  # every server sends the same
    assert spread != serving.output_lengths(400, 64, 0.5, "code-1")
    assert min(spread) == 32 and max(spread) == 96 and abs(np.mean(spread) - 64) < 3
    assert serving.parse_args([]).output_spread == 0.5  # answers of different lengths unless asked
    assert serving.parse_args(["--output-spread", "0", "--load"]).load == []  # the unlimited rate only
    with pytest.raises(SystemExit):
        serving.parse_args(["--output-spread", "1"])


def test_bench_command_sends_the_file_in_order_as_it_is(tmp_path):
    server = SimpleNamespace(url=lambda: "http://127.0.0.1:9", model="/m")
    command = serving.bench_command(
        server, "/m", tmp_path / "d.jsonl", LoadPoint("0.3C", 0.6), 12, tmp_path, "x.json", 0.0
    )
    flag = lambda name: command[command.index(name) + 1]  # noqa: E731
    assert command[1:3] == ["bench", "serve"]
    assert flag("--request-rate") == "0.6" and "--max-concurrency" not in command
    assert flag("--custom-output-len") == "-1"  # each line's output_tokens
    assert {"--skip-chat-template", "--disable-shuffle", "--no-oversample", "--save-result"} <= set(command)
    assert flag("--num-prompts") == "12" and flag("--result-filename") == "x.json"


def test_every_flag_of_the_bench_command_is_one_vllm_bench_serve_knows(tmp_path):
    server = SimpleNamespace(url=lambda: "http://127.0.0.1:9", model="/m")
    command = serving.bench_command(
        server, "/m", tmp_path / "d.jsonl", LoadPoint("max", math.inf, 16), 12, tmp_path, "x.json", 0.0
    )
    usage = subprocess.run([*command[:3], "--help=all"], capture_output=True, text=True, timeout=300).stdout
    unknown = [arg for arg in command[3:] if arg.startswith("--") and arg not in usage]
    assert usage and not unknown


def test_ratios_are_against_plain_of_the_same_round_with_their_range():
    point = LoadPoint("0.1C", 0.2)
    runs = [
        run("plain", point, 0, output_throughput=100, mean_tpot_ms=50, p99_tpot_ms=80, p99_ttft_ms=200),
        run("fast", point, 0, output_throughput=120, mean_tpot_ms=25, p99_tpot_ms=40, p99_ttft_ms=220),
        run("plain", point, 1, output_throughput=50, mean_tpot_ms=100, p99_tpot_ms=80, p99_ttft_ms=100),
        run("fast", point, 1, output_throughput=55, mean_tpot_ms=80, p99_tpot_ms=80, p99_ttft_ms=100),
    ]
    rows = {r["server"]: r for r in serving.summarize(runs)}
    assert rows["fast"]["throughput_x"] == "1.10-1.20"
    assert rows["fast"]["mean_tpot_x"] == "1.25-2.00"  # plain's TPOT over fast's: above 1 is faster
    assert rows["fast"]["p99_ttft_x"] == "1.00-1.10"  # a time ratio: above 1 is slower
    assert rows["fast"]["output_throughput"] == 87.5 and rows["fast"]["rounds"] == 2
    assert rows["plain"]["throughput_x"] == ""


def test_first_tokens_are_compared_request_by_request_with_the_same_prompts_on_plain():
    point = LoadPoint("0.1C", 0.2)
    lens = [100, 200, 300]
    runs = [
        run("plain", point, 0, slot=0, ttfts=[1.0, 2.0, 4.0], input_lens=lens),
        run("fast", point, 0, slot=1, ttfts=[0.5, 4.0, 2.4], input_lens=lens),
        run("plain", point, 0, slot=2, ttfts=[1.0, 2.0, 2.0], input_lens=lens),
        run("other", point, 0, slot=3, ttfts=[9.0, 9.0, 9.0], input_lens=[1, 2, 3]),
    ]
    rows = {r["server"]: r for r in serving.summarize(runs)}
    # Per request against the mean of the plain runs beside it, (1, 2, 3): 0.5, 2.0, 0.8; the
    # median. (Sorted TTFTs paired by rank would give 1.2, one plain run alone 0.6.)
    assert rows["fast"]["ttft_paired_x"] == "0.80"
    assert rows["plain"]["ttft_paired_x"] == "1.00-1.00"  # each plain run against the other, median
    assert rows["other"]["ttft_paired_x"] == ""  # other prompts: no pairs
    del runs[2].result["ttfts"]  # a baseline without them: no comparison, rather than one with half
    assert {r["server"]: r for r in serving.summarize(runs)}["fast"]["ttft_paired_x"] == ""


def test_each_requests_speed_is_compared_with_the_same_prompt_on_plain():
    """vLLM users time requests one by one: the low end of per-request speeds is reported beside
    the means (a request that pays for others' drafts shows there, not in the mean)."""
    point = LoadPoint("0.1C", 0.2)
    lens = list(range(10, 110, 10))  # ten prompts
    tpots_plain = [0.010] * 10
    tpots_fast = [0.005] * 8 + [0.020, 0.0125]  # most twice as fast, two slower than plain

    def detailed(tpots):  # what --save-detailed keeps: latencies, ttfts, output lengths
        return dict(latencies=[0.1 + 4 * t for t in tpots], ttfts=[0.1] * 10, output_lens=[5] * 10, input_lens=lens)

    runs = [
        run("plain", point, 0, slot=0, **detailed(tpots_plain)),
        run("fast", point, 0, slot=1, **detailed(tpots_fast)),
    ]
    row = {r["server"]: r for r in serving.summarize(runs)}["fast"]
    assert row["request_speed_min_x"] == "0.50"  # the slowest: 10 ms on plain, 20 ms here
    assert row["request_speed_p10_x"] == "0.80"  # the 10th percentile of ten: the second slowest
    runs[0].result["input_lens"] = lens[::-1]  # other prompts: no pairs
    assert {r["server"]: r for r in serving.summarize(runs)}["fast"]["request_speed_min_x"] == ""


def test_identical_outputs_are_counted_against_plain_among_served_requests():
    point = LoadPoint("max", math.inf, 4)
    runs = [
        run("plain", point, generated_texts=["a", "b", ""], errors=["", "", "timeout"]),
        run("other", point, generated_texts=["a", "c", ""], errors=["", "", ""]),
    ]
    serving.mark_identical(runs)
    assert runs[1].identical_to_plain == 1  # the failed request's empty text is no match
    assert {r["server"]: r["identical_to_plain"] for r in serving.summarize(runs)}["other"] == "1/2"


def test_runs_that_lost_requests_are_counted_but_not_compared():
    point = LoadPoint("0.1C", 0.2)
    runs = [
        run("plain", point, output_throughput=100, mean_tpot_ms=50),
        run("lossy", point, output_throughput=120, mean_tpot_ms=25, failed=1),
        run("broken", point),
    ]
    runs[2].result, runs[2].error = {}, "the server exited with 1"
    rows = {r["server"]: r for r in serving.summarize(runs)}
    assert rows["lossy"]["failed"] == 1 and rows["lossy"]["throughput_x"] == ""
    assert rows["broken"]["errors"] == 1 and rows["broken"]["throughput_x"] == ""


def test_each_core_setting_is_compared_with_plain_on_the_same_cores():
    point = LoadPoint("max", math.inf, 4)
    runs = [
        run("plain", point, output_throughput=150),
        run("plain", point, default_cores=True, output_throughput=100),
        run("fast", point, output_throughput=300),
        run("fast", point, default_cores=True, output_throughput=110),
    ]
    rows = {r["server"]: r["throughput_x"] for r in serving.summarize(runs)}
    assert rows == {"plain": "", "plain (default cores)": "0.67", "fast": "2.00", "fast (default cores)": "1.10"}
    # With vLLM's default cores only, plain's runs are compared with each other: the noise.
    alone = [run("plain", point, default_cores=True, output_throughput=t) for t in (100, 110)]
    rows = {r["server"]: r["throughput_x"] for r in serving.summarize(alone)}
    assert rows == {"plain (default cores)": "0.91-1.10"}


def test_the_unlimited_run_is_timed_out_by_the_floor_and_slow_rates_get_their_arrival_time():
    assert serving.run_timeout(LoadPoint("max", math.inf, 16), 12, floor=600) == 600
    assert serving.run_timeout(LoadPoint("0.1C", 0.01), 12, floor=600) == 3 * 1200 + 600


def test_plots_are_written_with_the_unlimited_rate_at_the_right(tmp_path):
    rows = [
        {
            "workload": "code",
            "server": s,
            "load": load,
            "rate_req_s": r,
            "output_throughput": t,
            "mean_tpot_ms": 10,
            "p99_tpot_ms": 20,
        }
        for s in ("plain", "x")
        for load, r, t in (("0.1C", 0.1, 5), ("0.3C", 0.3, 5), ("max", "inf", 50))
    ]
    serving.plot(rows, ["code"], tmp_path)
    assert (tmp_path / "throughput.png").stat().st_size > 0 and (tmp_path / "tpot.png").stat().st_size > 0


def test_server_set_ups_differ_only_in_speculation_and_cores():
    common = ["--dtype", "float32"]
    plain, ngram = Server("plain", None), Server("ngram", {"method": "ngram"}, default_cores=True)
    assert plain.args(common) == common and plain.env("0-1") == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert ngram.args(common) == [*common, "--speculative-config", '{"method": "ngram"}']
    assert ngram.env("0-1") == {"VLLM_CPU_OMP_THREADS_BIND": "auto"} and ngram.name == "ngram (default cores)"


def test_quick_mode_drops_draft_model_and_plain_runs_first():
    assert serving.parse_args([]).default_cores == [False]  # every core unless asked
    args = serving.parse_args(["--methods", "suffix", "draft_model", "plain", "--worker-cores", "all", "default"])
    assert (args.model, args.prompts_per_point, args.output_tokens) == ("smollm2-135m", 12, 64)
    assert args.methods == ["suffix", "plain"]
    assert serving.parse_args(["--workloads", "multiturn", "code"]).workloads == ["code", "multiturn"]
    args.draft_path = None
    assert [s.name for s in serving.servers(args)] == [
        "plain",
        "suffix",
        "plain (default cores)",
        "suffix (default cores)",
    ]


def test_self_admg_servers_report_what_their_proposer_spent_and_others_do_not():
    admg, ngram = Server("self-admg", {"method": "self-admg"}), Server("ngram", {"method": "ngram"})
    assert admg.args([]) == [
        "--speculative-config",
        '{"method": "self-admg"}',
        "--worker-extension-cls",
        serving.PROPOSER_REPORT,
    ]
    assert admg.env("0-1")["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_SERVER_DEV_MODE" not in ngram.env("0-1")
    assert serving.proposer_state(object(), ngram) is None
    before = dict.fromkeys(serving.PROPOSER_COUNTERS, 0) | {"probe_seconds": 1.0, "draft_tokens": 10}
    after = before | {
        "probe_seconds": 3.5,
        "draft_tokens": 40,
        "draft_seconds": 0.25,
        "propose_calls": 200,
        "propose_seconds": 0.5,
        "propose_cpu_seconds": 0.25,
    }
    after["part_seconds"] = {"look_up": 0.2, "plan": 0.1}
    assert serving.spent(before, after) == dict.fromkeys(serving.PROPOSER_COUNTERS, 0) | {
        "probe_seconds": 2.5,
        "draft_tokens": 30,
        "draft_seconds": 0.25,
        "propose_calls": 200,
        "propose_seconds": 0.5,
        "propose_cpu_seconds": 0.25,
        # (a part the server does not count is unknown, not 0)
        "part_seconds": dict.fromkeys(PROPOSER_PARTS) | {"look_up": 0.2, "plan": 0.1},
    }
    assert serving.spent(None, after) is None
    point = LoadPoint("max", math.inf, 4)
    runs = [run("plain", point), run("self-admg", point), run("self-admg", point, round_=1)]
    runs[1].proposer, runs[2].proposer = serving.spent(before, after), None
    rows = {r["server"]: r for r in serving.summarize(runs)}
    assert rows["self-admg"]["probe_s"] == 2.5 and rows["plain"]["probe_s"] is None
    assert rows["self-admg"]["propose_ms_per_step"] == 2.5  # 0.5 s over 200 steps
    assert rows["self-admg"]["propose_cpu_ms_per_step"] == 1.25  # of which the thread had a core for 0.25 s
    assert rows["self-admg"]["propose_ms_look_up"] == 1.0 and rows["self-admg"]["propose_ms_learn"] is None
    # A folder from before the proposer counted its own time reads as not counted.
    runs[1].proposer = {"probe_seconds": 1.0, "draft_seconds": 0.0, "draft_tokens": 0}
    rows = {r["server"]: r for r in serving.summarize(runs)}
    assert rows["self-admg"]["probe_s"] == 1.0 and rows["self-admg"]["propose_ms_per_step"] is None
    assert rows["self-admg"]["propose_cpu_ms_per_step"] is None
    # ... and one from before it counted its thread's CPU time, as not counted for that column only.
    runs[1].proposer = {"propose_calls": 200, "propose_seconds": 0.5}
    rows = {r["server"]: r for r in serving.summarize(runs)}
    assert rows["self-admg"]["propose_ms_per_step"] == 2.5 and rows["self-admg"]["propose_cpu_ms_per_step"] is None


def test_the_step_fit_replay_predicts_linear_steps_and_reports_each_kind(tmp_path, capsys):
    from benchmarks.diagnostics import step_fit

    rng = np.random.default_rng(0)
    steps = []
    for _ in range(200):  # 40 ms + 2 ms a logit row + 5 ms to verify + 1 ms a thousand context tokens read, +-2%
        rows, drafts = int(rng.integers(1, 17)), int(rng.choice([0, 0, 8, 30]))
        prompt = int(rng.choice([0] * 9 + [300]))
        context_read = (rows + drafts) * int(rng.integers(100, 3000))
        seconds = 0.040 + 0.002 * (rows + drafts) + 0.005 * (drafts > 0) + 0.001 * prompt + 1e-6 * context_read
        steps.append([prompt, rows + drafts, 0, drafts, seconds * rng.uniform(0.98, 1.02), context_read])
    rows, model = step_fit.replay(steps)
    late = rows[100:]
    assert np.all(np.abs(late[:, 5] / late[:, 4] - 1) < 0.15)
    assert model.target().t_row == pytest.approx(0.002, rel=0.2)
    assert model.target().t_context == pytest.approx(0.001, rel=0.2)  # (the context read, priced)
    # A log of five fields a step (before the context read was logged) replays with none read.
    assert np.array_equal(step_fit.replay([s[:5] for s in steps])[0][:, :5], rows[:, :5])
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(steps))
    step_fit.main([str(path)])
    printed = capsys.readouterr().out
    assert all(label in printed for label, *_ in step_fit.KINDS) and "final fit, ms: t0" in printed
    # What the drafts in prefill steps cost those steps: 2 ms a draft token plus 5 ms to verify.
    prompt = np.array([s for s in steps if s[0] > 0])
    drafts = prompt[:, 3]
    expected = (0.002 * drafts + 0.005 * (drafts > 0)).sum()
    draft_seconds, prompt_seconds = step_fit.draft_share_of_prompt_steps(rows, model)
    assert draft_seconds == pytest.approx(expected, rel=0.25) and prompt_seconds == pytest.approx(prompt[:, 4].sum())
    assert "drafts verified in steps with prompt tokens" in printed


def test_with_plain_between_every_method_has_plain_beside_it_and_rounds_reverse():
    plain, a, b = Server("plain", None), Server("a", {"method": "a"}), Server("b", {"method": "b"})
    names = lambda order: [s.name for s in order]  # noqa: E731
    assert names(serving.round_order([plain, a, b], 0, False)) == ["plain", "a", "b"]
    assert names(serving.round_order([plain, a, b], 1, False)) == ["plain", "b", "a"]
    assert names(serving.round_order([plain, a, b], 0, True)) == ["plain", "a", "plain", "b", "plain"]
    assert names(serving.round_order([plain, a, b], 1, True)) == ["plain", "b", "plain", "a", "plain"]
    slow_plain, slow_a = Server("plain", None, True), Server("a", {"method": "a"}, True)
    assert names(serving.round_order([plain, a, slow_plain, slow_a], 0, True)) == [
        "plain",
        "a",
        "plain",
        "plain (default cores)",
        "a (default cores)",
        "plain (default cores)",
    ]
    assert names(serving.round_order([plain], 0, True)) == ["plain"]


def test_a_method_is_compared_with_the_mean_of_the_plain_runs_beside_it():
    point = LoadPoint("max", math.inf, 4)
    runs = [
        run("plain", point, output_throughput=100),
        run("a", point, output_throughput=120),
        run("plain", point, output_throughput=140),
        run("b", point, output_throughput=70),
        run("plain", point, output_throughput=60),
    ]
    for slot, r in enumerate(runs):
        r.slot = slot
    rows = {r["server"]: r["throughput_x"] for r in serving.summarize(runs)}
    assert rows["a"] == "1.00" and rows["b"] == "0.70"  # 120 / mean(100, 140); 70 / mean(140, 60)
    # Plain against its own other runs is the noise: 60 / mean(100, 140) to 140 / mean(100, 60).
    assert rows["plain"] == "0.50-1.75"
    assert serving.parse_args([]).plain_between and not serving.parse_args(["--no-plain-between"]).plain_between


def test_a_results_folder_can_be_summarized_again_from_what_it_saved(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    saved = {"request_rate": 0.5, "max_concurrency": None, "completed": 2, "failed": 0, "output_throughput": 10.0}
    (raw / "r0-0-plain-chat-0.3C.json").write_text(json.dumps(saved))
    (raw / "r0-0-plain-chat-max.json").write_text(json.dumps({**saved, "request_rate": "inf", "max_concurrency": 4}))
    (raw / "r0-1-self-admg_(default_cores)-chat-0.3C.json").write_text(json.dumps(saved))
    (raw / "r0-1-self-admg_(default_cores)-chat-0.3C-proposer.json").write_text(json.dumps({"probe_seconds": 1.5}))
    (raw / "r0-1-self-admg_(default_cores)-chat-0.3C-steps.json").write_text("[]")
    (raw / "r1-2-suffix-chat-0.3C-error.txt").write_text("TimeoutExpired: too slow")
    (raw / "r1-multiturn-note.txt").write_text("not a run")
    runs = {(r.round, r.slot, r.server.name, r.point.label): r for r in serving.runs_from_folder(tmp_path)}
    assert set(runs) == {
        (0, 0, "plain", "0.3C"),
        (0, 0, "plain", "max"),
        (0, 1, "self-admg (default cores)", "0.3C"),
        (1, 2, "suffix", "0.3C"),
    }
    admg = runs[0, 1, "self-admg (default cores)", "0.3C"]
    assert admg.server.reports_proposer and admg.server.default_cores and admg.proposer == {"probe_seconds": 1.5}
    assert admg.workload == "chat" and admg.point.rate == 0.5 and admg.clean
    assert runs[0, 0, "plain", "max"].point == LoadPoint("max", math.inf, 4)
    failed = runs[1, 2, "suffix", "0.3C"]  # no result of its own: its load point's rate, its error
    assert failed.error == "TimeoutExpired: too slow" and failed.point.rate == 0.5 and not failed.clean
    # What a run saves beside vLLM's JSON is what the folder is read back from.
    again = Run(
        0,
        Server("self-admg", {"method": "self-admg"}),
        "chat",
        LoadPoint("0.3C", 0.5),
        {},
        error="server exited",
        proposer={"probe_seconds": 2.0},
    )
    again.engine = {
        "prefix_cache_queries": 400.0,
        "prefix_cache_hits": 100.0,
        "requests": 2.0,
        "first_token_s": 1.0,
        "queue_s": 0.2,
        "prefill_s": 0.6,
        "proposer_s": 0.3,
    }
    serving.save_run_notes(again, raw, "r2-0-self-admg-chat-0.3C")
    back = next(r for r in serving.runs_from_folder(tmp_path) if r.round == 2)
    assert (back.error, back.proposer, back.server.method) == ("server exited", {"probe_seconds": 2.0}, "self-admg")
    assert back.engine == again.engine
    row = serving.summarize([back])[0]
    assert (row["prefix_cache_hit_rate"], row["queue_ms"], row["prefill_ms"], row["front_end_ms"]) == (
        0.25,
        100.0,
        300.0,
        100.0,
    )
    again.result = {"duration": 60.0}  # (vLLM's own JSON, which a failed run has none of)
    assert serving.summarize([again])[0]["proposer_pct_of_run"] == 0.5  # 0.3 s of a 60 s run, from /metrics


def _served_answers():
    """A prompt, an answer that quotes it and an answer of tokens never seen before."""
    rng = np.random.default_rng(0)
    quoted = rng.integers(100, 200, size=30)
    prompt = np.concatenate([rng.integers(1000, 2000, size=40), quoted, rng.integers(1000, 2000, size=10)])
    copying = np.concatenate([rng.integers(3000, 4000, size=3), quoted])
    fresh = rng.permutation(np.arange(5000, 5033))
    return prompt, copying, fresh


def _assert_replay_counts(rule):
    from benchmarks.diagnostics import lookup_replay

    prompt, copying, fresh = _served_answers()
    copied, new = lookup_replay.Counts(), lookup_replay.Counts()
    lookup_replay.serve(rule, prompt, copying, copied)
    lookup_replay.serve(rule, prompt[:5], fresh, new)
    # The quote is drafted: far fewer steps than tokens, every step advancing one token
    # plus what it accepted. Nothing seen before: nothing drafted.
    assert copied.accepted >= 20 and copied.steps <= 12
    assert copied.steps + copied.accepted >= len(copying) - 1 and copied.accepted <= copied.draft_tokens
    assert (new.accepted, new.steps) == (0, len(fresh) - 1)


def test_the_lookup_replay_counts_what_self_admg_accepts_on_served_answers():
    from benchmarks.diagnostics import lookup_replay

    _assert_replay_counts(lookup_replay.SelfAdmgLookup(k=4))


def test_the_lookup_replay_counts_what_suffix_accepts_on_served_answers():
    # vLLM's suffix method lives in arctic-inference, which only the bench extra installs
    # (it builds from source); the test suite does not need it.
    pytest.importorskip("arctic_inference", reason="the bench extra (arctic-inference) is not installed")
    from benchmarks.diagnostics import lookup_replay

    _assert_replay_counts(lookup_replay.SuffixMethodLookup(k=4))


def test_a_runs_steps_are_the_last_the_server_timed_during_it():
    kept = [[n] for n in range(10)]  # the server's last steps, oldest first
    assert serving.run_steps(kept, 3) == [[7], [8], [9]]
    assert serving.run_steps(kept, 0) == []
    assert serving.run_steps(kept, 25) == kept  # a run longer than the server keeps: all it has


def test_first_token_wait_splits_at_the_end_of_the_step_in_progress():
    from benchmarks.diagnostics import first_token_wait

    # Request 0 finds the engine idle and streams at the ends of steps at 0.1, 0.2, 0.3 and 0.4 s;
    # request 1 arrives at 0.25 s, waits 50 ms for the step in progress, then 100 ms in its own.
    result = {"start_times": [0.0, 0.25], "ttfts": [0.1, 0.15], "itls": [[0.1, 0.1, 0.1], []]}
    assert first_token_wait.step_ends(result) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    found = first_token_wait.first_token_wait(result)
    assert found.steps == 4 and found.step_ms == pytest.approx(100.0)
    assert found.in_progress_ms == pytest.approx(25.0) and found.own_step_ms == pytest.approx(100.0)
    assert found.ttft_ms == pytest.approx(found.in_progress_ms + found.own_step_ms)


def test_the_step_split_reads_step_times_from_the_requests_served_alone():
    from benchmarks.diagnostics import step_split

    # Requests 0 and 1 overlap; 2 runs alone and streams 3 chunks of 2 tokens, 20 ms apart.
    result = {
        "start_times": [0.0, 0.5, 5.0],
        "latencies": [1.0, 1.0, 0.1],
        "itls": [[0.05] * 9, [0.07] * 9, [0.02, 0.02]],
        "output_lens": [10, 10, 6],
    }
    assert step_split.alone(result["start_times"], result["latencies"]) == [2]
    found = step_split.split(result)
    assert (found.requests_alone, found.requests) == (1, 3)
    assert found.step_ms == pytest.approx(20.0) and found.tokens_per_step == pytest.approx(2.0)
    assert step_split.split({**result, "start_times": [0.0, 0.5, 0.6]}) is None  # all overlap


def test_prefill_steps_reads_vllms_step_log_and_matches_like_steps(tmp_path):
    from benchmarks.diagnostics import prefill_steps

    # Lines as vLLM 0.32 logs them with --enable-logging-iteration-details.
    line = (
        "(APIServer pid=1) INFO 11-26 07:21:00 [loggers.py:199] Engine 000: Iteration({}): {} context requests, "
        "{} context tokens, {} generation requests, {} generation tokens, iteration elapsed time: {} ms, "
        "CPU KV cache usage: 4.5%"
    )
    log = tmp_path / "server-r0-1-self-admg.log"
    log.write_text(
        "\n".join([line.format(7, 15, 1521, 1, 1, "923.40"), line.format(8, 1, 88, 15, 15, "90.36"), "other"])
    )
    steps = prefill_steps.prefill_steps(log, min_tokens=400)
    assert steps == [prefill_steps.Step(prompts=15, prompt_tokens=1521, decoding=1, ms=923.4)]
    wave = steps[0]
    plain = [
        [prefill_steps.Step(15, 1259, 1, 739.0), prefill_steps.Step(15, 1521, 1, 962.0)],
        [prefill_steps.Step(15, 1756, 1, 1104.0)],  # 15% more tokens: not the same step
        [prefill_steps.Step(1, 1521, 14, 900.0)],  # one prompt: another phase
    ]
    assert prefill_steps.like(wave, plain) == [plain[0][1]]


def test_request_losses_split_a_slower_requests_time_into_prefill_steps_and_the_rest(tmp_path, capsys):
    from benchmarks.diagnostics import request_losses

    def result(gaps: list[list[float]]) -> dict:
        return {
            "itls": gaps,
            "ttfts": [0.0] * len(gaps),
            "latencies": [sum(g) for g in gaps],
            "output_lens": [len(g) + 1 for g in gaps],
            "input_lens": [100] * len(gaps),
            "completed": len(gaps),
            "failed": 0,
            "request_rate": "inf",
        }

    # Plain: 10 ms gaps. The method: request 0 meets a 500 ms prefill step, request 1's steps
    # are each 2 ms slower (its neighbours' drafts), request 2 is faster, request 3 failed.
    plain = result([[0.01] * 10, [0.01] * 10, [0.01] * 10, [0.01] * 10])
    method = result([[0.01] * 9 + [0.5], [0.012] * 10, [0.005] * 10, []])
    rows = {row["request"]: row for row in request_losses.losses(method, plain, prefill_gap=4)}
    assert rows[0]["lost_in_prefill_steps_s"] == pytest.approx(0.5) and rows[0][
        "lost_in_other_steps_s"
    ] == pytest.approx(-0.01)
    assert rows[1]["lost_in_prefill_steps_s"] == 0 and rows[1]["lost_in_other_steps_s"] == pytest.approx(0.02)
    assert [row["request"] for row in request_losses.losses(method, plain, 4)] == [0, 1, 2]  # slowest first
    # A folder: each run against the round's other plain runs, plain against plain too.
    (tmp_path / "raw").mkdir()
    for name, data in (("r0-0-plain-repeated+chat-max", plain), ("r0-1-self-admg-repeated+chat-max", method)):
        (tmp_path / "raw" / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "raw" / "r0-1-self-admg-repeated+chat-max-steps.json").write_text("[]")
    request_losses.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "round 0 self-admg (slot 1) against plain (slot 0), repeated+chat max: 2/3 requests slower" in out
    assert "round 0 plain (slot 0) against plain" not in out  # no other plain run in the round
    assert "0.50 s in steps with a prefill, 0.01 s in the others" in out


def test_verdicts_say_faster_or_slower_only_beyond_plains_own_spread():
    from benchmarks.serving import verdicts

    rows = [
        {
            "workload": "code",
            "load": "max",
            "server": "plain",
            "throughput_x": "0.97-1.03",
            "mean_tpot_x": "0.98-1.02",
            "p99_ttft_x": "0.95-1.05",
        },
        {
            "workload": "code",
            "load": "max",
            "server": "self-admg",
            "throughput_x": "1.05-1.10",
            "mean_tpot_x": "0.99-1.01",
            "p99_ttft_x": "1.10-1.20",
        },
    ]
    (line,) = verdicts(rows)
    assert "throughput 1.05-1.10 (faster" in line and "mean TPOT 0.99-1.01 (level" in line
    assert "p99 first token 1.10-1.20 (slower" in line  # a time: above 1 is later
    rows[1]["throughput_x"] = "1.00-1.10"  # one round inside plain's spread: level
    assert "throughput 1.00-1.10 (level" in verdicts(rows)[0]


def test_decide_runs_plain_against_self_admg_in_rounds_on_your_prompts(tmp_path):
    from benchmarks.serving import first_prompts, parse_args

    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "def f(x):"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    args = parse_args(["--decide", "--prompts-file", str(mine)])
    assert (args.methods, args.rounds, args.load, args.workloads) == (["self-admg"], 3, [0.1, 1.5], ["own"])
    assert parse_args(["--decide", "--rounds", "5", "--load", "0.3"]).rounds == 5

    class Template:
        chat_template = "user: {{ content }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "user: " + messages[0]["content"]

    assert first_prompts("own", Template(), mine) == ["def f(x):", "user: hi"]
    with pytest.raises(SystemExit, match='line 2: "messages" needs a chat template'):
        first_prompts("own", SimpleNamespace(chat_template=None), mine)
    mine.write_text('{"prompt": "ok"}\n\n{"text": "no"}\n')
    with pytest.raises(SystemExit, match='line 3: needs "prompt"'):
        first_prompts("own", Template(), mine)
    args = parse_args(["--decide", "--model", "/models/mine", "--prompts-file", str(mine)])
    assert (args.model, args.draft, args.methods) == ("/models/mine", None, ["self-admg"])


def test_the_model_is_checked_and_its_length_capped_before_any_server_starts(tmp_path, tiny_model_path):
    from benchmarks.serving import load_model_facts

    tokenizer, max_model_len = load_model_facts(str(tiny_model_path), 100_000)
    assert tokenizer is not None and max_model_len < 100_000
    with pytest.raises(SystemExit, match="--model .*nowhere: cannot load"):
        load_model_facts(str(tmp_path / "nowhere"), 4096)


def test_mixed_workloads_take_two_workloads_prompts_in_turn_and_name_their_runs(tmp_path, monkeypatch):
    from benchmarks import assets
    from benchmarks.serving import RAW_NAME, REPEATED_WORDS, first_prompts, parse_args

    monkeypatch.setattr(assets, "load_prompts", lambda name: [f"{name}{i}" for i in range(3)])

    class Template:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "user: " + messages[0]["content"]

    assert first_prompts("code+chat", Template()) == [
        "humaneval0", "user: ifbench0", "humaneval1", "user: ifbench1", "humaneval2", "user: ifbench2"
    ]  # fmt: skip
    repeated = first_prompts("repeated+chat", Template())[::2]
    assert len(set(repeated)) == 3 and all(len(set(p.split())) == 1 for p in repeated)
    assert min(len(p.split()) for p in repeated) == REPEATED_WORDS
    assert parse_args([]).workloads == ["code", "summarization", "chat", "multiturn"]  # mixed only when named
    groups = RAW_NAME.match("r1-2-self-admg-repeated+chat-0.3C").groups()
    assert groups == ("1", "2", "self-admg", "repeated+chat", "0.3C")
