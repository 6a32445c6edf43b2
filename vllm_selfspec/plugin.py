"""vLLM general plugin: vLLM calls `register()` once in every process it starts (front end,
engine core, workers) through the `vllm.general_plugins` entry point."""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_selfspec.patches import check_vllm_version, cpu_expand_kernel, front_door, lookahead

    check_vllm_version()
    front_door.apply()
    lookahead.apply()
    cpu_expand_kernel.apply()
    _registered = True
