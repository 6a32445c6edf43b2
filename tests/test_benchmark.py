# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The benchmark harness: its quick path on the tiny model writes the table with every column,
and its lossless check passes for exact methods and flags a mismatch loudly."""

import json
from pathlib import Path

import pytest

import benchmarks.run as bench
from benchmarks import serve_load, serving
from benchmarks.output import results_root
from vllm_selfspec.options import DEFAULT_NUM_SPECULATIVE_TOKENS


def test_lossless_check_flags_mismatches():
    plain = bench.Cell("plain", "w", 1, 0.0, 6, 1.0, 3, {}, [], token_ids=[[1, 2, 3], [4, 5, 6]])
    same = bench.Cell("m", "w", 1, 0.0, 6, 1.0, 3, {}, [], token_ids=[[1, 2, 3], [4, 5, 6]])
    other = bench.Cell("m", "w", 1, 0.0, 6, 1.0, 3, {}, [], token_ids=[[1, 2, 3], [4, 9, 6]])
    sampled = bench.Cell("m", "w", 1, 1.0, 6, 1.0, 3, {}, [], token_ids=[[7, 7, 7], [7, 7, 7]])
    assert bench.lossless_check(same, plain) == "ok"
    assert bench.lossless_check(other, plain) == "**MISMATCH 1/2** (prompt@token: #1@1)"
    assert bench.lossless_check(sampled, plain) == "n/a"


def test_repeats_pool_into_one_cell_per_method_and_cell():
    def cell(method, tokens, seconds, drafts, round, ids):
        return bench.Cell(
            method, "w", 1, 0.0, tokens, seconds, 3, {"num_drafts": drafts}, [0.1], token_ids=[ids], round=round
        )

    cells = [
        cell("plain", 30, 10.0, 0, 0, [1, 2]),
        cell("m", 30, 5.0, 4, 0, [1, 2]),
        cell("m", 30, 7.0, 6, 1, [3, 4]),
        cell("plain", 30, 10.5, 0, 1, [3, 5]),
    ]
    merged = {c.method: c for c in bench.merge_repeats(cells)}
    assert (merged["m"].output_tokens, merged["m"].seconds, merged["m"].counters) == (60, 12.0, {"num_drafts": 10})
    assert merged["m"].token_ids == [[1, 2], [3, 4]]
    rows = {r["method"]: r for r in bench.summarize(cells)}
    assert rows["m"]["speedup"] == pytest.approx((60 / 12.0) / (60 / 20.5), abs=1e-3)
    assert rows["m"]["speedup_range"] == "1.50-2.00"  # each round against plain's run of that round
    assert rows["m"]["lossless"].startswith("**MISMATCH 1/2**")  # the second round is checked too
    head_to_head = {r["method"]: r for r in bench.summarize(cells, baseline="m")}
    assert head_to_head["plain"]["speedup"] == pytest.approx((60 / 20.5) / (60 / 12.0), abs=1e-3)
    assert head_to_head["plain"]["speedup_range"] == "0.50-0.67" and head_to_head["m"]["speedup_range"] is None
    assert len(cells) == 4 and cells[1].seconds == 5.0  # the raw cells are left as they were


def test_methods_are_chosen_by_name_with_an_optional_draft_length():
    known = bench.method_configs(None)
    chosen = bench.choose_methods(known, "plain", ["suffix@3", "self-admg"])
    assert list(chosen) == ["plain", "suffix@3", "self-admg"]
    assert chosen["suffix@3"] == {**known["suffix"], "num_speculative_tokens": 3}
    assert chosen["self-admg"] == known["self-admg"] and known["suffix"]["num_speculative_tokens"] == bench.K
    # (a method named plainly runs what ships: self-admg's default draft length, for every method)
    assert bench.K == DEFAULT_NUM_SPECULATIVE_TOKENS == known["self-admg"]["num_speculative_tokens"]
    assert list(bench.choose_methods(known, "suffix", None))[0] == "suffix"  # all, baseline first
    for bad in ("eagle", "suffix@0", "suffix@x", "plain@4"):
        with pytest.raises(SystemExit, match="suffix@8"):
            bench.choose_methods(known, "plain", [bad])


def test_runs_write_to_the_cache_outside_the_repository_unless_told_where(monkeypatch, tmp_path):
    repository = Path(bench.__file__).resolve().parents[1]
    monkeypatch.setenv("VLLM_SELFSPEC_CACHE", str(tmp_path / "cache"))
    defaults = {
        "run": bench.parse_args(["--mode", "quick"]).out,
        "serving": serving.parse_args([]).out,
        "serve_load": serve_load.parse_args([]).out,
    }
    for script, out in defaults.items():
        assert out.parent == results_root() == (tmp_path / "cache" / "results").resolve(), script
        assert not out.is_relative_to(repository), script
    assert defaults["run"].name.startswith("run-quick-") and defaults["serving"].name.startswith("serving-quick-")
    monkeypatch.delenv("VLLM_SELFSPEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert results_root() == (tmp_path / "home" / ".cache" / "vllm-selfspec" / "results").resolve()
    assert bench.parse_args(["--out", str(tmp_path / "here")]).out == tmp_path / "here"  # --out chooses
    assert serving.parse_args(["--out", str(tmp_path / "here")]).out == tmp_path / "here"


@pytest.fixture(scope="module")
def quick_run(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench.main(
        [
            "--model",
            str(tiny_model_path),
            "--dtype",
            "float32",
            "--methods",
            "ngram",
            "self-admg",
            "--workloads",
            "humaneval",
            "--batch-sizes",
            "1",
            "2",
            "--temperatures",
            "0",
            "1",
            "--prompts",
            "2",
            "--max-tokens",
            "8",
            "--interleave",
            "--repeat",
            "2",
            "--enforce-eager",
            "--kv-cache-gb",
            "1",
            "--max-model-len",
            "1024",
            "--no-ablations",
            "--out",
            str(out),
        ]
    )
    return out


@pytest.mark.engine
def test_quick_run_writes_every_column_and_checks_losslessness(quick_run):
    for name in ("environment.json", "results.json", "results.csv", "table.md", "speedup.png"):
        assert (quick_run / name).exists(), name
    table = (quick_run / "table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")] == bench.COLUMNS
    rows = json.loads((quick_run / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"plain", "ngram", "self-admg"}
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        assert r["lossless"] == ("ok" if r["temperature"] == 0 else "n/a"), r
        assert r["tokens_per_s"] > 0 and r["speedup"] is not None
        assert (r["speedup_range"] is not None) == (r["method"] != "plain"), r  # two rounds each
    rounds = [
        (c["method"], c["batch"], c["temperature"], c["round"])
        for c in json.loads((quick_run / "results.json").read_text())["cells"]
    ]
    assert sorted(rounds) == sorted(
        (m, b, t, r) for m in ("plain", "ngram", "self-admg") for b in (1, 2) for t in (0.0, 1.0) for r in (0, 1)
    )
    # Self-admg's own columns, wherever its cell did what they measure (whether the controller
    # self-drafts in a given cell depends on timing, so each cell is checked against its counts).
    cells = {}
    for c in json.loads((quick_run / "results.json").read_text())["cells"]:
        if c["method"] == "self-admg":
            cells.setdefault((c["workload"], c["batch"], c["temperature"]), []).append(c)
    admg = [r for r in rows if r["method"] == "self-admg"]
    assert len(admg) == len(cells) == 4
    for r in admg:
        rounds = cells[r["workload"], r["batch"], r["temperature"]]
        assert (r["skipped_mean"] is not None) == any(c["skipped"] for c in rounds), r
        assert (r["draft_cost_ratio"] is not None) == any(c["draft_steps"] > 0 for c in rounds), r
        assert (r["lookup_share"] is not None) == any(c["counters"].get("num_draft_tokens", 0) > 0 for c in rounds), r
    env = json.loads((quick_run / "environment.json").read_text())
    assert env["vllm"].startswith("0.32.0") and env["cpus"]


@pytest.mark.engine
def test_sequential_run_restarts_engines_per_method(tiny_model_path, tmp_path):
    bench.main(
        [
            "--model",
            str(tiny_model_path),
            "--dtype",
            "float32",
            "--methods",
            "self-admg",
            "--workloads",
            "humaneval",
            "--cells",
            "1:0",
            "--prompts",
            "1",
            "--max-tokens",
            "6",
            "--enforce-eager",
            "--kv-cache-gb",
            "1",
            "--max-model-len",
            "1024",
            "--no-ablations",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["method"], r["lossless"], r["speedup_range"]) for r in rows] == [
        ("plain", "ok", None),
        ("self-admg", "ok", None),
    ]
