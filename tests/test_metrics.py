# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Self-admg's counters on /metrics (`vllm_selfspec.operations.metrics`), without an engine: one series per
engine and rank, the newest file of each, files that are not snapshots skipped and counted, a
page that never fails for self-admg's sake, and a server that starts without the series when they
cannot be served."""

import json
import logging
import os
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_selfspec.operations import metrics
from vllm_selfspec.operations.counters import ProposerCounters
from vllm_selfspec.operations.metrics import (
    METRICS,
    METRICS_DIR_ENV,
    PREFIX,
    MetricsPublisher,
    SelfAdmgCollector,
    metrics_snapshot,
)

UNREADABLE = "vllm:self_admg_snapshots_unreadable_total"


@pytest.fixture
def logged(caplog, monkeypatch):
    """caplog, with vllm.selfspec's records at every level: vLLM's logging set-up (done once an
    engine ran in this test process) stops its loggers' records short of the root, where caplog listens."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="vllm.selfspec")
    return caplog


def levels(logged) -> list[int]:
    return [r.levelno for r in logged.records if r.name == "vllm.selfspec"]


def fake_proposer(seed: int) -> SimpleNamespace:
    """What `metrics_snapshot` reads of a proposer, every count distinct and derived from `seed`."""
    counters = ProposerCounters(
        draft_tokens=100 + seed,
        context_tokens=200 + seed,
        history_tokens=300 + seed,
        lookup_accepted=400 + seed,
        draft_tokens_withheld=500 + seed,
        prompts_measured=600 + seed,
        probe_seconds=0.25 + seed,
        propose_calls=700 + seed,
        propose_seconds=1.5 + seed,
    )
    fail_safe = SimpleNamespace(faults=seed + 1, disabled=bool(seed % 2), steps_skipped=seed + 2)
    masks = {f"request-{i}": None for i in range(seed + 3)}
    return SimpleNamespace(
        counters=counters,
        fail_safe=fail_safe,
        self_drafter=SimpleNamespace(masks=masks),
        scheduler_faults=seed + 4,
        lookup=SimpleNamespace(quarantine=SimpleNamespace(requests={f"request-{i}" for i in range(seed + 5)})),
    )


def publish(directory, engine: int, rank: int, seed: int) -> MetricsPublisher:
    publisher = MetricsPublisher(str(directory), rank=rank, engine=engine)
    publisher.publish(lambda: metrics_snapshot(fake_proposer(seed)))
    return publisher


def expected_samples(engine: int, rank: int, seed: int) -> dict:
    """{(sample name, labels): value} a worker publishing `fake_proposer(seed)` should show."""
    labels = {"engine": str(engine), "rank": str(rank)}
    expected = {}
    for name, value in metrics_snapshot(fake_proposer(seed)).items():
        sample = PREFIX + name + ("_total" if METRICS[name][0] == "counter" else "")
        for source, count in value.items() if isinstance(value, dict) else [(None, value)]:
            key = {**labels, "source": source} if source else labels
            expected[(sample, tuple(sorted(key.items())))] = float(count)
    return expected


def serving(directory) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SelfAdmgCollector(str(directory)))
    return registry


def page(registry: CollectorRegistry) -> list:
    """The samples of a scrape, as Prometheus parses the page: [(name, labels, value)]."""
    text = generate_latest(registry).decode()
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def by_label_set(samples: list) -> dict:
    keys = [(name, labels) for name, labels, _ in samples]
    assert len(keys) == len(set(keys)), "two samples with one label set: Prometheus drops one"
    return {(name, labels): value for name, labels, value in samples}


def self_admg(samples: dict, engine: int, rank: int) -> dict:
    """The samples of one (engine, rank), the unreadable-snapshot counter aside."""
    wanted = {("engine", str(engine)), ("rank", str(rank))}
    return {key: value for key, value in samples.items() if wanted <= set(key[1])}


def test_two_engines_of_one_rank_each_have_their_series(tmp_path):
    # `--data-parallel-size 2`: two engines, each with a tensor-parallel rank 0, in one directory.
    first, second = publish(tmp_path, engine=0, rank=0, seed=1), publish(tmp_path, engine=1, rank=0, seed=2)
    assert first.path != second.path

    samples = by_label_set(page(serving(tmp_path)))

    for engine, seed in ((0, 1), (1, 2)):
        assert self_admg(samples, engine, 0) == expected_samples(engine, 0, seed)
    faults = ("vllm:self_admg_faults_total", (("engine", "1"), ("rank", "0")))
    assert samples[faults] == 3.0  # seed 2's faults, by name, as an operator's query reads it
    history = ("vllm:self_admg_draft_tokens_total", (("engine", "0"), ("rank", "0"), ("source", "history")))
    assert samples[history] == 301.0
    assert samples[(UNREADABLE, ())] == 0.0


def test_a_dead_worker_file_gives_way_to_the_live_one(tmp_path):
    live = publish(tmp_path, engine=0, rank=0, seed=1)
    an_hour_ago = live.path.stat().st_mtime - 3600
    # A restarted worker's predecessor left its file; pids sort before and after the live one's.
    for pid in (1, 99999999):
        stale = tmp_path / f"engine0-rank0-{pid}.json"
        stale.write_text(json.dumps({"engine": 0, "rank": 0, **metrics_snapshot(fake_proposer(7))}))
        os.utime(stale, (an_hour_ago, an_hour_ago))

    samples = by_label_set(page(serving(tmp_path)))

    assert self_admg(samples, 0, 0) == expected_samples(0, 0, seed=1)
    assert samples[(UNREADABLE, ())] == 0.0  # an old file is a snapshot, not an unreadable one


BROKEN = {
    "engine0-rank1-1.json": "[]",
    "engine0-rank2-1.json": "3",
    "engine0-rank3-1.json": '"x"',
    "engine0-rank4-1.json": json.dumps({"faults": "x"}),
    "engine0-rank5-1.json": json.dumps({"engine": 0, "rank": 5, "faults": "x"}),
    "engine0-rank6-1.json": json.dumps({"engine": 0, "rank": 6, "draft_tokens": {"self": "x"}}),
    "engine0-rank7-1.json": json.dumps({"engine": 0, "rank": 7, "draft_tokens": 3}),
    "engine0-rank8-1.json": json.dumps({"engine": "zero", "rank": 8, "faults": 1}),
    "engine0-rank9-1.json": '{"engine": 0, "rank": 9, "faults": ' + "9" * 400 + "}",  # too large for a float
    "engine1-rank0-1.json": '{"engine": 1, "rank": 0, "fau',  # truncated
}


def test_files_that_are_not_snapshots_are_skipped_and_counted(tmp_path):
    publish(tmp_path, engine=0, rank=0, seed=1)
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    registry = serving(tmp_path)

    samples = by_label_set(page(registry))

    assert self_admg(samples, 0, 0) == expected_samples(0, 0, seed=1)
    assert {key[1] for key in samples} == {(), (("engine", "0"), ("rank", "0"))} | {
        (("engine", "0"), ("rank", "0"), ("source", source)) for source in ("self", "context", "history", "prediction")
    }
    assert samples[(UNREADABLE, ())] == len(BROKEN)
    assert by_label_set(page(registry))[(UNREADABLE, ())] == 2 * len(BROKEN)  # a counter: each scrape adds


def test_the_page_is_served_whatever_the_directory_holds(tmp_path, monkeypatch, logged):
    publish(tmp_path, engine=0, rank=0, seed=1)
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    registry = CollectorRegistry()
    Counter("vllm:num_preemptions", "vLLM's own series, on the same page", registry=registry).inc(4)
    collector = SelfAdmgCollector(str(tmp_path))
    registry.register(collector)

    samples = by_label_set(page(registry))
    assert samples[("vllm:num_preemptions_total", ())] == 4.0
    assert self_admg(samples, 0, 0) == expected_samples(0, 0, seed=1)

    # Whatever else fails while collecting costs self-admg's series only, with one WARNING.
    def fail(*args):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(metrics, "_family", fail)
    assert by_label_set(page(registry))[("vllm:num_preemptions_total", ())] == 4.0
    monkeypatch.setattr(collector, "snapshots", fail)
    assert by_label_set(page(registry))[("vllm:num_preemptions_total", ())] == 4.0
    assert levels(logged).count(logging.WARNING) == 1


@pytest.fixture
def fresh_server(monkeypatch):
    """serve_on_prometheus as in a new API server process, on a registry of its own."""
    monkeypatch.setattr(metrics, "_served", None)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(METRICS_DIR_ENV, "")
    monkeypatch.delenv(METRICS_DIR_ENV)  # and restored to unset afterwards
    registry = CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)
    return registry


def test_a_server_that_cannot_make_the_directory_starts_without_the_series(fresh_server, monkeypatch, logged):
    def full_disk(**kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.tempfile, "mkdtemp", full_disk)
    metrics.serve_on_prometheus()
    assert levels(logged) == [logging.WARNING]
    assert "No space left on device" in logged.records[0].getMessage()
    assert METRICS_DIR_ENV not in os.environ  # the workers write nothing nobody reads
    assert generate_latest(fresh_server) == b""


def test_a_server_that_cannot_register_the_collector_starts_without_the_series(fresh_server, monkeypatch, logged):
    made, make_directory = [], metrics.tempfile.mkdtemp

    def mkdtemp(**kwargs):
        made.append(make_directory(**kwargs))
        return made[-1]

    monkeypatch.setattr(metrics.tempfile, "mkdtemp", mkdtemp)

    def refuse(collector):
        raise ValueError("Duplicated timeseries in CollectorRegistry")

    monkeypatch.setattr(fresh_server, "register", refuse)
    metrics.serve_on_prometheus()
    assert levels(logged) == [logging.WARNING]
    assert METRICS_DIR_ENV not in os.environ
    assert len(made) == 1 and not os.path.exists(made[0])  # not left behind


def test_a_server_serves_what_its_workers_write(fresh_server):
    metrics.serve_on_prometheus()
    directory = os.environ[METRICS_DIR_ENV]
    try:
        MetricsPublisher.from_environment(rank=0, engine=1).publish(lambda: metrics_snapshot(fake_proposer(1)))
        samples = by_label_set(page(fresh_server))
        assert self_admg(samples, 1, 0) == expected_samples(1, 0, seed=1)
    finally:
        metrics.shutil.rmtree(directory, ignore_errors=True)


def test_a_worker_that_cannot_publish_warns_once(tmp_path, logged):
    publisher = MetricsPublisher(str(tmp_path / "removed"), rank=1, engine=2)
    for _ in range(3):
        publisher.publish(lambda: metrics_snapshot(fake_proposer(1)))
    assert levels(logged) == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "engine 2 rank 1" in logged.records[0].getMessage()
    # Another worker (its own publisher) says so once too.
    logged.clear()
    MetricsPublisher(str(tmp_path / "removed"), rank=0, engine=0).publish(dict)
    assert levels(logged) == [logging.WARNING]
