"""vLLM general plugin: vLLM calls `register()` once in every process it starts (front end,
engine core, workers) through the `vllm.general_plugins` entry point."""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_selfspec.vllm_compat import apply_patches

    apply_patches()
    _registered = True
