"""The options of the self-admg method: names, defaults, allowed values, and one parser.

Users pass them inside vLLM's speculative config, next to vLLM's own keys:

    {"method": "self-admg", "num_speculative_tokens": 4, "attention_threshold": 0.98}

`parse_speculative_config` splits such a dict into vLLM's part and ours and validates ours,
raising `SelfAdmgConfigError` (a `ValueError`) that names the option and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

METHOD_NAME = "self-admg"
PROPOSER_PATH = "vllm_selfspec.proposer.SelfAdmgProposer"
ADDITIONAL_CONFIG_KEY = "self_admg"
DEFAULT_NUM_SPECULATIVE_TOKENS = 4

SKIP_CHOICES = ("attention", "attention+mlp")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# vLLM speculative-config keys that mean nothing for a self-draft; rejected rather than ignored.
FOREIGN_VLLM_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "revision")


class SelfAdmgConfigError(ValueError):
    """A bad self-admg option or an unsupported set-up, reported before the engine starts."""


@dataclass(frozen=True)
class SelfAdmgOptions:
    """How each sequence's draft model is chosen and run. Every field is a user option.

    The defaults were the best of the settings tried on SmolLM2-135M-Instruct, HumanEval, batch
    1, bfloat16 (acceptance 81%); see README for what they measure and benchmarks/ for sweeps.
    """

    skip: str = field(
        default="attention+mlp",
        metadata={"help": "which sublayers a draft may skip: 'attention' (the paper) or "
                          "'attention+mlp'"},
    )
    attention_threshold: float = field(
        default=0.99,
        metadata={"help": "skip an attention sublayer when the prompt's mean cosine similarity "
                          "of the residual stream before and after it is above this (-1..1)"},
    )
    mlp_threshold: float = field(
        default=0.975,
        metadata={"help": "the same for MLP sublayers (used with skip='attention+mlp')"},
    )
    keep_edge_layers: int = field(
        default=1,
        metadata={"help": "structural rule 1: never skip anything in the first and the last "
                          "N decoder layers (0 turns the rule off)"},
    )
    fill_gaps: int = field(
        default=1,
        metadata={"help": "structural rule 2: also skip a kept sublayer when sublayers of the "
                          "same kind are skipped within N layers on both sides (0 = off)"},
    )
    draft_exit_threshold: float = field(
        default=0.5,
        metadata={"help": "stop a sequence's draft when the draft's top-1 probability falls "
                          "below this (0 = always draft num_speculative_tokens)"},
    )
    stats_window: int = field(
        # Not the paper's whole prompt: the probe runs eagerly, so over a 1000-token news prompt
        # it cost 3 s, more than the drafts it enabled saved (NOTES, attempt 10).
        default=32,
        metadata={"help": "measure similarities over the last N prompt tokens (0 = the whole "
                          "prompt, as in the paper)"},
    )
    skip_budget: float = field(
        default=0.0,
        metadata={"help": "instead of the thresholds: skip the sublayers that change the stream "
                          "least per weight byte until this share of the layers' bytes is saved "
                          "(0 = use the thresholds, as in the paper)"},
    )
    draft_vocab: int = field(
        default=32768,
        metadata={"help": "the draft's LM head scores only the first N token ids plus those in "
                          "the sequence's context, saving most of the head's weight reads (0 = "
                          "the whole vocabulary)"},
    )
    lookup_ngram: int = field(
        default=24,
        metadata={"help": "draft by lookup, following the earlier occurrences of the context's "
                          "last 1..N tokens, and with the model itself where lookup offers "
                          "nothing (0 = self-drafts only)"},
    )
    lookup_history: int = field(
        default=65536,
        metadata={"help": "look up in the outputs of earlier requests too, keeping the last N "
                          "tokens of them (0 = the row's own context only)"},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "draft only as many tokens as measured step costs and acceptance say "
                          "pay, down to none (false = always draft num_speculative_tokens)"},
    )

    @property
    def skips_mlp(self) -> bool:
        return self.skip == "attention+mlp"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SelfAdmgOptions))


def describe_options() -> str:
    """One line per option with its default, for error messages and --help text."""
    lines = [f"  {f.name} (default {f.default!r}): {f.metadata['help']}"
             for f in dataclasses.fields(SelfAdmgOptions)]
    lines.append(f"  num_speculative_tokens (default {DEFAULT_NUM_SPECULATIVE_TOKENS}): maximum "
                 "draft length, 1..32")
    return "\n".join(lines)


def _number(name: str, value: Any, kind: type, low: float, high: float) -> Any:
    # bool is an int subclass; "True" as a threshold is a typo, not 1.
    ok_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise SelfAdmgConfigError(
            f"self-admg option {name!r} must be {'an integer' if kind is int else 'a number'} "
            f"in [{low}, {high}], "
            f"got {value!r}"
        )
    if not (low <= value <= high) or (isinstance(value, float) and math.isnan(value)):
        raise SelfAdmgConfigError(
            f"self-admg option {name!r} must be in [{low}, {high}], got {value!r}"
        )
    return kind(value)


def make_options(raw: dict[str, Any]) -> SelfAdmgOptions:
    """Validate user options (only self-admg's own keys) into `SelfAdmgOptions`."""
    unknown = sorted(set(raw) - set(OPTION_NAMES))
    if unknown:
        raise SelfAdmgConfigError(
            f"unknown self-admg option(s) {unknown}; allowed options are:\n{describe_options()}"
        )
    values = dict(raw)
    if "skip" in values and values["skip"] not in SKIP_CHOICES:
        raise SelfAdmgConfigError(
            f"self-admg option 'skip' must be one of {list(SKIP_CHOICES)}, got {values['skip']!r}"
        )
    for name in ("attention_threshold", "mlp_threshold"):
        if name in values:
            values[name] = _number(name, values[name], float, -1.0, 1.0)
    if "skip_budget" in values:
        values["skip_budget"] = _number("skip_budget", values["skip_budget"], float, 0.0, 0.95)
    if "draft_exit_threshold" in values:
        values["draft_exit_threshold"] = _number(
            "draft_exit_threshold", values["draft_exit_threshold"], float, 0.0, 1.0)
    for name in ("keep_edge_layers", "fill_gaps", "stats_window", "draft_vocab"):
        if name in values:
            values[name] = _number(name, values[name], int, 0, 1_000_000)
    if "lookup_history" in values:
        values["lookup_history"] = _number("lookup_history", values["lookup_history"], int, 0, 100_000_000)
    if "lookup_ngram" in values:
        values["lookup_ngram"] = _number("lookup_ngram", values["lookup_ngram"], int, 0, 64)
    if "adaptive" in values and not isinstance(values["adaptive"], bool):
        raise SelfAdmgConfigError(
            f"self-admg option 'adaptive' must be true or false, got {values['adaptive']!r}")
    return SelfAdmgOptions(**values)


def is_self_admg(spec: dict[str, Any] | None) -> bool:
    """True when a speculative-config dict asks for self-admg by any of its spellings."""
    if not spec:
        return False
    return spec.get("method") == METHOD_NAME or spec.get("model") == METHOD_NAME


def parse_speculative_config(
    spec: dict[str, Any], vllm_field_names: set[str]
) -> tuple[dict[str, Any], SelfAdmgOptions]:
    """Split a self-admg speculative config into the dict vLLM builds its
    `SpeculativeConfig` from (as the `custom_class` method with our proposer) and our options.

    `vllm_field_names` are the keys vLLM's `SpeculativeConfig` accepts; any other key that is
    not a self-admg option is reported with both lists.
    """
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    method, model = spec.pop("method", None), spec.pop("model", None)
    if method not in (None, METHOD_NAME) or model not in (None, METHOD_NAME):
        raise SelfAdmgConfigError(
            f"speculative config mixes self-admg with method={method!r} model={model!r}: "
            f"self-admg drafts with the target model itself, so give either "
            f"method='{METHOD_NAME}' or model='{METHOD_NAME}' and no other draft model"
        )
    ours = {k: spec.pop(k) for k in list(spec) if k in OPTION_NAMES or k not in vllm_field_names}
    foreign = sorted(k for k in spec if k in FOREIGN_VLLM_KEYS)
    if foreign:
        raise SelfAdmgConfigError(
            f"speculative config key(s) {foreign} are not used by self-admg, which drafts with "
            f"the target model itself; its options are:\n{describe_options()}")
    options = make_options(ours)
    k = spec.get("num_speculative_tokens")
    if k is None:
        k = DEFAULT_NUM_SPECULATIVE_TOKENS
    spec["num_speculative_tokens"] = _number("num_speculative_tokens", k, int, 1, 32)
    spec["method"] = "custom_class"
    spec["model"] = PROPOSER_PATH
    return spec, options
