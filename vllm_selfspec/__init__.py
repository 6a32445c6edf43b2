# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""vllm-selfspec: self-speculative decoding with an adaptive draft model ("self-admg") for vLLM.

Install it next to vLLM 0.32 and ask for the method by name:

    LLM(model=..., speculative_config={"method": "self-admg"})  # K = 8 draft tokens at most, by default
    vllm serve MODEL --speculative-config '{"method": "self-admg"}'

vLLM loads the plugin by itself (entry point `vllm.general_plugins`, `plugin.register`); the
options are in `vllm_selfspec.options`. The package's parts:
- proposer: the step loop; draft_pipeline, its model-free stages (read, learn, look up, offer,
  plan); scheduler_note, the scheduler's note to the workers;
- sources: drafts that cost no forward (lookup in the context and earlier outputs, predictions);
- self_drafting: drafting with the target's own layers under skip masks (ADMG);
- control: step costs, acceptance, the plan of how much to draft, what a step taught
  (learning) and the first-token rule;
- operations: the fail-safe (a fault in drafting costs a step's drafts on every rank alike,
  never a request), counters, metrics and the worker extension, for operators and the lab;
- vllm_integration: everything that knows vLLM's internals, and every patch.
"""

from vllm_selfspec.sources.prediction import with_prediction

__all__ = ["with_prediction"]
__version__ = "0.1.0"
