# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Fixes for bugs of vLLM 0.32's CPU build that speculative decoding runs into. Each is
applied only where the bug is (the CPU platform, no Triton); remove each when vLLM fixes it.

1. `expand_kernel`: every speculative method is lossy at temperature > 0 on CPU. Without
   Triton, the rejection sampler's `expand_kernel` runs the C++ fallback
   `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the kernel int64 *copies* of
   its float32/int32 tensors and never copies the result back: per-token temperatures (and
   top-k/top-p) come out as garbage, target probabilities turn NaN, and the recovered-token
   kernel then emits the draft token. Replaced by an exact pure-torch expansion. It is
   registered by `CpuPlatform.register_triton_kernel_overrides`, which runs in each worker
   after the plugins, so replacing the module attribute is enough.
2. `empty_top_k`: a speculative step whose batch has top-k sampling but no draft tokens crashes
   the engine (`max(): Expected reduction dim ...` in the CPU-only `apply_top_k_only`, which
   calls `k.max()` on an empty tensor; seen with vLLM's own `ngram` method too). Nothing to mask
   in an empty batch.
3. `seeded_chunked_prefill`: a request with a `seed` whose prompt is prefilled in more than one
   chunk crashes the engine ("CPU Generator does not use offset"), with or without speculation;
   under load any long prompt or a busy batch chunks a prefill. A partial-prefill step samples a
   token that is thrown away, and the runner rewinds that request's generator with
   `set_offset`, which only CUDA's Philox generator supports. For the length of
   `sample_tokens`, those requests' generators are taken out of the batch: their thrown-away
   sample comes from the global generator and their own never moves, which is exactly what the
   rewind means.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_selfspec.vllm_integration.patching import original, patch


def expand_batch_to_tokens_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts.to(torch.int64))
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def fix_expand_kernel() -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return  # Triton runs the real kernel; the C++ fallback is not used.
    from vllm.utils import cpu_triton_utils

    patch(
        cpu_triton_utils,
        "_expand_kernel_impl",
        expand_batch_to_tokens_impl,
        "CPU expand fallback never copies its result back: lossy rejection sampling at T > 0",
    )


def fix_empty_top_k() -> None:
    from vllm.v1.sample.ops import topk_topp_sampler

    apply_top_k_only = topk_topp_sampler.apply_top_k_only

    def guarded(logits, k):
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_only(logits, k)

    patch(
        topk_topp_sampler, "apply_top_k_only", guarded, "CPU top-k crashes on a speculative step with no draft tokens"
    )


def fix_seeded_chunked_prefill() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def sample_tokens(self, grammar_output):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        parked = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return original(GPUModelRunner, "sample_tokens")(self, grammar_output)
        finally:
            generators.update(parked)

    patch(
        GPUModelRunner,
        "sample_tokens",
        sample_tokens,
        "CPU generators cannot rewind: a seeded request with a chunked prefill crashes",
    )


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    fix_expand_kernel()
    fix_empty_top_k()
    fix_seeded_chunked_prefill()
