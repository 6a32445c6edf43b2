# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The target model seen as a residual stream: embed -> (attention, MLP) x L -> norm -> logits.

One adapter serves every architecture in `SUPPORTED_ARCHITECTURES`: vLLM's Llama, Mistral,
Qwen2 and Qwen3 decoder layers all have `input_layernorm`, `self_attn(positions,
hidden_states)`, `post_attention_layernorm` and `mlp`. We call those submodules directly and keep
the residual stream explicit (h + sublayer(norm(h))) instead of vLLM's fused add-and-norm,
because a skipped sublayer is then simply an addition left out, per row. Calling submodules
also bypasses the target's compiled graph, which must stay untouched for verification.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualStream:
    def __init__(self, causal_lm: nn.Module):
        inner = causal_lm.model
        self.causal_lm = causal_lm
        self.inner = inner
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(inner.layers))
        if start != 0 or end != len(inner.layers):
            raise NotImplementedError("self-admg needs all decoder layers on one rank (no pipeline parallelism)")
        self.layers = list(inner.layers)
        for layer in self.layers:
            for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                if not hasattr(layer, name):
                    raise NotImplementedError(
                        f"decoder layer {type(layer).__name__} has no {name!r}; self-admg supports "
                        "Llama-style decoder layers only"
                    )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def sublayer_bytes(self) -> tuple[float, float]:
        """Weight bytes of one attention and one MLP sublayer (what a decode step reads)."""
        return weight_bytes(self.layers[0].self_attn), weight_bytes(self.layers[0].mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_input_ids(input_ids)

    def attention(self, layer: int, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        return block.self_attn(positions=positions, hidden_states=block.input_layernorm(h))

    def mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        return block.mlp(block.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.causal_lm.compute_logits(self.inner.norm(h))

    def head_rows(self) -> torch.Tensor | None:
        """The LM head's weight, one row per token id, when it is a plain unsharded matrix
        (not under tensor parallelism or quantization); None otherwise."""
        weight = getattr(getattr(self.causal_lm, "lm_head", None), "weight", None)
        vocab = getattr(self.causal_lm.config, "vocab_size", None)
        if (
            not isinstance(weight, torch.Tensor)
            or not weight.is_floating_point()
            or weight.dim() != 2
            or vocab is None
            or weight.shape[0] < vocab
        ):
            return None
        return weight[:vocab]

    def draft_logits(self, h: torch.Tensor, head_ids: HeadIds | None) -> torch.Tensor:
        """Logits of the draft: over `head_ids` only when given (columns follow its order)."""
        if head_ids is None:
            return self.logits(h)
        h = self.inner.norm(h)
        logits = torch.nn.functional.linear(h, head_ids.first_rows)
        if head_ids.extra is not None:
            logits = torch.cat([logits, torch.nn.functional.linear(h, head_ids.extra_rows)], dim=-1)
        return logits


class HeadIds:
    """The token ids a draft scores: the first `num_first` ids of the vocabulary (BPE ids run
    roughly from frequent to rare, and a prefix of the weight is a view: no copy) plus `extra`
    ids (those in the drafting sequences' contexts). A draft's argmax is a guess that
    verification checks, so a smaller head only costs acceptance when the target's token is
    outside the set, and it saves most of the LM head's weight reads."""

    def __init__(self, head_rows: torch.Tensor, num_first: int, extra: torch.Tensor | None):
        self.first_rows = head_rows[:num_first]
        self.num_first = num_first
        self.extra = extra if extra is not None and len(extra) else None
        self.extra_rows = head_rows.index_select(0, self.extra) if self.extra is not None else None

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Map draft-logit columns back to token ids."""
        if self.extra is None:
            return columns
        in_first = columns < self.num_first
        extra = self.extra[(columns - self.num_first).clamp(min=0)]
        return torch.where(in_first, columns, extra)


def weight_bytes(module: nn.Module) -> float:
    """Bytes of a module's weights: what a forward pass through it reads. vLLM's CPU backend
    repacks linear weights for its kernels and leaves empty parameters behind, so its linear
    layers are counted from their shapes (this rank's partition)."""
    total = 0
    for sub in module.modules():
        rows, cols = getattr(sub, "output_size_per_partition", 0), getattr(sub, "input_size_per_partition", 0)
        params = list(sub.parameters(recurse=False))
        if rows and cols:
            itemsize = torch.empty((), dtype=getattr(sub, "params_dtype", torch.float32)).element_size()
            total += rows * cols * itemsize
            params = [p for name, p in sub.named_parameters(recurse=False) if name != "weight"]
        total += sum(p.numel() * p.element_size() for p in params)
    return float(total)


def cosine_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per-token cosine similarity of two residual streams, in float32."""
    return torch.nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)


def similarity_sums(
    stream: ResidualStream, input_ids: torch.Tensor, positions: torch.Tensor, row_of_token: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the full model over tokens of `num_rows` sequences and return, per row and layer,
    the sum over that row's tokens of cos(h, h + attention) and cos(h', h' + MLP):
    two float64 tensors [num_rows, num_layers]. Attention reads the KV cache; the caller's
    forward context decides whether anything is written (the probe writes nothing)."""
    L = stream.num_layers
    attn_sum = torch.zeros(num_rows, L, dtype=torch.float64, device=input_ids.device)
    mlp_sum = torch.zeros_like(attn_sum)
    h = stream.embed(input_ids)
    for layer in range(L):
        after = h + stream.attention(layer, positions, h)
        attn_sum[:, layer].index_add_(0, row_of_token, cosine_rows(h, after).double())
        h = after
        after = h + stream.mlp(layer, h)
        mlp_sum[:, layer].index_add_(0, row_of_token, cosine_rows(h, after).double())
        h = after
    return attn_sum, mlp_sum


def draft_logits(
    stream: ResidualStream,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    skip_attention: torch.Tensor,
    skip_mlp: torch.Tensor,
    head_ids: HeadIds | None = None,
) -> torch.Tensor:
    """One draft step for a batch of rows, each with its own skip mask ([rows, layers] bool,
    on the CPU). A sublayer that every row skips is not computed at all; one that some rows
    skip is computed for all rows (attention) or only for the keeping rows (MLP), and its
    output is left out of the skipping rows' streams."""
    h = stream.embed(input_ids)
    keep_attention, keep_mlp = ~skip_attention, ~skip_mlp
    for layer in range(stream.num_layers):
        keep = keep_attention[:, layer]
        if keep.any():
            out = stream.attention(layer, positions, h)
            h = h + out if keep.all() else h + out * keep.to(h.device, h.dtype)[:, None]
        keep = keep_mlp[:, layer]
        if keep.all():
            h = h + stream.mlp(layer, h)
        elif keep.any():
            rows = keep.nonzero().squeeze(1).to(h.device)
            h = h.index_add(0, rows, stream.mlp(layer, h.index_select(0, rows)))
    return stream.draft_logits(h, head_ids)
