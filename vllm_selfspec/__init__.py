# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""vllm-selfspec: self-speculative decoding with an adaptive draft model ("self-admg") for vLLM.

Install it next to vLLM 0.32 and ask for the method by name:

    LLM(model=..., speculative_config={"method": "self-admg"})  # K = 8 draft tokens at most, by default
    vllm serve MODEL --speculative-config '{"method": "self-admg"}'

vLLM loads the plugin by itself (entry point `vllm.general_plugins`, `plugin.register`); the
options are in `vllm_selfspec.options`. The package's parts:
- proposer: the step loop; draft_pipeline, its model-free stages (read, learn, look up, offer,
  plan), with learning (what a step taught), row_lookup (per request: tenant, quarantine,
  history), first_tokens (the first-token rule) and scheduler_note (the scheduler's note to
  the workers);
- self_draft, residual_stream, admg: drafting with the target's own layers under skip masks;
- lookup: drafts from the context and earlier outputs;
- control: step costs, acceptance and the plan of how much to draft;
- fail_safe: a fault in drafting costs a step's drafts on every rank alike, never a request;
- counters, metrics, worker_extension: what the proposer did, for operators and the lab;
- vllm_integration: everything that knows vLLM's internals, and every patch.
"""

from vllm_selfspec.prediction import with_prediction

__all__ = ["with_prediction"]
__version__ = "0.1.0"
