# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The test suite's vLLM plugin: faults raised on purpose at the runtime's fault points, and
vLLM's CPU sampler bug left in place, in every process an engine starts. Nothing of it is in
the runtime package: conftest installs it as a plugin (`install_test_plugin`) for the test
session only, and it acts only where a test sets one of its environment variables.

`VLLM_SELFSPEC_INJECT_FAULT`: comma-separated `STAGE@N` (raise at the N-th call of that
stage), `STAGE@every`, or `STAGE@tokenT` (raise where the row's tokens include token id T: a
fault that one request causes), for the stages in `STAGES`; `STAGE@N@rankR` raises on
tensor-parallel rank R only. `VLLM_SELFSPEC_UNPATCHED_CPU_SAMPLER=1`: undo the plugin's fix of
vLLM's CPU rejection sampler, so that the sampling test can show it catches the bug.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

INJECT_ENV = "VLLM_SELFSPEC_INJECT_FAULT"
UNPATCHED_SAMPLER_ENV = "VLLM_SELFSPEC_UNPATCHED_CPU_SAMPLER"
# The proposer's stages, then the hooks the plugin adds to vLLM's loop (runner and scheduler).
STAGES = (
    "lookup", "plan", "probe", "draft", "update_states", "request_removed", "sample", "draft_handoff", "tenants",
    "schedule",
)  # fmt: skip
PLUGIN_NAME = "vllm_selfspec_tests"

logger = logging.getLogger("vllm.selfspec")


class InjectedFault(RuntimeError):
    """Raised at a fault point on a test's request."""


@dataclass(frozen=True)
class Injection:
    call: int | None  # the call number, or None for every call (or by token)
    rank: int | None
    token: int | None  # raise where the row's tokens include this id


def parse(spec: str) -> dict[str, Injection]:
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, _, rest = item.partition("@")
        when, _, rank = rest.partition("@")
        if stage not in STAGES:
            raise ValueError(f"{INJECT_ENV}: unknown stage {stage!r}; stages are {list(STAGES)}")
        if rank and not rank.startswith("rank"):
            raise ValueError(f"{INJECT_ENV}: {item!r}: a fault on one rank is written STAGE@N@rankR")
        token = int(when[5:]) if when.startswith("token") else None
        call = None if when in ("", "every") or token is not None else int(when)
        points[stage] = Injection(call, int(rank[4:]) if rank else None, token)
    return points


class FaultInjector:
    """The fault hook (`vllm_selfspec.operations.fail_safe.fault_hook`) for one spec."""

    def __init__(self, spec: str):
        self.injections = parse(spec)
        self.calls: dict[str, int] = {}

    def __call__(self, stage: str, tokens) -> None:
        injection = self.injections.get(stage)
        if injection is None or (injection.rank is not None and injection.rank != _rank()):
            return
        if injection.token is not None:
            if tokens is not None and injection.token in tokens:
                raise InjectedFault(f"injected fault at {stage} (token {injection.token})")
            return
        if tokens is not None:
            return  # a per-row point: only token faults strike there
        self.calls[stage] = self.calls.get(stage, 0) + 1
        if injection.call is None or injection.call == self.calls[stage]:
            raise InjectedFault(f"injected fault at {stage} (call {self.calls[stage]})")


def _rank() -> int:
    from vllm_selfspec.vllm_integration.draft_forward import tensor_parallel_rank

    return tensor_parallel_rank()


def register() -> None:
    """vLLM calls this in every process it starts (entry point `vllm.general_plugins`)."""
    from vllm_selfspec import plugin
    from vllm_selfspec.operations import fail_safe

    plugin.register()  # first, whatever order vLLM loads plugins in: the fix below is undone
    spec = os.environ.get(INJECT_ENV)
    if spec:
        fail_safe.fault_hook = FaultInjector(spec)
        logger.warning("%s=%r: faults are raised on purpose (a test's setting)", INJECT_ENV, spec)
    if os.environ.get(UNPATCHED_SAMPLER_ENV) == "1":
        leave_the_cpu_sampler_bug()


def leave_the_cpu_sampler_bug() -> None:
    from vllm.utils import cpu_triton_utils

    from vllm_selfspec.vllm_integration.patching import original

    fixed = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = original(cpu_triton_utils, "_expand_kernel_impl")
    if cpu_triton_utils._expand_kernel_impl is not fixed:
        logger.warning("%s=1: vLLM's CPU rejection-sampler bug is back (a test's setting)", UNPATCHED_SAMPLER_ENV)


def install_test_plugin(directory: Path) -> None:
    """Make this module a vLLM general plugin for every process started from now on: a
    distribution's metadata in `directory`, which goes on sys.path (inherited by the engine's
    spawned processes) and on PYTHONPATH (read by `vllm serve` started as a command), with
    the tests' own folder."""
    info = directory / f"{PLUGIN_NAME}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_NAME}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = fault_injection:register\n")
    tests = str(Path(__file__).parent)
    for path in (str(directory), tests):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(directory), tests, os.environ.get("PYTHONPATH"))))
