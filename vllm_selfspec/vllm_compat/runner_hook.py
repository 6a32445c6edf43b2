"""The model runner's four hand-offs to the self-admg proposer (vLLM 0.32's `GPUModelRunner`,
which `CPUModelRunner` inherits, so one patch covers both builds). Runners whose drafter is not
a `SelfAdmgProposer` pass through unchanged.

1. `propose_draft_token_ids`: a bare custom_class proposer gets only token ids. Ours also needs
   the runner (block tables, attention builders, live requests), the scheduler output and this
   step's attention metadata.
2. `_update_states`: each request's tenant is attached to the runner's state of it in the step
   that admits it, whether or not the proposer runs in that step (`request_tenant`), and the
   proposer counts the step, so that it knows when vLLM ran one without asking it for drafts.
3. `_on_request_state_removed`: a request's per-request state (mask, rates) is dropped in the
   same step as vLLM's own (finished, aborted or disconnected).
4. `_sample`: a step that verifies no draft at all (every row got none: the controller's usual
   answer at large batch) is sampled by the plain sampler. vLLM 0.32 sends every step of a
   speculative engine through `RejectionSampler` (`_prepare_inputs` builds spec-decode metadata
   even with zero drafts), whose recovered-token sampling over the vocabulary makes such a step
   5-8% dearer than plain decoding's at batch 32, temperature 1, on a CPU. With zero drafts it
   only samples one token per row from the target's distribution, which is what the plain
   sampler does (same logits, same per-request generators), so outputs are unchanged.

Installed from the proposer's constructor, so only worker processes import the runner.
"""

from vllm_selfspec.vllm_compat.patching import original, patch
from vllm_selfspec.vllm_compat.request_tenant import remember_tenants


def _ours(runner) -> bool:
    from vllm_selfspec.proposer import SelfAdmgProposer

    return isinstance(getattr(runner, "drafter", None), SelfAdmgProposer)


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        slot_mappings,
    ):
        if not _ours(self):
            return original(Runner, "propose_draft_token_ids")(
                self,
                scheduler_output,
                sampled_token_ids,
                sampling_metadata,
                hidden_states,
                sample_hidden_states,
                aux_hidden_states,
                spec_decode_metadata,
                common_attn_metadata,
                slot_mappings,
            )
        # Drafts are point masses (greedy or looked up): no draft probabilities.
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return self.drafter.propose_for_runner(self, scheduler_output, sampled_token_ids, common_attn_metadata)

    def _update_states(self, scheduler_output, *args, **kwargs):
        result = original(Runner, "_update_states")(self, scheduler_output, *args, **kwargs)
        if _ours(self):
            remember_tenants(self, scheduler_output)
            self.drafter.note_step()
        return result

    def _on_request_state_removed(self, req_id, req_state):
        original(Runner, "_on_request_state_removed")(self, req_id, req_state)
        if _ours(self):
            self.drafter.forget(req_id, req_state)

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0 and _ours(self):
            spec_decode_metadata = None  # nothing to verify: one token per row, as plain decoding
        return original(Runner, "_sample")(self, logits, spec_decode_metadata)

    patch(
        Runner,
        "propose_draft_token_ids",
        propose_draft_token_ids,
        "hand the self-admg proposer the runner, scheduler output and attention metadata",
    )
    patch(
        Runner,
        "_update_states",
        _update_states,
        "attach each admitted request's tenant to the runner's state of it, in every step",
    )
    patch(
        Runner,
        "_on_request_state_removed",
        _on_request_state_removed,
        "drop a request's self-admg state with vLLM's own",
    )
    patch(Runner, "_sample", _sample, "sample a step with no draft as plain decoding does")
