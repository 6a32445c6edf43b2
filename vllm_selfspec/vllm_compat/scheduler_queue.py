"""The scheduler's part in keeping first tokens as early as plain decoding's (self-admg servers).

A prompt's first token comes out of the step that prefills it, so drafts verified in that step
delay it by their verification. When a step will prefill (a request waits for admission and
there is room to admit it, or a prompt is being prefilled in chunks), the requests running
beside it verify no drafts in that step: they lose one step's drafts, which is lossless, and the
step costs what plain decoding's does. Offline batches (`self_admg_closed_batches`) keep their
drafts: there a first token is worth nothing before the batch's end.

The worker plans the next step's drafts and needs to know when a prompt will wait for that
step too (`control.planner`), but vLLM 0.32's `SchedulerOutput` says nothing of the queue.
`schedule` attaches the number of requests left waiting after this step's admissions as one
extra attribute, which pickling carries to the workers. Requests that wait for a free slot
(the running batch is full) are not counted: they wait for requests to finish, which drafts
hasten.
"""

from vllm_selfspec.options import CLOSED_BATCHES_KEY
from vllm_selfspec.vllm_compat.patching import original, patch
from vllm_selfspec.vllm_compat.scheduler_lookahead import is_self_admg_config

ATTRIBUTE = "self_admg_waiting"


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self, *args, **kwargs):
        if not is_self_admg_config(self.vllm_config.speculative_config):
            return original(Scheduler, "schedule")(self, *args, **kwargs)
        withhold_drafts_beside_prefill(self)
        output = original(Scheduler, "schedule")(self, *args, **kwargs)
        setattr(output, ATTRIBUTE, _admissible_waiting(self))
        return output

    patch(
        Scheduler,
        "schedule",
        schedule,
        "no drafts verified beside a prefill in self-admg servers; tell the workers how many requests wait",
    )


def withhold_drafts_beside_prefill(scheduler) -> bool:
    """Clear the running requests' drafts if this step will prefill, in a server; whether it did."""
    if (scheduler.vllm_config.additional_config or {}).get(CLOSED_BATCHES_KEY):
        return False
    if not (_admissible_waiting(scheduler) or any(request.is_prefill_chunk for request in scheduler.running)):
        return False
    for request in scheduler.running:
        request.spec_token_ids = []  # (vLLM clears them too once they are scheduled)
    return True


def _admissible_waiting(scheduler) -> int:
    """Requests waiting for admission while the running batch has room for them."""
    running, waiting = scheduler.get_request_counts()
    return waiting if running < scheduler.max_num_running_reqs else 0


def waiting_requests(scheduler_output) -> int:
    """Requests left waiting after the step's admissions, with room to admit them (0 if the
    scheduler did not say)."""
    return getattr(scheduler_output, ATTRIBUTE, 0)
