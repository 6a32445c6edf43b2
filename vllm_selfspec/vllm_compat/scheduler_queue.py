"""Tell the worker how many requests wait to be admitted, with each step's scheduler output.

At capacity a step that drafts is longer than one that does not, and every request still in the
scheduler's waiting queue waits that much longer for its first token. The planner prices that
wait (`control.planner`), but the worker sees only the requests that run: vLLM 0.32's
`SchedulerOutput` says nothing of the queue. The scheduler's `schedule` attaches the number left
waiting after this step's admissions as one extra attribute, which pickling carries to the
workers, for self-admg engines only.
"""

from vllm_selfspec.vllm_compat.patching import original, patch
from vllm_selfspec.vllm_compat.scheduler_lookahead import is_self_admg_config

ATTRIBUTE = "self_admg_waiting"


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self, *args, **kwargs):
        output = original(Scheduler, "schedule")(self, *args, **kwargs)
        if is_self_admg_config(self.vllm_config.speculative_config):
            _, waiting = self.get_request_counts()
            setattr(output, ATTRIBUTE, waiting)
        return output

    patch(Scheduler, "schedule", schedule, "tell self-admg's workers how many requests wait to be admitted")


def waiting_requests(scheduler_output) -> int:
    """Requests left waiting after the step's admissions (0 if the scheduler did not say)."""
    return getattr(scheduler_output, ATTRIBUTE, 0)
