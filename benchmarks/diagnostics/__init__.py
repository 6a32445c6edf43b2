# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""One-question measurements behind particular claims, each cited by a doc or used by a test.
Run as `python -m benchmarks.diagnostics.NAME --help`. The index, one line each (a test keeps it
in step with this folder; diagnostics no doc cites any more are in git history):

- `first_token_wait`: where a first token waits under load, the step in progress or its own.
- `first_wave`: the first tokens of a wave of prompts sent at once, plain against self-admg.
- `host_time_ab`: two checkouts' proposer host time, step by step in one process, and their plans.
- `lookup_bound`: what one lookup costs on hostile contexts against ordinary ones.
- `lookup_replay`: self-admg's lookup drafts against vLLM's `suffix` on served requests.
- `prefill_steps`: each server's prefill steps against plain's, from the step logs.
- `request_losses`: where a request slower than under plain loses: prefill steps or the others.
- `row_rule`: at capacity, the per-row rule's cost to the batch and what it saves each request.
- `selection_quality`: draft/target agreement for ADMG's, a static and a random selection.
- `step_costs`: what a verification step costs by what it carries (the cost model's check).
- `step_fit`: whether the controller's step-cost fit holds on a server's timed steps.
- `step_split`: time per token split into step length and tokens per step.
- `tie_margin`: whether a temperature-0 mismatch is a near-tie (plain's top-2 log-probabilities).
"""
