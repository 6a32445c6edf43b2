# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The five hand-offs to the self-admg proposer in vLLM 0.32's model runner (`GPUModelRunner`,
which `CPUModelRunner` inherits, so one patch covers both builds) and its worker. Runners whose
drafter is not a `SelfAdmgProposer` pass through unchanged.

1. `propose_draft_token_ids`: a bare custom_class proposer gets only token ids. Ours also needs
   the runner (block tables, attention builders, live requests), the scheduler output and this
   step's attention metadata.
2. `_update_states`: the scheduler's note for the step (`scheduler_note.SchedulerNote`: who
   waits, the new requests' tenants, prefix-cache resets) reaches the proposer in every step,
   whether or not the proposer runs in it (vLLM skips it near max_model_len), and the proposer
   counts the step, so that it knows when vLLM ran one without asking it for drafts.
3. `_on_request_state_removed`: a request's per-request state (mask, rates) is dropped in the
   same step as vLLM's own (finished, aborted or disconnected).
4. The worker's `sample_tokens`: the step's drafts ride on the output it returns, so that the
   engine core need not ask the workers for them in a call of its own (`draft_handoff`).
5. `_sample`: a step that verifies no draft at all (every row got none: the controller's usual
   answer at large batch) is sampled by the plain sampler. vLLM 0.32 sends every step of a
   speculative engine through `RejectionSampler` (`_prepare_inputs` builds spec-decode metadata
   even with zero drafts), whose recovered-token sampling over the vocabulary makes such a step
   dearer than plain decoding's, the more so at large batches at temperature > 0 on a CPU. With
   zero drafts it only samples one token per row from the target's distribution, which is what
   the plain sampler does (same logits, same per-request generators), so outputs are unchanged.

6. The worker's `sleep` empties the lookup history first: earlier outputs do not outlive the
   KV cache that vLLM discards.

Each hand-off that is ours is guarded: an exception in it is counted as a drafting fault and
the step goes on as vLLM's own (a request whose tenant was not attached is unknown and gets no
history; a step whose call for drafts failed verifies no drafts). The drafts' ride on the
sampled output is the exception: its fault costs only the round trip it saves (`draft_handoff`).

Installed from the proposer's constructor, so only worker processes import the runner.
"""

from vllm_selfspec.operations.fail_safe import fault_point
from vllm_selfspec.scheduler_note import note_of
from vllm_selfspec.vllm_integration import draft_handoff
from vllm_selfspec.vllm_integration.patching import original, patch


class HookedProposer:
    """A proposer this hook drives (`vllm_selfspec.proposer.SelfAdmgProposer`): it has
    `propose_for_runner`, `begin_step`, `forget`, `forget_history` and a `fail_safe`."""

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} is driven by vllm_selfspec's runner hook; it cannot run as a bare "
            "custom_class proposer (is the vllm_selfspec plugin loaded in this process?)"
        )


def _ours(runner) -> bool:
    return isinstance(getattr(runner, "drafter", None), HookedProposer)


def _guarded(runner, work) -> None:
    """`work()`; an exception is the proposer's fault to count, never vLLM's."""
    try:
        work()
    except Exception as err:
        runner.drafter.fail_safe.record(err)


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
            _guarded(self, lambda: self.drafter.begin_step(note_of(scheduler_output), self.requests))
        return result

    def _on_request_state_removed(self, req_id, req_state):
        original(Runner, "_on_request_state_removed")(self, req_id, req_state)
        if _ours(self):
            _guarded(self, lambda: (fault_point("request_removed"), self.drafter.forget(req_id, req_state)))

    def _sample(self, logits, spec_decode_metadata):
        if _ours(self) and spec_decode_metadata is not None:
            try:
                fault_point("sample")
                if spec_decode_metadata.max_spec_len == 0:
                    spec_decode_metadata = None  # nothing to verify: one token per row, as plain decoding
            except Exception as err:  # vLLM's rejection sampler serves the step, exactly, if dearer
                self.drafter.fail_safe.record(err)
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
        "hand the self-admg proposer the scheduler's note, in every step",
    )
    patch(
        Runner,
        "_on_request_state_removed",
        _on_request_state_removed,
        "drop a request's self-admg state with vLLM's own",
    )
    patch(Runner, "_sample", _sample, "sample a step with no draft as plain decoding does")
    _install_sleep()
    _install_draft_handoff()


def _install_draft_handoff() -> None:
    # (on the worker, not the runner, whose `sample_tokens` the CPU build's fixes wrap already)
    from vllm.v1.worker.gpu_worker import Worker

    def sample_tokens(self, *args, **kwargs):
        output = original(Worker, "sample_tokens")(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        if _ours(runner):
            draft_handoff.hand_over(runner, output)  # (guarded there: its fault costs no drafts)
        return output

    patch(Worker, "sample_tokens", sample_tokens, "send a step's drafts with its sampled tokens")


def _install_sleep() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    workers = [Worker]
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker

        workers.append(CPUWorker)
    except ImportError:  # a CUDA build
        pass
    for worker in workers:

        def sleep(self, *args, _worker=worker, **kwargs):
            runner = getattr(self, "model_runner", None)
            if _ours(runner):
                _guarded(runner, runner.drafter.forget_history)
            return original(_worker, "sleep")(self, *args, **kwargs)

        patch(worker, "sleep", sleep, "forget self-admg's lookup history when the worker sleeps")
