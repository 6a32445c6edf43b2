# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A step's drafts reach the engine core with its sampled tokens, not by a call of their own.

vLLM 0.32's engine core, scheduling synchronously (its CPU build always does), asks the workers
for a step's drafts after the step's sampled tokens came back (`EngineCore.post_step` calls the
executor's `take_draft_token_ids`): on the multiprocess executor, one more round trip through
shared memory on every step, drafting or not, with the engine waiting on it. Here the runner
attaches to the output its `sample_tokens` returns what `take_draft_token_ids()` returns then
(the call that round trip would make, on the same state: the worker runs nothing between the
two), the executor keeps it, and the engine core's `take_draft_token_ids` hands it over without
the call. A step whose output carries none (another method's runner, a hook that faulted, an
output vLLM shares between steps, a deferred output) asks the workers as vLLM does, and a step's
drafts are never an earlier step's: each `sample_tokens` drops what the last one kept.
Every executor of those classes is patched, a plain engine's too: there no output carries
drafts, and a step costs a dictionary lookup more.
"""

from __future__ import annotations

import logging

from vllm_selfspec.operations.fail_safe import fault_point
from vllm_selfspec.vllm_integration.patching import original, patch

logger = logging.getLogger("vllm.selfspec")

DRAFTS = "_self_admg_draft_token_ids"  # on a step's output, then on the executor until taken
_NOT_HANDED = object()


def hand_over(runner, output) -> None:
    """In the worker, once `sample_tokens` returned: the step's drafts on its output (`attach`),
    unless the option `drafts_with_output` is off. A fault here costs no drafts, only the round
    trip the hand-off saves (the engine core asks for them as vLLM does): it is counted
    (`draft_handoff_faults`) and logged, at WARNING the first time, and is no drafting fault."""
    try:
        if runner.drafter.options.drafts_with_output and attach(output, runner.take_draft_token_ids):
            runner.drafter.counters.drafts_handed_over += 1
    except Exception as err:
        try:
            counters = runner.drafter.counters
            counters.draft_handoff_faults += 1
            first = counters.draft_handoff_faults == 1
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "self-admg could not send a step's drafts with its sampled tokens; the engine core asks for them: %r",
                err,
                exc_info=err if first else None,
            )
        except Exception:  # (counting a fault must not raise into vLLM either)
            pass


def attach(output, take_draft_token_ids) -> bool:
    """In the worker: the step's drafts (`take_draft_token_ids()`, None for none) on `output`,
    if it is this step's own `ModelRunnerOutput` (vLLM returns one shared empty output for
    steps that sample nothing: it is left alone); whether they were put there."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if type(output) is not ModelRunnerOutput or output is EMPTY_MODEL_RUNNER_OUTPUT:
        return False
    fault_point("draft_handoff")
    output.__dict__[DRAFTS] = take_draft_token_ids()
    return True


def apply() -> None:
    """In the engine core: the executors keep the drafts a step's output carries, and hand
    them over when the engine core asks."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    for executor in (MultiprocExecutor, UniProcExecutor):

        def sample_tokens(self, *args, _executor=executor, **kwargs):
            self.__dict__.pop(DRAFTS, None)
            output = original(_executor, "sample_tokens")(self, *args, **kwargs)
            handed = getattr(output, "__dict__", {}).pop(DRAFTS, _NOT_HANDED)  # (a deferred output: none)
            if handed is not _NOT_HANDED:
                self.__dict__[DRAFTS] = handed
            return output

        def take_draft_token_ids(self, _executor=executor):
            handed = self.__dict__.pop(DRAFTS, _NOT_HANDED)
            if handed is _NOT_HANDED:
                return original(_executor, "take_draft_token_ids")(self)
            return handed

        why = "take a step's drafts from its sampled output rather than by one more call to the workers"
        patch(executor, "sample_tokens", sample_tokens, why)
        patch(executor, "take_draft_token_ids", take_draft_token_ids, why)
