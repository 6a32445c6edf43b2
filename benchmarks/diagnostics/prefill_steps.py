# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Is a method's prefill step slower than plain's, or was its whole server slower?

Reads a serving results folder (benchmarks.serving run with --log-steps, so that every server
logged each engine step: vLLM's --enable-logging-iteration-details) and takes, per server, the
steps that prefill at least --min-tokens prompt tokens, in the order they ran. Every server of a
run gets the same requests in the same order, so a step that prefilled as many prompts and about
as many tokens is the same phase on each: the warm-up, the first turns of multi-turn (no drafts
yet: every row is a new prompt) and the opening wave of the unlimited-rate run. For each, the
milliseconds per prompt token, and that over the mean of the like steps of the round's plain
servers (a plain server's over its round's other plain servers': the noise). A step slower only
where drafting could matter points at the method; one slower from the warm-up on, at the server.

    .venv/bin/python -m benchmarks.diagnostics.prefill_steps ~/.cache/vllm-selfspec/results/serving-.../
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

STEP = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, \d+ generation tokens, iteration elapsed time: ([\d.]+) ms"
)
SERVER_LOG = re.compile(r"server-r(\d+)-(\d+)-(.+)\.log")


@dataclass(frozen=True)
class Step:
    prompts: int
    prompt_tokens: int
    decoding: int
    ms: float

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.prompt_tokens


def prefill_steps(log: Path, min_tokens: int) -> list[Step]:
    """The steps of one server's log that prefill at least min_tokens prompt tokens."""
    steps = []
    for line in log.read_text(errors="replace").splitlines():
        if found := STEP.search(line):
            prompts, tokens, decoding, ms = found.groups()
            if int(tokens) >= min_tokens:
                steps.append(Step(int(prompts), int(tokens), int(decoding), float(ms)))
    return steps


def like(step: Step, servers: list[list[Step]]) -> list[Step]:
    """Each server's step most like this one: as many prompts, and the nearest count of prompt
    tokens if within a tenth (a server that admitted a wave in two steps has none like it)."""
    found = []
    for steps in servers:
        same = [s for s in steps if s.prompts == step.prompts]
        nearest = min(same, key=lambda s: abs(s.prompt_tokens - step.prompt_tokens), default=None)
        if nearest is not None and abs(nearest.prompt_tokens - step.prompt_tokens) <= step.prompt_tokens / 10:
            found.append(nearest)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--min-tokens", type=int, default=400, help="prompt tokens a step must prefill")
    args = parser.parse_args(argv)
    servers = {}  # (round, slot, method) -> steps
    for log in sorted(args.folder.glob("server-r*.log")):
        if name := SERVER_LOG.fullmatch(log.name):
            servers[int(name[1]), int(name[2]), name[3]] = prefill_steps(log, args.min_tokens)
    if not any(servers.values()):
        raise SystemExit(f"no step lines in {args.folder}: run benchmarks.serving with --log-steps")
    print("| round | server | step | prompts | prompt tokens | decoding rows | ms | ms per token | over plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (round_, slot, method), steps in sorted(servers.items()):
        # A plain server is compared with the round's other plain servers: the noise.
        plain = [s for (r, other, m), s in servers.items() if r == round_ and m == "plain" and other != slot]
        for n, step in enumerate(steps):
            base = [p.ms_per_token for p in like(step, plain)]
            ratio = f"{step.ms_per_token / statistics.mean(base):.2f}" if base else ""
            print(
                f"| {round_} | {slot} {method} | {n} | {step.prompts} | {step.prompt_tokens} | {step.decoding} "
                f"| {step.ms:.0f} | {step.ms_per_token:.3f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
