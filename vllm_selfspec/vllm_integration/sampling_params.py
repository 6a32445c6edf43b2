# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Serve `min_p` and `logit_bias` with self-admg exactly as plain decoding does.

vLLM 0.32 refuses both with any speculative method (`SamplingParams._validate_spec_decode`,
HTTP 400) and builds only the min-tokens logits processor for a speculative engine, because its
rejection sampler does not apply the others at draft positions. Self-admg gives a row that uses
either no drafts (`runner_state.StepRow.may_draft`), so each of its tokens is sampled by vLLM's
`Sampler` (the plain sampler, or the rejection sampler's bonus-token sampler, one logit row per
request), which applies every logits processor as plain decoding does. For a self-admg engine,
then, the check lets them through and the runner gets vLLM's built-in processors.
"""

from vllm_selfspec.vllm_integration.patching import original, patch
from vllm_selfspec.vllm_integration.scheduler_lookahead import is_self_admg_config


def apply() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample import logits_processor
    from vllm.v1.worker import gpu_model_runner

    def _validate_spec_decode(self, speculative_config):
        if is_self_admg_config(speculative_config):
            return
        return original(SamplingParams, "_validate_spec_decode")(self, speculative_config)

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if is_self_admg_config(vllm_config.speculative_config) and not is_pooling_model and not custom_logitsprocs:
            return logits_processor.LogitsProcessors(
                ctor(vllm_config, device, is_pin_memory) for ctor in logits_processor.BUILTIN_LOGITS_PROCESSORS
            )
        return original(gpu_model_runner, "build_logitsprocs")(
            vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs
        )

    patch(
        SamplingParams,
        "_validate_spec_decode",
        _validate_spec_decode,
        "accept min_p and logit_bias: self-admg serves such rows without drafts",
    )
    patch(
        gpu_model_runner,
        "build_logitsprocs",
        build_logitsprocs,
        "give a self-admg engine vLLM's built-in logits processors (min_p, logit_bias)",
    )


def needs_plain_sampling(params) -> bool:
    """Whether a request's tokens must all come from the plain sampler (no drafts): min_p and
    logit_bias, which only it applies; and a seed at temperature > 0, so that the seed gives
    plain decoding's output exactly, whatever the batch, prediction or drafts (a verified draft
    changes which of the seed's random numbers pick which token; a row without drafts draws
    none in verification, vLLM's rejection sampler skipping it)."""
    if params is None:
        return False
    seeded_sample = params.seed is not None and params.temperature > 1e-5
    return params.min_p > 1e-5 or bool(params.logit_bias) or seeded_sample
