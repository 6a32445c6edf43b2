# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Drafts from the target model itself, with some of its sublayers skipped:
- `admg`: the Adaptive Draft Model Generator, statistics in, skip masks out (pure functions);
- `residual_stream`: the target as an explicit residual stream, one adapter per architecture;
- `drafter`: the statistics probe, the masked draft forward and the start-up warm-up.
The forward's view of vLLM's runner is `vllm_integration.draft_forward`.
"""
