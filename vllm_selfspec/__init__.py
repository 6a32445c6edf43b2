"""vllm-selfspec: self-speculative decoding with an adaptive draft model ("self-admg") for vLLM.

Install it next to vLLM 0.32 and ask for the method by name:

    LLM(model=..., speculative_config={"method": "self-admg", "num_speculative_tokens": 4})
    vllm serve MODEL --speculative-config '{"method": "self-admg"}'

vLLM loads the plugin by itself (entry point `vllm.general_plugins`); the options are in
`vllm_selfspec.options`.
"""

from vllm_selfspec.options import METHOD_NAME, SelfAdmgOptions

__all__ = ["METHOD_NAME", "SelfAdmgOptions"]
__version__ = "0.1.0"
