# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Batch kernels compiled by numba, as vLLM's own `ngram` proposer compiles its lookup: the
proposer's per-step work runs on the host beside every GPU step, where per-row Python costs
more than the step can spare."""

from __future__ import annotations

import numba


def compiled(function):
    """`function` compiled by numba, cached on disk where numba finds a writable place (else
    compiled again at each engine start, rather than failing the import)."""
    try:
        return numba.njit(cache=True)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(function)
