"""vLLM 0.32 CPU bug: a speculative step whose batch has top-k sampling but no draft tokens
crashes the engine (`max(): Expected reduction dim ...` in `apply_top_k_only`).

The rejection sampler applies top-k to the target logits of the draft positions; when every
row of the step has an empty draft there are none, and the CPU-only, sort-free `apply_top_k_only`
calls `k.max()` on an empty tensor. Seen with vLLM's own `ngram` method as well. Fix: nothing to
mask in an empty batch. Remove when vLLM guards the empty case.
"""


def apply() -> None:
    from vllm.v1.sample.ops import topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, "_self_admg", False):
        return

    def apply_top_k_only(logits, k):
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    apply_top_k_only._self_admg = True
    topk_topp_sampler.apply_top_k_only = apply_top_k_only
