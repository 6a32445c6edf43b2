# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The GPU projection's arithmetic (benchmarks/gpu_projection.py) on a case worked by hand."""

import pytest

from benchmarks import gpu_projection as gp


def test_expected_tokens_and_speedup_by_hand():
    # 8B shape at batch 1: a draft step 0.52 of a plain step, verifying 4 drafts 1.11.
    assert gp.expected_tokens(0.85, 2) == pytest.approx(1 + 0.85 + 0.85**2)  # 2.5725
    assert gp.verify_cost(2, 1.11) == pytest.approx(1.055)
    # 2.5725 / (2 x 0.52 + 1.055) = 1.228
    assert gp.speedup(0.85, 2, 0.52, gp.verify_cost(2, 1.11)) == pytest.approx(2.5725 / 2.095)
    assert gp.best_k(0.85, 0.52, 1.11) == (pytest.approx(2.5725 / 2.095), 2)


def test_fit_acceptance_inverts_expected_tokens():
    assert gp.fit_acceptance(gp.expected_tokens(0.7, 2), 2) == pytest.approx(0.7)


def test_controller_declines_what_does_not_pay():
    # The first self token needs a > 1.2 x (0.52 + 0.0275) = 0.657 at batch 1; verification at 64 costs too much.
    assert gp.plan(1, 1.11, self_draft=(0.65, 0.52)) == (1.0, 0, 0)
    assert gp.plan(1, 1.11, self_draft=(0.66, 0.52))[2] == 1
    assert gp.plan(64, 2.47, self_draft=(0.95, 0.52)) == (1.0, 0, 0)
