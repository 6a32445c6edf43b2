# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Self-admg's counters on vLLM's Prometheus `/metrics`, for operators, without dev mode.

The proposer runs in the workers, and vLLM serves `/metrics` from its API server process. When
a server asks for self-admg, the front door gives the engines a private directory
(`VLLM_SELFSPEC_METRICS_DIR`, inherited by the processes the server then starts): each worker
writes a small snapshot of its counters there once a second (`MetricsPublisher`, atomically,
one file per worker process), and a collector in the API server reads the snapshots whenever
`/metrics` is scraped (`SelfAdmgCollector`). The snapshots hold counters only: no request ids,
nothing a request sent. Offline engines (`LLM`) get no directory and write nothing. Only the
engines that this API server starts are seen: those a `--headless` node starts write to a
directory on their own node, which no API server reads.

Every series carries an `engine` label (the data-parallel rank, as on vLLM's own series: the
proposer reads vLLM's `data_parallel_index`, since `data_parallel_rank` is 0 in every engine of
a dense model) and a `rank` label (the tensor-parallel rank), so no two workers share a label
set. A worker that restarts leaves its old process's file behind; of the files of one (engine,
rank) only the most recently written counts. A file that is not a snapshot is skipped and
counted, and a scrape never fails for self-admg's sake: vLLM's own series are on the same page.

Exposed, each with `engine` and `rank` labels:
  vllm:self_admg_faults_total, vllm:self_admg_steps_skipped_for_faults_total,
  vllm:self_admg_drafting_disabled (0 or 1),
  vllm:self_admg_draft_tokens_total{source="self"|"context"|"history"|"prediction"},
  vllm:self_admg_lookup_tokens_accepted_total, vllm:self_admg_prediction_tokens_accepted_total,
  vllm:self_admg_draft_tokens_withheld_total, vllm:self_admg_probes_total,
  vllm:self_admg_probe_seconds_total, vllm:self_admg_proposer_steps_total,
  vllm:self_admg_proposer_seconds_total (its rate over steps' rate: proposer time per step),
  vllm:self_admg_requests_holding_state (requests the proposer keeps a skip mask for).
And without labels: vllm:self_admg_snapshots_unreadable_total (snapshot files a scrape skipped
because they were not a worker's snapshot; any increase means some worker's counters are missing).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("vllm.selfspec")

METRICS_DIR_ENV = "VLLM_SELFSPEC_METRICS_DIR"
PUBLISH_EVERY_SECONDS = 1.0
PREFIX = "vllm:self_admg_"
LABELS = ("engine", "rank")
# The workers' snapshot files; their temporaries end in .tmp, so a reader never matches one.
SNAPSHOT_GLOB = "engine*-rank*-*.json"

# name in the snapshot -> (kind, help)
METRICS = {
    "faults": ("counter", "Drafting faults on this rank (each costs one step's drafts)"),
    "steps_skipped_for_faults": ("counter", "Steps every rank served without drafts because a rank faulted"),
    "drafting_disabled": (
        "gauge",
        "1 while self-admg has switched drafting off after faults (plain decoding until a cool-down ends)",
    ),
    "draft_tokens": (
        "counter",
        "Draft tokens proposed, by source: self (layer-skipping), context, history, prediction",
    ),
    "lookup_tokens_accepted": ("counter", "Lookup draft tokens verification accepted"),
    "prediction_tokens_accepted": ("counter", "Draft tokens from requests' predictions verification accepted"),
    "draft_tokens_withheld": (
        "counter",
        "Draft tokens not verified: withheld beside a prompt's prefill, or cut at max_model_len",
    ),
    "probes": ("counter", "Prompts whose residual stream was measured for a self-draft"),
    "probe_seconds": ("counter", "Seconds spent measuring prompts"),
    "proposer_steps": ("counter", "Steps the proposer was asked for drafts"),
    "proposer_seconds": (
        "counter",
        "Seconds the proposer spent on steps' critical path: proposing, and its part in every step's state update",
    ),
    "requests_holding_state": ("gauge", "Requests the proposer keeps a skip mask for (0 when idle)"),
    "scheduler_faults": (
        "counter",
        "Faults in self-admg's scheduler hooks, as the scheduler last told this rank (each costs a "
        "step its first-token rule, or a request its tenant's history)",
    ),
    "requests_quarantined": ("gauge", "Live requests that draft no more because their own lookup faulted"),
}
BY_SOURCE = "draft_tokens"  # the one metric whose value is {source: count}
UNREADABLE = "snapshots_unreadable"
UNREADABLE_HELP = "Snapshot files scrapes skipped as unreadable (a worker's counters are missing meanwhile)"


class MetricsPublisher:
    """A worker's side: a daemon thread writes the proposer's snapshot to `directory` once a
    second, so publishing costs no step anything and an idle engine's last counts still arrive.
    `engine` is the data-parallel rank, `rank` the tensor-parallel rank. Writing never raises
    into the worker; its first failure is a WARNING, the rest DEBUG (it fails the same way each
    second)."""

    def __init__(self, directory: str | None, rank: int = 0, engine: int = 0):
        self.rank, self.engine = rank, engine
        self.path = Path(directory) / f"engine{engine}-rank{rank}-{os.getpid()}.json" if directory else None
        self.failed = False

    @classmethod
    def from_environment(cls, rank: int = 0, engine: int = 0) -> MetricsPublisher:
        return cls(os.environ.get(METRICS_DIR_ENV), rank, engine)

    def start(self, source, snapshot: Callable[[object], dict]) -> None:
        """Publish `snapshot(source)` once a second for as long as `source` lives (the thread
        holds it weakly, so it never keeps a proposer, and its model, alive)."""
        if self.path is None:
            return
        threading.Thread(
            target=self._run, args=(weakref.ref(source), snapshot), name="self-admg-metrics", daemon=True
        ).start()

    def _run(self, source: weakref.ref, snapshot: Callable[[object], dict]) -> None:
        while (alive := source()) is not None:
            self.publish(lambda: snapshot(alive))
            del alive
            time.sleep(PUBLISH_EVERY_SECONDS)

    def publish(self, snapshot: Callable[[], dict]) -> None:
        try:
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"engine": self.engine, "rank": self.rank, **snapshot()}))
            os.replace(temporary, self.path)  # a reader sees the old snapshot or the new one
        except Exception as err:  # metrics must never cost the engine anything
            first, self.failed = not self.failed, True
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "self-admg's counters of engine %s rank %s not published (%s); later failures are logged at DEBUG",
                self.engine,
                self.rank,
                err,
            )


def _label(value) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"not an integer label: {value!r}")
    return str(value)


def _number(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} is not a number: {value!r}")
    return float(value)  # OverflowError for an integer too large, here rather than at printing


def _value(name: str, value):
    """A snapshot's value as floats: a number, or {source: number} for draft_tokens."""
    if name != BY_SOURCE:
        return _number(name, value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not an object: {value!r}")
    return {source: _number(name, count) for source, count in value.items()}


def parse_snapshot(data) -> tuple[tuple[str, str], dict]:
    """((engine, rank) labels, {metric: value}) of a decoded snapshot file; raises if it is not
    one. Metrics it lacks are left out; keys it has beyond them are ignored."""
    if not isinstance(data, dict):
        raise ValueError(f"not an object: {type(data).__name__}")
    labels = (_label(data.get("engine")), _label(data.get("rank")))
    return labels, {name: _value(name, data[name]) for name in METRICS if data.get(name) is not None}


class SelfAdmgCollector:
    """The API server's side: a Prometheus collector over the workers' latest snapshots."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.unreadable = 0  # files skipped, summed over scrapes
        self.lock = threading.Lock()  # scrapes may overlap
        self.warned = False

    def snapshots(self) -> dict[tuple[str, str], dict]:
        """{(engine, rank): metrics} from the newest readable file of each (engine, rank)."""
        newest: dict[tuple[str, str], tuple[int, dict]] = {}
        skipped = 0
        for path in sorted(self.directory.glob(SNAPSHOT_GLOB)):
            try:
                written = path.stat().st_mtime_ns
                labels, metrics = parse_snapshot(json.loads(path.read_text()))
            except FileNotFoundError:
                continue  # gone between listing and reading (its worker exited, or a replace)
            except Exception:  # anything else: not a snapshot (one odd file must not cost the others)
                skipped += 1
                continue
            if labels not in newest or written > newest[labels][0]:  # an old process's file loses
                newest[labels] = (written, metrics)
        with self.lock:
            self.unreadable += skipped
        return {labels: metrics for labels, (_, metrics) in newest.items()}

    def collect(self):
        """The families, as far as they can be built: a failure here would fail the whole page,
        vLLM's own series with it, so it is logged (once) instead."""
        try:
            snapshots = self.snapshots()
        except Exception as err:
            self._warn(err)
            snapshots = {}
        for name, (kind, help_text) in METRICS.items():
            try:
                family = _family(name, kind, help_text, snapshots)
            except Exception as err:
                self._warn(err)
                continue
            yield family
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(PREFIX + UNREADABLE, UNREADABLE_HELP, value=self.unreadable)

    def _warn(self, err: Exception) -> None:
        first, self.warned = not self.warned, True
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "self-admg's counters partly left off /metrics: %r",
            err,
            exc_info=first,
        )


def _family(name: str, kind: str, help_text: str, snapshots: dict[tuple[str, str], dict]):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
        PREFIX + name, help_text, labels=[*LABELS, "source"] if name == BY_SOURCE else LABELS
    )
    for labels, metrics in sorted(snapshots.items()):
        value = metrics.get(name)
        if isinstance(value, dict):
            for source, count in value.items():
                family.add_metric([*labels, source], count)
        elif value is not None:
            family.add_metric(labels, value)
    return family


_served: str | None = None


def serve_on_prometheus() -> None:
    """In the API server's process, before the engine starts: make the workers' directory and
    expose what they write on /metrics (vLLM's single-process registry). Once per process. It
    never raises: without a directory (a read-only or full disk) the server serves on, without
    self-admg's series, and says so."""
    global _served
    if _served is not None:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several API server processes: vLLM then serves only what they write to that directory.
        logger.warning(
            "self-admg's counters are not on /metrics with several API server processes "
            "(PROMETHEUS_MULTIPROC_DIR is set); vLLM's own spec-decode counters are"
        )
        return
    try:
        directory = _expose_directory()
    except Exception as err:
        logger.warning("self-admg's counters are not on /metrics: %s; vLLM's own spec-decode counters are", err)
        return
    os.environ[METRICS_DIR_ENV] = directory
    _served = directory


def _expose_directory() -> str:
    """A new directory for the workers' snapshots, its collector on vLLM's registry."""
    from prometheus_client import REGISTRY

    directory = tempfile.mkdtemp(prefix="vllm-selfspec-metrics-")  # private to this user (0700)
    try:
        REGISTRY.register(SelfAdmgCollector(directory))
    except Exception:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def metrics_snapshot(drafter) -> dict:
    """What operators watch of a worker's proposer (`vllm_selfspec.operations.metrics`): counters and
    switches, no request ids and nothing of any request's content."""
    counters, fail_safe = drafter.counters, drafter.fail_safe
    return {
        "faults": fail_safe.faults,
        "drafting_disabled": int(fail_safe.disabled),
        "steps_skipped_for_faults": fail_safe.steps_skipped,
        "draft_tokens": {
            "self": counters.draft_tokens,
            "context": counters.context_tokens,
            "history": counters.history_tokens,
            "prediction": counters.prediction_tokens,
        },
        "lookup_tokens_accepted": counters.lookup_accepted,
        "prediction_tokens_accepted": counters.prediction_accepted,
        "draft_tokens_withheld": counters.draft_tokens_withheld,
        "probes": counters.prompts_measured,
        "probe_seconds": counters.probe_seconds,
        "proposer_steps": counters.propose_calls,
        "proposer_seconds": counters.propose_seconds,
        "requests_holding_state": len(drafter.self_drafter.masks) if drafter.self_drafter is not None else 0,
        "scheduler_faults": drafter.scheduler_faults,
        "requests_quarantined": len(drafter.lookup.quarantine.requests),
    }
