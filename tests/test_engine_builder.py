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
    assert choice.reason == ("float32: this CPU has no native bf16 (no avx512_bf16/amx_bf16); "
                             "bf16 would fall back to slow kernels")
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
