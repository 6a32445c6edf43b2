# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The one way the lab builds a vLLM engine: tests, the demo, the benchmark harness and the
diagnostics all call `build_llm`, so model names, the dtype default and shutdown agree.

    with engine("smollm2-135m", max_model_len=2048) as llm:   # dtype: what this machine runs natively
        llm.generate(...)
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

# Flags that give an x86 CPU native bfloat16 arithmetic; without them bf16 runs on slower
# fallback kernels.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The instruction sets that decide how fast this CPU decodes, recorded next to benchmark numbers.
ISA_FLAGS = ("avx2", "avx512f", *NATIVE_BF16_FLAGS)
NATIVE = "auto-native"  # a dtype argument meaning "whatever native_dtype() picks"
# vLLM's CPU worker binds its OpenMP threads to the cores this names. Its default ("auto") gives
# the worker one core per NUMA node and leaves the rest to the engine process; on a 2-core
# machine the worker then computes on one core.
CORES_ENV_VAR = "VLLM_CPU_OMP_THREADS_BIND"


class DtypeChoice(NamedTuple):
    dtype: str
    reason: str  # starts with the dtype, e.g. "float32: this CPU has no native bf16 ..."


def cpu_flags(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU in `cpuinfo` (empty where there is none)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def native_dtype(flags: Iterable[str] | None = None, cuda: bool | None = None) -> DtypeChoice:
    """bfloat16 where it runs natively (a CUDA device, or a CPU with bf16 instructions), else
    float32. `flags` and `cuda` default to this machine's."""
    if cuda is None:
        cuda = cuda_available()
    if cuda:
        return DtypeChoice("bfloat16", "bfloat16: a CUDA device is present")
    have = set(cpu_flags() if flags is None else flags)
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in have]
    if native:
        return DtypeChoice("bfloat16", f"bfloat16: this CPU has native bf16 ({'/'.join(native)})")
    return DtypeChoice(
        "float32",
        f"float32: this CPU has no native bf16 (no {'/'.join(NATIVE_BF16_FLAGS)}); "
        "bf16 would fall back to slow kernels",
    )


def choose_dtype(given: str | None) -> DtypeChoice:
    """A command line's --dtype if given, else the native choice."""
    if given in (None, NATIVE):
        return native_dtype()
    return DtypeChoice(given, f"{given}: chosen with --dtype")


class CoresChoice(NamedTuple):
    binding: str  # the value of CORES_ENV_VAR
    reason: str


def core_list(cpus: Iterable[int]) -> str:
    """CPU ids in the form vLLM parses, runs as ranges: {0, 1, 2, 5} -> "0-2,5"."""
    ids, parts = sorted(set(cpus)), []
    for cpu in ids:
        if parts and cpu == parts[-1][1] + 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def all_cores() -> str:
    """Every core this process may run on, as a CORES_ENV_VAR value."""
    return core_list(os.sched_getaffinity(0))


def choose_worker_cores(environ=os.environ) -> CoresChoice:
    """The cores the lab's engines compute on: CORES_ENV_VAR as the user set it, else every core.
    With every core, plain decoding and self-admg alike served 1.3-1.8x faster here than with
    vLLM's default (docs/results.md, "The CPU worker on both cores"). For one worker per engine
    (no CPU tensor parallelism). On a GPU the variable is not read."""
    if environ.get(CORES_ENV_VAR):
        return CoresChoice(environ[CORES_ENV_VAR], f"{CORES_ENV_VAR}={environ[CORES_ENV_VAR]} as set")
    binding = all_cores()
    return CoresChoice(
        binding,
        f"{CORES_ENV_VAR}={binding}: the CPU worker computes on every core "
        f"(set {CORES_ENV_VAR}=auto for vLLM's default)",
    )


def bind_worker_cores(environ=os.environ) -> CoresChoice:
    """choose_worker_cores, set in `environ` for the engines this process starts."""
    choice = choose_worker_cores(environ)
    environ[CORES_ENV_VAR] = choice.binding
    return choice


def resolve_model(model: str | os.PathLike[str]) -> str:
    """A model directory as is; an asset name ("smollm2-135m", "qwen2.5-coder-1.5b") fetched
    into the cache if needed; anything else (a hub id) passed through."""
    model = str(model)
    if os.path.isdir(model):  # no asset lookup: Ray replicas build engines without the lab's assets
        return model
    from benchmarks import assets

    return assets.model_or_path(model)


def engine_args(model: str | os.PathLike[str], **engine_kwargs) -> dict:
    """The arguments build_llm gives `vllm.LLM`: engine_kwargs as they are, the model resolved
    (see resolve_model), and a missing, None or "auto-native" dtype made native_dtype()'s."""
    dtype = engine_kwargs.get("dtype")
    return {
        **engine_kwargs,
        "model": resolve_model(model),
        "dtype": native_dtype().dtype if dtype in (None, NATIVE) else dtype,
    }


def build_llm(model: str | os.PathLike[str], **engine_kwargs):
    """A `vllm.LLM` for `model`; see engine_args."""
    from vllm import LLM

    return LLM(**engine_args(model, **engine_kwargs))


def close_llm(llm) -> None:
    """Stop the engine's processes now rather than whenever the object is collected, so the
    next engine gets the memory and cores."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def engine(model: str | os.PathLike[str], **engine_kwargs) -> Iterator:
    """build_llm as a context: the engine is closed on the way out, also after an error."""
    llm = build_llm(model, **engine_kwargs)
    try:
        yield llm
    finally:
        close_llm(llm)


def spec_decode_counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters of this `LLM` (built with disable_log_stats=False):
    num_drafts, num_draft_tokens, num_accepted_tokens (names without the vllm: prefix).

    Read from this engine's own Prometheus logger, not `LLM.get_metrics()`: the registry is
    process-global and each engine built unregisters the counters of those built before it,
    so with engines alive side by side (shared test engines, `benchmarks.run --interleave`)
    `get_metrics()` counts the last engine's drafts whichever engine is asked."""
    manager = llm.llm_engine.logger_manager
    if manager is None:
        raise ValueError("spec_decode_counters reads an LLM built with disable_log_stats=False")
    proms = [
        logger.spec_decoding_prom
        for logger in manager.stat_loggers
        if getattr(getattr(logger, "spec_decoding_prom", None), "spec_decoding_enabled", False)
    ]
    if not proms:
        return {}
    return {
        name: sum(
            sample.value
            for child in getattr(proms[0], f"counter_spec_decode_{name}").values()
            for metric in child.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
