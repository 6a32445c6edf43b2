# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The options of the self-admg method: one schema for names, types, ranges, defaults and help.

Users pass them inside vLLM's speculative config, next to vLLM's own keys; knobs for experiments
go under one key, "experimental":

    {"method": "self-admg", "num_speculative_tokens": 4, "attention_threshold": 0.98,
     "experimental": {"draft_vocab": 0}}

Each field of `SelfAdmgOptions` carries its `OptionSpec`; validation, the error messages, the
README's option table (`python -m vllm_selfspec.options`) and the workers' copy all come from
it. `parse_speculative_config` splits a user's dict into vLLM's part and ours, raising
`SelfAdmgConfigError` (a `ValueError`) that names the option and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHOD_NAME = "self-admg"
PROPOSER_PATH = "vllm_selfspec.proposer.SelfAdmgProposer"
ADDITIONAL_CONFIG_KEY = "self_admg"
# Set by the front door, not by users: true only when the engine serves closed batches (the
# offline LLM class, `vllm run-batch`), whose callers wait for a whole batch; false otherwise
# (servers, direct engine use).
CLOSED_BATCHES_KEY = "self_admg_closed_batches"
EXPERIMENTAL_KEY = "experimental"

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# vLLM speculative-config keys that mean nothing for a self-draft; rejected rather than ignored.
FOREIGN_VLLM_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "revision")

logger = logging.getLogger("vllm.selfspec")


class SelfAdmgConfigError(ValueError):
    """A bad self-admg option or an unsupported set-up, reported before the engine starts."""


@dataclass(frozen=True)
class OptionSpec:
    """What one option accepts: its type, an inclusive range or a list of choices, and help."""

    help: str
    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple = ()
    experimental: bool = False

    def allowed(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.kind is bool:
            return "true or false"
        return f"{'an integer' if self.kind is int else 'a number'} in [{self.low}, {self.high}]"

    def validate(self, name: str, value: Any) -> Any:
        """`value` as this option's type, or a SelfAdmgConfigError naming the option and what
        it allows."""
        if self.choices or self.kind is bool:
            if (value in self.choices) if self.choices else isinstance(value, bool):
                return value
            raise SelfAdmgConfigError(f"self-admg option {name!r} must be {self.allowed()}, got {value!r}")
        # bool is an int subclass, but "true" as a threshold is a typo, not 1.
        ok_types = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise SelfAdmgConfigError(f"self-admg option {name!r} must be {self.allowed()}, got {value!r}")
        if not (self.low <= value <= self.high) or (isinstance(value, float) and math.isnan(value)):
            raise SelfAdmgConfigError(f"self-admg option {name!r} must be in [{self.low}, {self.high}], got {value!r}")
        return self.kind(value)


def option(
    default: Any,
    help: str,
    low: float | None = None,
    high: float | None = None,
    choices: tuple = (),
    experimental: bool = False,
):
    spec = OptionSpec(help, type(default), low, high, choices, experimental)
    return field(default=default, metadata={"spec": spec})


# vLLM's own key, validated and documented with ours.
NUM_SPECULATIVE_TOKENS = OptionSpec("maximum draft length K", int, 1, 32)
# A followed prediction (or a long lookup match) drafts up to K tokens a step, and the planner
# decides each row's length, so a row without a long draft takes no more for a larger K, while
# an edit that follows its prediction gets twice the tokens a step that 4 would allow it.
DEFAULT_NUM_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SelfAdmgOptions:
    """How each sequence's draft is chosen and run. The thresholds' defaults were the best of the
    settings tried on SmolLM2-135M-Instruct, HumanEval, batch 1 (the experiment log's first entries)."""

    skip: str = option(
        "attention+mlp",
        "which sublayers a draft may skip: 'attention' (the paper) or both",
        choices=("attention", "attention+mlp"),
    )
    attention_threshold: float = option(
        0.99,
        "skip an attention sublayer when the prompt's mean cosine similarity of the residual "
        "stream before and after it is above this",
        -1.0,
        1.0,
    )
    mlp_threshold: float = option(0.975, "the same for MLP sublayers (with skip 'attention+mlp')", -1.0, 1.0)
    keep_edge_layers: int = option(
        1, "structural rule: skip nothing in the first and the last N decoder layers (0 = off)", 0, 1_000_000
    )
    fill_gaps: int = option(
        1,
        "structural rule: also skip a kept sublayer whose same-kind neighbours within N layers "
        "on both sides are skipped (0 = off)",
        0,
        1_000_000,
    )
    draft_exit_threshold: float = option(
        0.5,
        "stop a sequence's draft when the draft's top-1 probability falls below this (0 = always draft K tokens)",
        0.0,
        1.0,
    )
    # Not the paper's whole prompt by default: the probe runs eagerly, and over a 1000-token
    # prompt it costs more than the drafts it enables save on a CPU.
    stats_window: int = option(
        32,
        "measure the similarities over the prompt's last N tokens (0 = the whole prompt, as in the paper)",
        0,
        1_000_000,
    )
    lookup: bool = option(
        True,
        "also draft by lookup: continue the context as its earlier occurrences did, and "
        "self-draft where lookup offers nothing",
    )
    # Bounded so that a lookup in it stays well under a millisecond per row and step.
    lookup_history: int = option(
        65536,
        "look up in the outputs of earlier requests with the same cache_salt too, keeping "
        "the last N tokens over all tenants (0 = off)",
        0,
        262_144,
    )
    lookup_history_tenants: int = option(
        256,
        "keep history for at most N tenants (cache_salts); tenants with one request so far "
        "make room first, so that a flood of new salts spares the tenants that return",
        1,
        65_536,
    )
    lookup_history_unsalted: bool = option(
        False,
        "let requests without a cache_salt draft from each other's earlier outputs (one shared "
        "pool); for single-user or trusted deployments only, since whether drafts arrive tells "
        "a client how another user's answer went on",
    )
    adaptive: bool = option(
        True, "draft only as many tokens as measured step costs and acceptance say pay, down to none (false = always K)"
    )
    objective: str = option(
        "per-request",
        "what the controller protects: 'per-request', the default, as each request is timed alone (no "
        "request's rate over its life so far falls below 98% of plain decoding's, by the controller's "
        "estimate, for another's drafts) or 'throughput' (the batch's tokens per second, whoever pays: "
        "more where every request drafts well, as code edits do, but a request may run slower than plain)",
        choices=("per-request", "throughput"),
    )
    # A prefill step beside verified drafts costs a new request's first token a little; a stream
    # of long prompts would otherwise cost every running request its drafts for good.
    max_withheld_share: float = option(
        0.5,
        "in a server, the largest share of steps in which running requests verify no drafts so that "
        "a prompt waiting or being prefilled in chunks gets its first token sooner (1 = every such "
        "step; 0 = never); past it they draft beside the prefill",
        0.0,
        1.0,
    )
    # Each request's prediction is held in its request and in the workers while it runs.
    max_prediction_tokens: int = option(
        8192,
        "the longest `prediction` (OpenAI's predicted outputs) a request may send, in tokens; a "
        "longer one is refused with a 400 (0 = none accepted)",
        0,
        1_000_000,
    )
    skip_budget: float = option(
        0.0,
        "instead of the thresholds: skip the sublayers that change the stream least per "
        "weight byte until this share of the layers' bytes is saved (0 = thresholds)",
        0.0,
        0.95,
        experimental=True,
    )
    draft_vocab: int = option(
        32768,
        "the draft's LM head scores only the first N token ids plus those in the "
        "sequence's context (0 = the whole vocabulary)",
        0,
        1_000_000,
        experimental=True,
    )
    lookup_max_match: int = option(24, "lookup matches at most the context's last N tokens", 1, 64, experimental=True)
    # Off by default: capped at 4 on SmolLM2 served at K = 8, chat still trailed K = 4 and code
    # edits lost a fifth of their speed (benchmarks/NOTES.md, entry 45).
    max_draft_unless_copying: int = option(
        0,
        "with adaptive on, a row drafts at most N tokens a step unless it copies: a prediction the "
        "output follows, or a lookup matching the context's last lookup_max_match tokens, drafts "
        "up to num_speculative_tokens (0 = K for every draft)",
        0,
        32,
        experimental=True,
    )

    # A way back to vLLM's own path should the hand-off ever misbehave, and what measures it.
    drafts_with_output: bool = option(
        True,
        "send a step's drafts to the engine core with its sampled tokens (false = the engine core "
        "asks the workers for them in a call of its own after each step, as vLLM 0.32 does)",
        experimental=True,
    )

    @property
    def skips_mlp(self) -> bool:
        return self.skip == "attention+mlp"

    @property
    def uncopied_cap(self) -> int:
        """The most tokens a draft that does not copy may use (0: no cap)."""
        return self.max_draft_unless_copying if self.adaptive else 0

    def uncopied_budget(self, budget: int) -> int:
        """Of a row's draft budget, what a draft that does not copy may use."""
        return min(budget, self.uncopied_cap) if self.uncopied_cap else budget

    def uncopied_budgets(self, budgets: np.ndarray) -> np.ndarray:
        """`uncopied_budget` of each of many rows' budgets."""
        return np.minimum(budgets, self.uncopied_cap) if self.uncopied_cap else budgets

    def as_dict(self) -> dict[str, Any]:
        """The options as a user writes them (experimental ones under their key)."""
        public = {name: getattr(self, name) for name, spec in SPECS.items() if not spec.experimental}
        public[EXPERIMENTAL_KEY] = {name: getattr(self, name) for name, spec in SPECS.items() if spec.experimental}
        return public


SPECS: dict[str, OptionSpec] = {f.name: f.metadata["spec"] for f in dataclasses.fields(SelfAdmgOptions)}
DEFAULTS = SelfAdmgOptions()

# Old spellings kept working: name -> (new spelling, how to translate the value).
DEPRECATED = {
    "skip_budget": (f"{EXPERIMENTAL_KEY}.skip_budget", lambda v: {EXPERIMENTAL_KEY: {"skip_budget": v}}),
    "draft_vocab": (f"{EXPERIMENTAL_KEY}.draft_vocab", lambda v: {EXPERIMENTAL_KEY: {"draft_vocab": v}}),
    "lookup_ngram": (
        "lookup (false for 0) and experimental.lookup_max_match",
        lambda v: {"lookup": False} if v == 0 else {EXPERIMENTAL_KEY: {"lookup_max_match": v}},
    ),
}
_deprecation_warned: set[str] = set()


def describe_options(experimental: bool = False) -> str:
    """One line per option with its default and what it accepts, for error messages."""
    lines = [
        f"  {name} (default {getattr(DEFAULTS, name)!r}, {spec.allowed()}): {spec.help}"
        for name, spec in SPECS.items()
        if spec.experimental == experimental
    ]
    if not experimental:
        lines.append(
            f"  num_speculative_tokens (default {DEFAULT_NUM_SPECULATIVE_TOKENS}, "
            f"{NUM_SPECULATIVE_TOKENS.allowed()}): {NUM_SPECULATIVE_TOKENS.help}"
        )
        lines.append(
            f"  {EXPERIMENTAL_KEY}: a dict of experimental options, listed by "
            "`python -m vllm_selfspec.options --experimental`"
        )
    return "\n".join(lines)


def _translate_deprecated(raw: dict[str, Any]) -> dict[str, Any]:
    values = {k: v for k, v in raw.items() if k not in DEPRECATED}
    experimental = dict(values.pop(EXPERIMENTAL_KEY, None) or {})
    for old in sorted(set(raw) & set(DEPRECATED)):
        new_name, translate = DEPRECATED[old]
        if old not in _deprecation_warned:
            _deprecation_warned.add(old)
            logger.warning("self-admg option %r is deprecated; use %s instead", old, new_name)
        moved = translate(raw[old])
        experimental.update(moved.pop(EXPERIMENTAL_KEY, {}))
        values.update(moved)
    return {**values, **experimental}


def make_options(raw: dict[str, Any]) -> SelfAdmgOptions:
    """Validate user options (self-admg's own keys, experimental ones under their key)."""
    nested = raw.get(EXPERIMENTAL_KEY) or {}
    if not isinstance(nested, dict):
        raise SelfAdmgConfigError(f"self-admg option {EXPERIMENTAL_KEY!r} must be a dict, got {nested!r}")
    misplaced = sorted(k for k in nested if k in SPECS and not SPECS[k].experimental)
    if misplaced:
        raise SelfAdmgConfigError(
            f"self-admg option(s) {misplaced} are not experimental: give them "
            f"at the top level of the speculative config"
        )
    unknown_nested = sorted(set(nested) - {k for k, s in SPECS.items() if s.experimental})
    if unknown_nested:
        raise SelfAdmgConfigError(
            f"unknown experimental self-admg option(s) {unknown_nested}; allowed "
            f"are:\n{describe_options(experimental=True)}"
        )
    top_level_experimental = sorted(k for k in raw if k in SPECS and SPECS[k].experimental and k not in DEPRECATED)
    unknown = sorted(set(raw) - set(SPECS) - set(DEPRECATED) - {EXPERIMENTAL_KEY}) + top_level_experimental
    if unknown:
        raise SelfAdmgConfigError(f"unknown self-admg option(s) {unknown}; allowed options are:\n{describe_options()}")
    values = _translate_deprecated(raw)
    return SelfAdmgOptions(**{name: SPECS[name].validate(name, v) for name, v in values.items()})


def is_self_admg(spec: dict[str, Any] | None) -> bool:
    """True when a speculative-config dict asks for self-admg by any of its spellings."""
    if not spec:
        return False
    # The proposer's class path under vLLM's custom_class method is self-admg too: it gets the
    # same checks and refusals, not a way around them.
    return spec.get("method") == METHOD_NAME or spec.get("model") in (METHOD_NAME, PROPOSER_PATH)


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
    by_class_path = model == PROPOSER_PATH and method in (None, "custom_class")
    if not by_class_path and (method not in (None, METHOD_NAME) or model not in (None, METHOD_NAME)):
        raise SelfAdmgConfigError(
            f"speculative config mixes self-admg with method={method!r} model={model!r}: "
            f"self-admg drafts with the target model itself, so give either "
            f"method='{METHOD_NAME}' or model='{METHOD_NAME}' and no other draft model"
        )
    ours = {k: spec.pop(k) for k in list(spec) if k in SPECS or k not in vllm_field_names}
    foreign = sorted(k for k in spec if k in FOREIGN_VLLM_KEYS)
    if foreign:
        raise SelfAdmgConfigError(
            f"speculative config key(s) {foreign} are not used by self-admg, which drafts with "
            f"the target model itself; its options are:\n{describe_options()}"
        )
    options = make_options(ours)
    k = spec.get("num_speculative_tokens")
    spec["num_speculative_tokens"] = NUM_SPECULATIVE_TOKENS.validate(
        "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k
    )
    spec["method"] = "custom_class"
    spec["model"] = PROPOSER_PATH
    return spec, options


def options_table(experimental: bool = False) -> str:
    """The options as a Markdown table (the README's is this, kept equal by a test)."""
    rows = [] if experimental else [("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS, NUM_SPECULATIVE_TOKENS)]
    rows += [(name, getattr(DEFAULTS, name), spec) for name, spec in SPECS.items() if spec.experimental == experimental]
    lines = ["| option | default | allowed | meaning |", "|---|---|---|---|"]
    for name, default, spec in rows:
        shown = (
            str(default).lower()
            if isinstance(default, bool)
            else (f'"{default}"' if isinstance(default, str) else default)
        )
        lines.append(f"| `{name}` | {shown} | {spec.allowed()} | {spec.help} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Print self-admg's options as a Markdown table.")
    parser.add_argument("--experimental", action="store_true", help="the experimental options instead")
    print(options_table(parser.parse_args(argv).experimental))


if __name__ == "__main__":
    main()
