"""Is a method's prefill step slower than plain's, or was its whole server slower?

Reads a serving results folder (benchmarks.serving run with --log-steps, so that every server
logged each engine step: vLLM's --enable-logging-iteration-details) and takes, per server, the
steps that prefill at least --min-tokens prompt tokens, in the order they ran. Every server of a
run gets the same requests in the same order, so the n-th such step is the same phase on each:
the warm-up, the first turns of multi-turn (no drafts yet: every row is a new prompt) and the
opening wave of the unlimited-rate run. For each, the milliseconds per prompt token, and per
method server that over the mean of the plain servers of its round. A step slower only where
drafting could matter points at the method; one slower from the warm-up on points at the server.

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


def like(step: Step, n: int, servers: list[list[Step]]) -> list[Step]:
    """Each server's step like the n-th: its n-th, if it prefilled within a tenth as many prompt
    tokens (an engine that admitted a wave in two steps has no step like it)."""
    return [
        s[n] for s in servers if len(s) > n and abs(s[n].prompt_tokens - step.prompt_tokens) <= step.prompt_tokens / 10
    ]


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
        plain = [s for (r, _, m), s in servers.items() if r == round_ and m == "plain"]
        for n, step in enumerate(steps):
            base = [p.ms_per_token for p in like(step, n, plain)] if method != "plain" else []
            ratio = f"{step.ms_per_token / statistics.mean(base):.2f}" if base else ""
            print(
                f"| {round_} | {slot} {method} | {n} | {step.prompts} | {step.prompt_tokens} | {step.decoding} "
                f"| {step.ms:.0f} | {step.ms_per_token:.3f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
