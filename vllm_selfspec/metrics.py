"""Self-admg's counters on vLLM's Prometheus `/metrics`, for operators, without dev mode.

The proposer runs in the workers, and vLLM serves `/metrics` from its API server process. When
a server asks for self-admg, the front door gives the engine a private directory
(`VLLM_SELFSPEC_METRICS_DIR`, inherited by the engine's processes): each worker writes a small
snapshot of its counters there once a second (`MetricsPublisher`, atomically), and a
collector in the API server reads the snapshots whenever `/metrics` is scraped
(`SelfAdmgCollector`). The snapshots hold counters only: no request ids, nothing a request
sent. Offline engines (`LLM`) get no directory and write nothing.

Exposed, each with a `rank` label (the tensor-parallel rank):
  vllm:self_admg_faults_total, vllm:self_admg_steps_skipped_for_faults_total,
  vllm:self_admg_drafting_disabled (0 or 1),
  vllm:self_admg_draft_tokens_total{source="self"|"context"|"history"},
  vllm:self_admg_lookup_tokens_accepted_total, vllm:self_admg_draft_tokens_withheld_total,
  vllm:self_admg_probes_total,
  vllm:self_admg_probe_seconds_total, vllm:self_admg_proposer_steps_total,
  vllm:self_admg_proposer_seconds_total (its rate over steps' rate: proposer time per step),
  vllm:self_admg_requests_holding_state (requests the proposer keeps a skip mask for).
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

# name in the snapshot -> (kind, help)
METRICS = {
    "faults": ("counter", "Drafting faults on this rank (each costs one step's drafts)"),
    "steps_skipped_for_faults": ("counter", "Steps every rank served without drafts because a rank faulted"),
    "drafting_disabled": ("gauge", "1 once self-admg switched itself off after faults (plain decoding)"),
    "draft_tokens": ("counter", "Draft tokens proposed, by source: self (layer-skipping), context, history"),
    "lookup_tokens_accepted": ("counter", "Lookup draft tokens verification accepted"),
    "draft_tokens_withheld": (
        "counter",
        "Draft tokens not verified: withheld beside a prompt's prefill, or cut at max_model_len",
    ),
    "probes": ("counter", "Prompts whose residual stream was measured for a self-draft"),
    "probe_seconds": ("counter", "Seconds spent measuring prompts"),
    "proposer_steps": ("counter", "Steps the proposer was asked for drafts"),
    "proposer_seconds": ("counter", "Seconds the proposer spent in those steps, on the step's critical path"),
    "requests_holding_state": ("gauge", "Requests the proposer keeps a skip mask for (0 when idle)"),
}


class MetricsPublisher:
    """A worker's side: a daemon thread writes the proposer's snapshot to `directory` once a
    second, so publishing costs no step anything and an idle engine's last counts still arrive.
    Writing never raises into the worker."""

    def __init__(self, directory: str | None, rank: int = 0):
        self.path = Path(directory) / f"rank{rank}-{os.getpid()}.json" if directory else None
        self.rank = rank

    @classmethod
    def from_environment(cls, rank: int = 0) -> MetricsPublisher:
        return cls(os.environ.get(METRICS_DIR_ENV), rank)

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
            temporary.write_text(json.dumps({"rank": self.rank, **snapshot()}))
            os.replace(temporary, self.path)  # a reader sees the old snapshot or the new one
        except Exception as err:  # metrics must never cost the engine anything
            logger.debug("self-admg metrics not written: %s", err)


class SelfAdmgCollector:
    """The API server's side: a Prometheus collector over the workers' latest snapshots."""

    def __init__(self, directory: str):
        self.directory = Path(directory)

    def snapshots(self) -> list[dict]:
        found = []
        for path in sorted(self.directory.glob("rank*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # being replaced or gone: the next scrape reads it
        return found

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = self.snapshots()
        for name, (kind, help_text) in METRICS.items():
            labels = ["rank", "source"] if name == "draft_tokens" else ["rank"]
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                PREFIX + name, help_text, labels=labels
            )
            for snapshot in snapshots:
                value, rank = snapshot.get(name), str(snapshot.get("rank", 0))
                if isinstance(value, dict):
                    for source, count in value.items():
                        family.add_metric([rank, source], count)
                elif value is not None:
                    family.add_metric([rank], value)
            yield family


_served: str | None = None


def serve_on_prometheus() -> None:
    """In the API server's process, before the engine starts: make the workers' directory and
    expose what they write on /metrics (vLLM's single-process registry). Once per process."""
    global _served
    if _served is not None:
        return
    from prometheus_client import REGISTRY

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several API server processes: vLLM then serves only what they write to that directory.
        logger.warning(
            "self-admg's counters are not on /metrics with several API server processes "
            "(PROMETHEUS_MULTIPROC_DIR is set); vLLM's own spec-decode counters are"
        )
        return
    directory = tempfile.mkdtemp(prefix="vllm-selfspec-metrics-")  # private to this user (0700)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[METRICS_DIR_ENV] = directory
    REGISTRY.register(SelfAdmgCollector(directory))
    _served = directory
