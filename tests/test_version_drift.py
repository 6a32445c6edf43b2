# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""On a vLLM version the plugin was not written for, plain vLLM runs as if the plugin were
absent, and only a request for self-admg is refused, at start-up, naming the supported version.
The version is faked in one process that holds the whole engine (no engine subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import token_ids

pytestmark = pytest.mark.engine

SCRIPT = r"""
import json, sys
import vllm
vllm.__version__ = "0.33.0"
from vllm import LLM, SamplingParams
from vllm_selfspec.vllm_integration.patching import applied

engine = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=512,
              seed=0, distributed_executor_backend="uni")
llm = LLM(model=sys.argv[1], **engine)
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ids = [list(o.outputs[0].token_ids) for o in llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)]
try:
    LLM(model=sys.argv[1], speculative_config={"method": "self-admg"}, **engine)
    refused = None
except Exception as err:
    refused = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(dict(ids=ids, patched=[p.target for p in applied()], refused=refused)))
"""


def test_another_vllm_version_leaves_plain_vllm_alone(tiny_model_path, tiny_prompts, plain_tiny):
    from vllm import SamplingParams

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_path), json.dumps(tiny_prompts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    expected = token_ids(
        plain_tiny.generate(tiny_prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    )
    assert result["ids"] == expected
    # Nothing of vLLM is changed but the guard that refuses self-admg (and its one-line errors).
    assert sorted(result["patched"]) == ["sys.excepthook", "vllm.engine.arg_utils.EngineArgs.create_speculative_config"]
    assert result["refused"].startswith("SelfAdmgConfigError: self-admg needs vLLM 0.32.0, and vLLM 0.33.0")
    assert (run.stdout + run.stderr).count("is written for vLLM 0.32.0, not 0.33.0") == 1
