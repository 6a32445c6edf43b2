"""vLLM 0.32 CPU bug: every speculative method is lossy at temperature > 0 on CPU.

Without Triton, the rejection sampler's `expand_kernel` runs the C++ fallback
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the kernel int64 *copies* of its
float32/int32 tensors and never copies the result back: per-token temperatures (and top-k/top-p)
come out as garbage, target probabilities turn NaN, and the recovered-token kernel then emits
the draft token. (The int64 cast of the input would also truncate float temperatures.)

Fix: replace the fallback with an exact pure-torch expansion. It is registered by
`CpuPlatform.register_triton_kernel_overrides`, which runs in each worker after the plugins, so
replacing the module attribute is enough. Remove this file when vLLM copies the result back.
"""

import torch


def expand_batch_to_tokens_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                                MAX_NUM_TOKENS=None):
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts.to(torch.int64))
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def apply() -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return  # Triton runs the real kernel; the C++ fallback is not used.
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_batch_to_tokens_impl
