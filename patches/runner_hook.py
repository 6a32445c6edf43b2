"""Give the self-admg proposer the model runner, and tell it when a request is gone.

A bare custom_class proposer gets only token ids (`GPUModelRunner.propose_draft_token_ids`,
vLLM 0.32). Ours also needs the runner (block tables, attention builders, live requests), the
scheduler output (finished requests) and this step's attention metadata, so this wraps the
method for runners whose drafter is a `SelfAdmgProposer`; other methods pass through unchanged.
It also wraps the runner's per-request clean-up hook, so a request's skip mask is dropped in the
same step as vLLM's own state for it (finished, aborted or disconnected).
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

    propose_draft_token_ids._self_admg = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._on_request_state_removed = _on_request_state_removed
