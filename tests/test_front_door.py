# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Every spelling of self-admg reaches vLLM as our proposer, and bad input fails early with a
message that names the option and what is allowed. No engine is started here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_selfspec.options import (
    ADDITIONAL_CONFIG_KEY,
    CLOSED_BATCHES_KEY,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    PROPOSER_PATH,
    SelfAdmgConfigError,
)

VLLM = str(Path(sys.executable).parent / "vllm")


def engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="float32", max_model_len=512, **kwargs).create_engine_config()


def cli_engine_config(model, *argv):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model), "--dtype", "float32", "--max-model-len", "512", *argv])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def assert_self_admg(config, k):
    spec = config.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("custom_class", PROPOSER_PATH, k)
    assert ADDITIONAL_CONFIG_KEY in config.additional_config
    # The lookahead patch: the scheduler reserves K slots past the verified range for draft KV.
    assert config.num_lookahead_tokens == k
    return config.additional_config[ADDITIONAL_CONFIG_KEY]


@pytest.mark.parametrize(
    "argv, k",
    [
        (["--speculative-config", '{"method": "self-admg", "num_speculative_tokens": 3}'], 3),
        (["-sc", '{"model": "self-admg"}'], DEFAULT_NUM_SPECULATIVE_TOKENS),
        (["--spec-method", "self-admg", "--spec-tokens", "2"], 2),
        (["--speculative-model", "self-admg", "--num-speculative-tokens", "5"], 5),
        (["--speculative-model", "self-admg"], DEFAULT_NUM_SPECULATIVE_TOKENS),
    ],
)
def test_cli_spellings(tiny_model_path, argv, k):
    assert_self_admg(cli_engine_config(tiny_model_path, *argv), k)


def test_python_spellings_and_options(tiny_model_path):
    options = assert_self_admg(
        engine_config(
            tiny_model_path,
            speculative_config={
                "method": "self-admg",
                "num_speculative_tokens": 3,
                "skip": "attention",
                "attention_threshold": 0.9,
            },
        ),
        3,
    )
    assert options["skip"] == "attention" and options["attention_threshold"] == 0.9
    assert_self_admg(engine_config(tiny_model_path, spec_method="self-admg", spec_tokens=2), 2)


def test_only_offline_batches_are_planned_to_end_together(tiny_model_path):
    """The offline LLM class and `vllm run-batch` wait for whole batches; a server never does."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    def closed(usage_context):
        args = EngineArgs(
            model=str(tiny_model_path), dtype="float32", max_model_len=512, speculative_config={"method": "self-admg"}
        )
        return args.create_engine_config(usage_context).additional_config[CLOSED_BATCHES_KEY]

    assert closed(UsageContext.LLM_CLASS) and closed(UsageContext.OPENAI_BATCH_RUNNER)
    assert not closed(UsageContext.OPENAI_API_SERVER) and not closed(None)
    # vLLM copies engine arguments by vars() (LLM.from_engine_args): nothing of ours is left there.
    args = EngineArgs(model=str(tiny_model_path), dtype="float32", max_model_len=512)
    args.create_engine_config(UsageContext.LLM_CLASS)
    EngineArgs(**vars(args))


def test_only_an_api_server_that_serves_its_engines_makes_a_metrics_directory(tiny_model_path, monkeypatch):
    """A headless node's engines are served by an API server elsewhere: it makes no directory."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_selfspec.operations import metrics

    served = []
    monkeypatch.setattr(metrics, "serve_on_prometheus", lambda: served.append(1))
    for headless in (True, False):
        args = EngineArgs(
            model=str(tiny_model_path), dtype="float32", max_model_len=512, speculative_config={"method": "self-admg"}
        )
        args.create_engine_config(UsageContext.OPENAI_API_SERVER, headless=headless)
        assert len(served) == (0 if headless else 1)


def test_other_methods_pass_through_untouched(tiny_model_path):
    config = engine_config(
        tiny_model_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    )
    assert config.speculative_config.method == "ngram"
    assert config.num_lookahead_tokens == 0
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"method": "self-admg", "attention_threshold": 2}, "'attention_threshold' must be in [-1.0, 1.0]"),
        ({"method": "self-admg", "thresold": 0.9}, "unknown self-admg option(s) ['thresold']"),
        ({"method": "self-admg", "skip": "everything"}, "'skip' must be one of"),
        ({"method": "self-admg", "num_speculative_tokens": 99}, "'num_speculative_tokens' must be in [1, 32]"),
    ],
)
def test_bad_options_fail_before_the_engine(tiny_model_path, spec, fragment):
    with pytest.raises(SelfAdmgConfigError) as err:
        engine_config(tiny_model_path, speculative_config=spec)
    assert fragment in str(err.value)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(SelfAdmgConfigError) as err:
        engine_config(tmp_path, speculative_config={"method": "self-admg"}, skip_tokenizer_init=True)
    assert "does not support the model architecture ['GPT2LMHeadModel']" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)


def test_pipeline_parallel_is_refused(tiny_model_path):
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec.vllm_integration.front_door import check_supported

    model_config = EngineArgs(model=str(tiny_model_path)).create_model_config()
    parallel = ParallelConfig(pipeline_parallel_size=2)
    with pytest.raises(SelfAdmgConfigError) as err:
        check_supported(EngineArgs(model=str(tiny_model_path)), model_config, parallel)
    assert "pipeline_parallel_size=2 is not supported (allowed: 1" in str(err.value)


def test_lora_is_refused(tiny_model_path):
    with pytest.raises(SelfAdmgConfigError, match="does not support LoRA"):
        engine_config(tiny_model_path, enable_lora=True, speculative_config={"method": "self-admg"})


def test_vllm_console_script_works_and_refuses_bad_options(tiny_model_path):
    """The plain `vllm` command runs on the CPU build (set-up repair) and a bad option stops
    `vllm serve` before any engine starts, with the option named in the output."""
    out = subprocess.run([VLLM, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().startswith("0.32.0"), out.stderr[-2000:]
    bad = json.dumps({"method": "self-admg", "mlp_threshold": 7})
    out = subprocess.run(
        [VLLM, "serve", str(tiny_model_path), "--speculative-config", bad, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert out.returncode != 0
    assert "'mlp_threshold' must be in [-1.0, 1.0], got 7" in out.stdout + out.stderr


@pytest.mark.parametrize(
    "engine_kwargs, fragment",
    [
        (dict(model_impl="transformers"), "model_impl='transformers' is not supported (allowed: 'auto' or 'vllm')"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8' is not supported (allowed: 'auto')"),
        (dict(kv_offloading_size=1.0), "kv_transfer_config and kv_offloading_size must be unset"),
    ],
)
def test_set_ups_the_draft_path_does_not_handle_are_refused(tiny_model_path, engine_kwargs, fragment):
    with pytest.raises(SelfAdmgConfigError, match="^self-admg: ") as err:
        engine_config(tiny_model_path, speculative_config={"method": "self-admg"}, **engine_kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_sliding_windows_context_parallelism_and_quantization_are_refused(tiny_model_path):
    import dataclasses as dc

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec.vllm_integration.front_door import unsupported_reasons

    args = EngineArgs(model=str(tiny_model_path))
    model_config = args.create_model_config()
    assert unsupported_reasons(args, model_config, ParallelConfig()) == []

    class SlidingWindow(type(model_config)):
        def get_sliding_window(self):
            return 64

    windowed = object.__new__(SlidingWindow)
    windowed.__dict__.update(model_config.__dict__)
    assert any("sliding-window" in r for r in unsupported_reasons(args, windowed, ParallelConfig()))
    dcp = dc.replace(ParallelConfig(), tensor_parallel_size=2, decode_context_parallel_size=2)
    assert any("decode_context_parallel_size must be 1" in r for r in unsupported_reasons(args, model_config, dcp))
    model_config.quantization = "gptq"
    reasons = unsupported_reasons(args, model_config, ParallelConfig())
    assert any("quantization='gptq' is not supported" in r for r in reasons)
