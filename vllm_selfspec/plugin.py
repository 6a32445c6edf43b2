"""vLLM general plugin: vLLM calls `register()` once in every process it starts (front end,
engine core, workers) through the `vllm.general_plugins` entry point."""

import os

_registered = False
# Testing only: leave vLLM's CPU rejection-sampler bug in place, to show that the statistical
# test catches it (tests/test_sampling.py).
UNPATCHED_SAMPLER_ENV = "VLLM_SELFSPEC_UNPATCHED_CPU_SAMPLER"


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_selfspec.patches import (
        check_vllm_version,
        cpu_empty_top_k,
        cpu_expand_kernel,
        cpu_seeded_prefill,
        front_door,
        lookahead,
    )

    check_vllm_version()
    front_door.apply()
    lookahead.apply()
    if os.environ.get(UNPATCHED_SAMPLER_ENV) != "1":
        cpu_expand_kernel.apply()
    cpu_empty_top_k.apply()
    cpu_seeded_prefill.apply()
    _registered = True
