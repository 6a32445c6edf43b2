# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Start-up is guarded: a failure while patching vLLM rolls back what was patched and refuses only
self-admg, and the proposer checks the version and the refusals again when the engine builds it,
so no spelling of the method gets around them. No engine is started here."""

import json
import re
import subprocess
import sys

import pytest

from vllm_selfspec.options import PROPOSER_PATH, SelfAdmgConfigError

# A patch that fails half-way through the plugin's start-up (after the front door, the
# scheduler's lookahead and the tenant patch are in place), in a fresh process.
FAILING_START = r"""
import json, logging, sys, typing
import vllm_selfspec.vllm_integration.sampling_params as sampling_params

def broken():
    raise RuntimeError("a patch target moved")

sampling_params.apply = broken
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm_selfspec.vllm_integration.patching import applied

engine = dict(model=sys.argv[1], dtype="float32", max_model_len=512)
plain = EngineArgs(**engine).create_engine_config()  # loads the plugin, which fails to patch
refusals = []
for spelling in (dict(speculative_config={"method": "self-admg"}),
                 dict(spec_model="vllm_selfspec.proposer.SelfAdmgProposer", spec_tokens=4)):
    try:
        EngineArgs(**engine, **spelling).create_engine_config()
        refusals.append(None)
    except Exception as err:
        refusals.append(f"{type(err).__name__}: {err}")
refused = refusals[0]
print("RESULT " + json.dumps(dict(
    plain_spec=plain.speculative_config is None, refused=refused, refusals=refusals,
    patched=sorted(p.target for p in applied()),
    method_choices=list(typing.get_args(SpeculativeConfig.__dataclass_fields__["method"].type.__args__[0])
                        if hasattr(SpeculativeConfig.__dataclass_fields__["method"].type, "__args__") else []))))
"""


def test_a_failed_patch_rolls_back_and_refuses_only_self_admg(tiny_model_path):
    run = subprocess.run(
        [sys.executable, "-c", FAILING_START, str(tiny_model_path)], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["plain_spec"]  # plain vLLM built its engine config
    assert result["refused"].startswith("SelfAdmgConfigError: self-admg is unavailable")
    assert "a patch target moved" in result["refused"]
    assert result["refusals"][1] == result["refused"]  # the proposer's class path too
    # Nothing of the half-applied start-up is left but the refusal and its one-line errors.
    assert result["patched"] == ["sys.excepthook", "vllm.engine.arg_utils.EngineArgs.create_speculative_config"]
    assert "self-admg" not in json.dumps(result["method_choices"])
    assert (run.stdout + run.stderr).count("its patches are rolled back") == 1  # one warning


def plain_engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="float32", max_model_len=512, **kwargs).create_engine_config()


def test_the_proposer_refuses_what_the_front_door_refuses(tiny_model_path):
    from vllm_selfspec.proposer import SelfAdmgProposer

    with pytest.raises(SelfAdmgConfigError, match="does not support LoRA"):
        SelfAdmgProposer(plain_engine_config(tiny_model_path, enable_lora=True))


def test_the_proposer_refuses_another_vllm_version(tiny_model_path, monkeypatch):
    import vllm

    from vllm_selfspec.proposer import SelfAdmgProposer

    config = plain_engine_config(tiny_model_path)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(SelfAdmgConfigError, match="needs vLLM 0.32.0, and vLLM 0.33.0"):
        SelfAdmgProposer(config)


def test_the_proposers_class_path_is_checked_like_self_admg(tiny_model_path):
    from vllm.engine.arg_utils import EngineArgs

    custom = {"method": "custom_class", "model": PROPOSER_PATH}
    with pytest.raises(SelfAdmgConfigError, match="attention_threshold"):
        EngineArgs(
            model=str(tiny_model_path),
            dtype="float32",
            max_model_len=512,
            speculative_config={**custom, "attention_threshold": 5.0},
        ).create_engine_config()
    with pytest.raises(SelfAdmgConfigError, match="does not support LoRA"):
        EngineArgs(
            model=str(tiny_model_path), dtype="float32", max_model_len=512, enable_lora=True, speculative_config=custom
        ).create_engine_config()


def test_the_proposer_refuses_to_run_without_its_patches_or_its_front_door(tiny_model_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec.proposer import SelfAdmgProposer
    from vllm_selfspec.vllm_integration import patching

    engine = dict(model=str(tiny_model_path), dtype="float32", max_model_len=512)
    config = EngineArgs(**engine, speculative_config={"method": "self-admg"}).create_engine_config()
    monkeypatch.setattr(patching, "_complete", False)
    with pytest.raises(SelfAdmgConfigError, match="patches of vLLM, which are not in place"):
        SelfAdmgProposer(config)
    monkeypatch.setattr(patching, "_complete", True)
    # vLLM's own custom_class with our class, the front door bypassed: no KV lookahead, no options.
    config.additional_config.pop("self_admg")
    with pytest.raises(SelfAdmgConfigError, match="got no checked options"):
        SelfAdmgProposer(config)


def test_the_plugin_loads_no_compiled_kernels_into_a_process_vllm_has_not_set_up():
    """The plugin loads in every vLLM process, workers before vLLM has set them up; numba
    (llvmlite) loaded then makes vLLM's CPU worker fail its start (its kernel registry scans
    every module's attributes, and llvmlite's library object answers any attribute): the
    kernels come with the proposer, after the worker's set-up."""
    probe = (
        "import sys, vllm_selfspec.plugin as plugin; plugin.register(); "
        "from vllm_selfspec.vllm_integration.patching import applied; "
        "print('PATCHED', len(applied()), 'LOADED', sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    patched = re.search(r"PATCHED (\d+) LOADED (.*)", run.stdout)
    assert patched, run.stdout[-2000:] + run.stderr[-2000:]
    assert int(patched[1]) > 5, "the plugin did not apply its patches: nothing was loaded to check"
    assert patched[2] == "[]", patched[2]
