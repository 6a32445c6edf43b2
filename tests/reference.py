"""The ADMG statistic computed independently with plain transformers (no vLLM)."""

from __future__ import annotations

import numpy as np
import torch


def hf_similarities(model_path, prompts_token_ids, window: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt: mean over its tokens (its last `window` tokens, if set) of cos(h, h + attn)
    and cos(h', h' + mlp) per layer, from hooks on a float32 transformers model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    captured: dict[str, list[torch.Tensor]] = {"in": [], "attn": [], "mlp": []}
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs: captured["in"].append(
                kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]),
            with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, args, out: captured["attn"].append(out[0] if isinstance(out, tuple) else out)))
        hooks.append(layer.mlp.register_forward_hook(lambda m, args, out: captured["mlp"].append(out)))
    results = []
    try:
        for ids in prompts_token_ids:
            for v in captured.values():
                v.clear()
            with torch.no_grad():
                model(torch.tensor([ids]))
            attn, mlp = [], []
            for h, a, m in zip(captured["in"], captured["attn"], captured["mlp"]):
                h, a, m = (x[0, -window:].double() for x in (h, a, m))
                attn.append(torch.cosine_similarity(h, h + a, dim=-1).mean().item())
                mid = h + a
                mlp.append(torch.cosine_similarity(mid, mid + m, dim=-1).mean().item())
            results.append((np.array(attn), np.array(mlp)))
    finally:
        for hook in hooks:
            hook.remove()
    return results
