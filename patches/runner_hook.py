"""Give the self-admg proposer the model runner, and tell it when a request is gone.

A bare custom_class proposer gets only token ids (`GPUModelRunner.propose_draft_token_ids`,
vLLM 0.32). Ours also needs the runner (block tables, attention builders, live requests), the
scheduler output (finished requests) and this step's attention metadata, so this wraps the
method for runners whose drafter is a `SelfAdmgProposer`; other methods pass through unchanged.
It also wraps the runner's per-request clean-up hook, so a request's skip mask is dropped in the
same step as vLLM's own state for it (finished, aborted or disconnected).
And a step that verifies no draft at all (every row got none: the controller's usual answer
at large batch) is sampled by the plain sampler instead of the rejection sampler. vLLM 0.32
sends every step of a speculative engine through `RejectionSampler` (`_prepare_inputs` builds
spec-decode metadata even with zero drafts), whose recovered-token sampling over the vocabulary
made such a step 5-8% dearer than plain decoding's at batch 32, temperature 1, here; with zero
drafts it only samples one token per row from the target's distribution, which is what the plain
sampler does (same logits, same per-request generators), so outputs are unchanged.
Installed lazily from the proposer's constructor, so only worker processes import the runner.
`CPUModelRunner` inherits the method, so one patch covers both builds.
"""


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_self_admg", False):
        return

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        from vllm_selfspec.proposer import SelfAdmgProposer

        if not isinstance(self.drafter, SelfAdmgProposer):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            spec_decode_metadata, common_attn_metadata, slot_mappings)
        # Greedy drafts: no draft probabilities, the rejection sampler treats them as point masses.
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return self.drafter.propose_for_runner(self, scheduler_output, sampled_token_ids,
                                               common_attn_metadata)

    original_removed = GPUModelRunner._on_request_state_removed

    def _on_request_state_removed(self, req_id, req_state):
        from vllm_selfspec.proposer import SelfAdmgProposer

        original_removed(self, req_id, req_state)
        if isinstance(getattr(self, "drafter", None), SelfAdmgProposer):
            self.drafter.forget(req_id, req_state)

    original_sample = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        from vllm_selfspec.proposer import SelfAdmgProposer

        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and isinstance(getattr(self, "drafter", None), SelfAdmgProposer)):
            spec_decode_metadata = None  # nothing to verify: one token per row, as plain decoding
        return original_sample(self, logits, spec_decode_metadata)

    propose_draft_token_ids._self_admg = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._on_request_state_removed = _on_request_state_removed
    GPUModelRunner._sample = _sample
