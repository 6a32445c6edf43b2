# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The ADMG rules and the option parser: pure functions, no engine."""

import math

import numpy as np
import pytest

from vllm_selfspec.options import (
    PROPOSER_PATH,
    SelfAdmgConfigError,
    SelfAdmgOptions,
    is_self_admg,
    make_options,
    parse_speculative_config,
)
from vllm_selfspec.self_drafting.admg import (
    SkipMask,
    fill_gaps_rule,
    keep_edge_layers_rule,
    select_skip_mask,
    threshold_rule,
)

NO_RULES = SelfAdmgOptions(keep_edge_layers=0, fill_gaps=0, attention_threshold=0.98, mlp_threshold=0.98)


def test_threshold_rule_skips_strictly_above():
    assert threshold_rule([0.5, 0.9, 0.95, 1.0], 0.9) == [False, False, True, True]
    # 1.0 is the "skip nothing" setting; -1.0 skips everything that is not exactly opposite.
    assert threshold_rule([0.99999, 1.0], 1.0) == [False, False]
    assert threshold_rule([-0.5, 0.0, 0.3], -1.0) == [True, True, True]


def test_fill_gaps_needs_skipped_neighbours_on_both_sides():
    s = [True, False, True, False, False, True]
    assert fill_gaps_rule(s, 1) == [True, True, True, False, False, True]
    assert fill_gaps_rule(s, 2) == [True, True, True, True, True, True]
    assert fill_gaps_rule(s, 0) == s
    # A kept sublayer at an end has no neighbour on one side and stays.
    assert fill_gaps_rule([False, True, True], 5) == [False, True, True]
    # Never un-skips anything.
    rng = np.random.default_rng(0)
    for _ in range(100):
        s = list(rng.random(12) < 0.5)
        out = fill_gaps_rule(s, int(rng.integers(0, 4)))
        assert all(o for o, i in zip(out, s) if i)


def test_keep_edge_layers_protects_both_ends():
    s = [True] * 6
    assert keep_edge_layers_rule(s, 1) == [False, True, True, True, True, False]
    assert keep_edge_layers_rule(s, 2) == [False, False, True, True, False, False]
    assert keep_edge_layers_rule(s, 0) == s
    assert keep_edge_layers_rule(s, 10) == [False] * 6


def test_edge_rule_wins_over_gap_filling():
    sim = [0.1, 0.99, 0.5, 0.99, 0.99]
    opts = SelfAdmgOptions(skip="attention", attention_threshold=0.9, fill_gaps=1, keep_edge_layers=1)
    mask = select_skip_mask(sim, sim, opts)
    # threshold: layers 1, 3, 4; fill_gaps: layer 2 too; edges: layers 0 and 4 kept.
    assert mask.attention == (False, True, True, True, False)


def test_attention_only_never_skips_mlp():
    mask = select_skip_mask(
        [0.99] * 4,
        [0.999] * 4,
        SelfAdmgOptions(
            skip="attention", keep_edge_layers=0, fill_gaps=0, attention_threshold=0.98, mlp_threshold=0.98
        ),
    )
    assert mask.attention == (True,) * 4
    assert mask.mlp == (False,) * 4
    mask = select_skip_mask([0.99] * 4, [0.999] * 4, NO_RULES)
    assert mask.mlp == (True,) * 4 and mask.num_skipped == 8


def test_mlp_threshold_is_separate():
    opts = SelfAdmgOptions(attention_threshold=0.95, mlp_threshold=0.5, keep_edge_layers=0, fill_gaps=0)
    mask = select_skip_mask([0.9, 0.96], [0.4, 0.6], opts)
    assert mask == SkipMask((False, True), (False, True))


# ---- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"bogus": 1}, "unknown self-admg option(s) ['bogus']"),
        ({"attention_threshold": 1.5}, "'attention_threshold' must be in [-1.0, 1.0]"),
        ({"mlp_threshold": math.nan}, "'mlp_threshold' must be in"),
        ({"attention_threshold": True}, "'attention_threshold' must be a number"),
        ({"attention_threshold": "0.9"}, "'attention_threshold' must be a number"),
        ({"skip": "mlp"}, "'skip' must be one of ['attention', 'attention+mlp']"),
        ({"keep_edge_layers": -1}, "'keep_edge_layers' must be in [0, 1000000]"),
        ({"fill_gaps": 1.5}, "'fill_gaps' must be an integer"),
        ({"draft_exit_threshold": 1.2}, "'draft_exit_threshold' must be in [0.0, 1.0]"),
        ({"lookup_history": -5}, "'lookup_history' must be in [0, 262144]"),
    ],
)
def test_bad_options_name_the_option_and_the_allowed_values(raw, fragment):
    with pytest.raises(SelfAdmgConfigError) as err:
        make_options(raw)
    assert fragment in str(err.value)


def test_unknown_option_lists_every_allowed_option():
    with pytest.raises(SelfAdmgConfigError) as err:
        make_options({"treshold": 0.9})
    for name in (
        "attention_threshold",
        "mlp_threshold",
        "skip",
        "keep_edge_layers",
        "fill_gaps",
        "draft_exit_threshold",
        "stats_window",
    ):
        assert name in str(err.value)


def test_parse_rewrites_to_custom_class_and_keeps_vllm_keys():
    vllm_keys = {"method", "model", "num_speculative_tokens", "disable_padded_drafter_batch"}
    spec, opts = parse_speculative_config(
        {
            "method": "self-admg",
            "num-speculative-tokens": 3,
            "attention_threshold": 0.9,
            "disable_padded_drafter_batch": True,
        },
        vllm_keys,
    )
    assert spec == {
        "method": "custom_class",
        "model": PROPOSER_PATH,
        "num_speculative_tokens": 3,
        "disable_padded_drafter_batch": True,
    }
    assert opts.attention_threshold == 0.9
    spec, _ = parse_speculative_config({"model": "self-admg"}, vllm_keys)
    assert spec["num_speculative_tokens"] == 8  # the documented default


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"method": "self-admg", "model": "some/other-model"}, "mixes self-admg"),
        ({"method": "ngram", "model": "self-admg"}, "mixes self-admg"),
        ({"method": "self-admg", "prompt_lookup_maxx": 3}, "unknown self-admg option(s) ['prompt_lookup_maxx']"),
        ({"method": "self-admg", "quantization": "fp8"}, "['quantization'] are not used"),
        ({"method": "self-admg", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be in [1, 32]"),
    ],
)
def test_parse_rejects_what_self_admg_cannot_use(spec, fragment):
    vllm_keys = {"method", "model", "num_speculative_tokens", "quantization"}
    with pytest.raises(SelfAdmgConfigError) as err:
        parse_speculative_config(spec, vllm_keys)
    assert fragment in str(err.value)


def test_is_self_admg_spellings():
    assert is_self_admg({"method": "self-admg"})
    assert is_self_admg({"model": "self-admg", "num_speculative_tokens": 2})
    assert not is_self_admg({"method": "ngram"})
    assert not is_self_admg(None)


def test_budget_rule_skips_least_change_per_byte_until_the_budget_is_met():
    from vllm_selfspec.self_drafting.admg import budget_rule

    attention = [0.999, 0.99, 0.98, 0.97]
    mlp = [0.85, 0.995, 0.99, 0.8]
    everywhere = [True] * 4
    # Attention costs 1 byte, MLP 10; total 44. Change per byte: attention 0.001, 0.01, 0.02,
    # 0.03; MLP 0.015, 0.0005, 0.001, 0.02. Half the bytes: MLP 1, attention 0, MLP 2 (21
    # bytes), then attention 1 (22).
    skip_attention, skip_mlp = budget_rule(attention, mlp, 1.0, 10.0, 0.5, everywhere, everywhere)
    assert skip_mlp == [False, True, True, False] and skip_attention == [True, True, False, False]
    # A budget is met, not exceeded by more than the last sublayer taken.
    skip_attention, skip_mlp = budget_rule(attention, mlp, 1.0, 10.0, 0.2, everywhere, everywhere)
    assert skip_mlp == [False, True, False, False] and not any(skip_attention)
    # Sublayers that may not be skipped are never chosen.
    _, skip_mlp = budget_rule(attention, mlp, 1.0, 10.0, 0.2, everywhere, [True, False, True, True])
    assert skip_mlp == [False, False, True, False]


def test_skip_budget_keeps_edge_layers_and_the_skip_kind():
    opts = SelfAdmgOptions(skip_budget=0.9, keep_edge_layers=1, skip="attention")
    mask = select_skip_mask([0.99] * 5, [0.99] * 5, opts, sublayer_bytes=(1.0, 10.0))
    assert mask.attention == (False, True, True, True, False) and not any(mask.mlp)
    with pytest.raises(ValueError, match="weight bytes"):
        select_skip_mask([0.99] * 5, [0.99] * 5, opts)


def test_weight_bytes_counts_repacked_linear_layers_by_their_shape():
    """vLLM's CPU backend repacks linear weights and leaves an empty `weight` behind; a byte
    budget computed from parameters would then divide by zero (seen on Qwen in bfloat16)."""
    import torch

    from vllm_selfspec.self_drafting.residual_stream import weight_bytes

    class RepackedLinear(torch.nn.Module):  # the attributes vLLM's LinearBase keeps
        def __init__(self, rows, cols):
            super().__init__()
            self.output_size_per_partition, self.input_size_per_partition = rows, cols
            self.params_dtype = torch.bfloat16
            self.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
            self.bias = torch.nn.Parameter(torch.zeros(rows), requires_grad=False)

    mlp = torch.nn.Sequential(RepackedLinear(6, 4), RepackedLinear(4, 3), torch.nn.LayerNorm(4))
    assert weight_bytes(mlp) == (6 * 4 + 4 * 3) * 2 + (6 + 4) * 4 + 2 * 4 * 4  # weights, biases, norm
    assert weight_bytes(torch.nn.Linear(4, 3, bias=False)) == 4 * 3 * 4  # plain modules: parameters
