"""vLLM 0.32 CPU bug: a request with a `seed` whose prompt is prefilled in more than one chunk
crashes the engine ("RuntimeError: CPU Generator does not use offset"), with or without
speculation. Under load, any long prompt or a busy batch can split a prefill into chunks.

A partial-prefill step samples a token that is thrown away; the runner then rewinds that
request's generator with `gen.set_offset(gen.get_offset() - 4)`
(`GPUModelRunner._bookkeeping_sync`), which only CUDA's Philox generator supports. Fix, on CPU
only: for the length of `sample_tokens`, take those requests' generators out of the batch. Their
thrown-away sample is then drawn from the global generator and their own generator never moves,
which is exactly what the rewind means; the rewind loop finds nothing to do. Remove when vLLM
rewinds CPU generators.
"""

import numpy as np


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.sample_tokens
    if getattr(original, "_self_admg", False):
        return

    def sample_tokens(self, grammar_output):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
        parked = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return original(self, grammar_output)
        finally:
            generators.update(parked)

    sample_tokens._self_admg = True
    GPUModelRunner.sample_tokens = sample_tokens
