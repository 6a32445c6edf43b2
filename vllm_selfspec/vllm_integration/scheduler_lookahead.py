# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Reserve K KV slots past the verified range for self-admg's draft KV.

vLLM 0.32 reserves lookahead slots only for eagle and draft_model (`VllmConfig.
num_lookahead_tokens`); for custom_class it returns 0, so the draft's KV at positions
q..q+K-1 would have no slots. The scheduler and the worker warm-up both read this property.
"""

from vllm_selfspec.options import PROPOSER_PATH
from vllm_selfspec.vllm_integration.patching import patch


def is_self_admg_config(speculative_config) -> bool:
    return (
        speculative_config is not None
        and speculative_config.method == "custom_class"
        and speculative_config.model == PROPOSER_PATH
    )


def apply() -> None:
    from vllm.config import VllmConfig

    vllm_lookahead = VllmConfig.num_lookahead_tokens.fget

    def num_lookahead_tokens(self) -> int:
        if is_self_admg_config(self.speculative_config):
            return self.num_speculative_tokens
        return vllm_lookahead(self)

    patch(
        VllmConfig,
        "num_lookahead_tokens",
        property(num_lookahead_tokens, doc=vllm_lookahead.__doc__),
        "reserve K slots past the verified range for the draft's KV",
    )
