"""vllm-selfspec: self-speculative decoding with an adaptive draft model ("self-admg") for vLLM.

Install it next to vLLM 0.32 and ask for the method by name:

    LLM(model=..., speculative_config={"method": "self-admg", "num_speculative_tokens": 4})
    vllm serve MODEL --speculative-config '{"method": "self-admg"}'

vLLM loads the plugin by itself (entry point `vllm.general_plugins`, `plugin.register`); the
options are in `vllm_selfspec.options`. The package's parts:
- proposer: the step loop (learn, offer lookup drafts, plan, self-draft, return drafts);
- self_draft, residual_stream, admg: drafting with the target's own layers under skip masks;
- lookup: drafts from the context and earlier outputs;
- control: step costs, acceptance and the plan of how much to draft;
- report: counters and the server's state endpoint;
- vllm_compat: everything that knows vLLM's internals, and every patch.
"""

__version__ = "0.1.0"
