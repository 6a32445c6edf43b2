# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The lab's engine builder without an engine: the native dtype choice from a CPU's flags, and
the arguments build_llm hands vLLM."""

from __future__ import annotations

from benchmarks import assets, engine
from benchmarks.engine import DtypeChoice, choose_dtype, cpu_flags, engine_args, native_dtype

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse2 avx2 avx512f {extra}

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f {extra}
"""


def test_native_bf16_flags_choose_bfloat16():
    for flag in ("avx512_bf16", "amx_bf16"):
        choice = native_dtype({"avx2", "avx512f", flag}, cuda=False)
        assert choice == DtypeChoice("bfloat16", f"bfloat16: this CPU has native bf16 ({flag})")


def test_without_native_bf16_float32_and_why():
    choice = native_dtype({"avx2", "avx512f"}, cuda=False)
    assert choice.dtype == "float32"
    assert choice.reason == (
        "float32: this CPU has no native bf16 (no avx512_bf16/amx_bf16); bf16 would fall back to slow kernels"
    )
    assert native_dtype(set(), cuda=True) == DtypeChoice("bfloat16", "bfloat16: a CUDA device is present")


def test_flags_come_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(extra="amx_bf16"))
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "avx512f", "amx_bf16"}
    assert native_dtype(cpu_flags(cpuinfo), cuda=False).dtype == "bfloat16"
    assert cpu_flags(tmp_path / "missing") == set()


def test_given_dtype_wins_and_none_means_native(monkeypatch):
    monkeypatch.setattr(engine, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(engine, "cuda_available", lambda: False)
    assert choose_dtype("bfloat16") == DtypeChoice("bfloat16", "bfloat16: chosen with --dtype")
    assert choose_dtype(None).dtype == choose_dtype("auto-native").dtype == "float32"


def test_engine_args_resolve_the_model_and_the_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "native_dtype", lambda: DtypeChoice("float32", "float32: test"))
    monkeypatch.setattr(assets, "model_or_path", lambda name: f"/cache/{name}")
    assert engine_args(tmp_path, seed=0) == {"model": str(tmp_path), "dtype": "float32", "seed": 0}
    assert engine_args("smollm2-135m", dtype="auto-native")["model"] == "/cache/smollm2-135m"
    assert engine_args(tmp_path, dtype="bfloat16")["dtype"] == "bfloat16"
    assert engine_args(tmp_path, dtype=None)["dtype"] == "float32"


def test_core_lists_are_written_as_vllm_parses_them():
    from vllm.utils.cpu_resource_utils import parse_id_list

    for cpus in ({0, 1}, {0}, {0, 1, 2, 5, 7, 8}, {3, 4, 5}):
        assert set(parse_id_list(engine.core_list(cpus))) == cpus
    assert engine.core_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_the_lab_binds_every_core_unless_the_binding_is_set(monkeypatch):
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1})
    environ = {}
    assert engine.bind_worker_cores(environ).binding == "0-1" and environ == {engine.CORES_ENV_VAR: "0-1"}
    environ = {engine.CORES_ENV_VAR: "auto"}
    assert engine.bind_worker_cores(environ).binding == "auto" and environ == {engine.CORES_ENV_VAR: "auto"}


def test_every_command_that_builds_engines_binds_the_cores():
    import re
    from pathlib import Path

    lab = Path(engine.__file__).parent
    # ray_data_batch runs one replica per core, each with vLLM's own binding
    exempt = {"engine.py", "ray_data_batch.py"}
    commands = [
        p
        for p in lab.rglob("*.py")
        if p.name not in exempt and re.search(r"\b(build_llm|engine|VllmServer)\(", p.read_text())
    ]
    assert len(commands) >= 8
    assert [p.name for p in commands if "bind_worker_cores()" not in p.read_text()] == []
