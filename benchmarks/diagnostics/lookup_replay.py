# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Do self-admg's lookup drafts accept as many tokens as vLLM's `suffix` on the same requests?

Replays what a serving run served, teacher-forced, through both lookup rules with nothing else
in the way (no controller, no timing): self-admg's (`vllm_selfspec.sources.lookup`: the row's own
context and earlier outputs) and vLLM's `suffix` method (arctic-inference's
`SuffixDecodingCache`, fed as vLLM's `SuffixDecodingProposer` feeds it). Requests go in the
order the server started them, each step drafts up to K tokens, the draft's tokens that match
the served answer are accepted plus one token, and an answer joins the history when it ends.
Per load point it prints steps, steps with a draft, draft tokens and accepted tokens: where the
two rules differ in steps, drafts explain a gap in speed; where they do not, the time per step
does. No engine runs (the served answers are tokenized again, the same for both rules).

    .venv/bin/python -m benchmarks.diagnostics.lookup_replay \
        ~/.cache/vllm-selfspec/results/serving-quick-.../ --workload chat
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.serving import capacity_points
from vllm_selfspec.options import DEFAULT_NUM_SPECULATIVE_TOKENS, make_options
from vllm_selfspec.sources.lookup import OutputHistory, lookup_draft


@dataclass
class Counts:
    steps: int = 0
    drafted_steps: int = 0
    draft_tokens: int = 0
    accepted: int = 0


class SelfAdmgLookup:
    """self-admg's lookup rule, with its default options: the better of the context's own draft
    and the history's."""

    def __init__(self, k: int):
        options = make_options({})
        self.k, self.max_match = k, options.lookup_max_match
        self.history = OutputHistory(options.lookup_history)

    def start(self, prompt: np.ndarray) -> None:
        pass

    def draft(self, prompt: np.ndarray, output: np.ndarray, tokens_left: int) -> list[int]:
        # As the proposer does: no more tokens than the request can still use.
        _, found = lookup_draft(
            np.concatenate([prompt, output]), min(self.k, tokens_left - 1), self.max_match, self.history
        )
        return found.tokens.tolist()

    def emitted(self, tokens: np.ndarray) -> None:
        pass

    def finish(self, output: np.ndarray) -> None:
        self.history.add(output)


class SuffixMethodLookup:
    """vLLM's `suffix` method with its defaults (SpeculativeConfig's): the prompt's tree and the
    tree of every answer (earlier ones and those being written)."""

    def __init__(self, k: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        from vllm.config import SpeculativeConfig

        default = {name: field.default for name, field in SpeculativeConfig.__dataclass_fields__.items()}
        self.k, self.max_depth = k, default["suffix_decoding_max_tree_depth"]
        self.spec_factor = default["suffix_decoding_max_spec_factor"]
        self.min_prob = default["suffix_decoding_min_token_prob"]
        self.cache = SuffixDecodingCache(
            max_tree_depth=self.max_depth, max_cached_requests=default["suffix_decoding_max_cached_requests"]
        )
        self.request = 0

    def start(self, prompt: np.ndarray) -> None:
        self.request += 1
        self.cache.start_request(str(self.request), prompt.astype(np.int32))

    def draft(self, prompt: np.ndarray, output: np.ndarray, tokens_left: int) -> list[int]:
        pattern = np.concatenate([prompt, output])[-self.max_depth :].astype(np.int32)
        return list(
            self.cache.speculate(
                str(self.request),
                pattern,
                max_spec_tokens=self.k,
                max_spec_factor=self.spec_factor,
                min_token_prob=self.min_prob,
            ).token_ids
        )

    def emitted(self, tokens: np.ndarray) -> None:
        self.cache.add_active_response(str(self.request), tokens.tolist())

    def finish(self, output: np.ndarray) -> None:
        self.cache.stop_request(str(self.request))


def serve(rule, prompt: np.ndarray, answer: np.ndarray, counts: Counts) -> None:
    """One request, teacher-forced: the first token comes from the prompt's prefill (no draft),
    then every step verifies the rule's draft against the served answer."""
    rule.start(prompt)
    done = min(1, len(answer))
    rule.emitted(answer[:done])
    while done < len(answer):
        draft = rule.draft(prompt, answer[:done], len(answer) - done)
        accepted = 0
        while accepted < len(draft) and done + accepted < len(answer) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        advance = min(accepted + 1, len(answer) - done)
        rule.emitted(answer[done : done + advance])
        counts.steps += 1
        counts.drafted_steps += bool(draft)
        counts.draft_tokens += len(draft)
        counts.accepted += accepted
        done += advance
    rule.finish(answer)


def served_requests(folder: Path, run: str, tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) token ids of one `vllm bench serve` run, in the order they were sent."""
    raw = json.loads((folder / "raw" / f"{run}.json").read_text())
    prompts = [json.loads(line)["prompt"] for line in (folder / "workloads" / f"{run}.jsonl").read_text().splitlines()]
    ids = lambda text: np.array(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)  # noqa: E731
    order = np.argsort(raw["start_times"], kind="stable")
    return [(ids(prompts[i]), ids(raw["generated_texts"][i])[: raw["output_lens"][i]]) for i in order]


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a benchmarks.serving results folder")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--server", default="r0-0-plain", help="whose answers to replay (raw/<server>-...)")
    parser.add_argument(
        "--k", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS, help="draft tokens at most, as the servers' K"
    )
    args = parser.parse_args(argv)
    environment = json.loads((args.folder / "environment.json").read_text())
    settings = environment["settings"]
    tokenizer = AutoTokenizer.from_pretrained(settings["model_path"])
    rules = {"self-admg": SelfAdmgLookup(args.k), "suffix": SuffixMethodLookup(args.k)}
    print("load | rule | steps | steps with a draft | draft tokens | accepted")
    for point in (p.label for p in capacity_points(1.0, settings["load"], cap=0)):  # the order served
        run = f"{args.server}-{args.workload}-{point}"
        if not (args.folder / "raw" / f"{run}.json").exists():
            continue
        requests = served_requests(args.folder, run, tokenizer)
        for name, rule in rules.items():
            counts = Counts()
            for prompt, answer in requests:
                serve(rule, prompt, answer, counts)
            print(
                f"{point} | {name} | {counts.steps} | {counts.drafted_steps} | {counts.draft_tokens} | "
                f"{counts.accepted}",
                flush=True,
            )


if __name__ == "__main__":
    main()
