# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What one lookup costs, worst case against typical: contexts and histories a hostile prompt can
send (one repeated token, a short cycle, two symbols at random) beside ordinary ones (random
tokens, Zipf-distributed text-like tokens), up to the longest context a model serves. No engine:
it times `vllm_selfspec.sources.lookup.suffix_draft`, which every row runs every step it may draft.

    .venv/bin/python -m benchmarks.diagnostics.lookup_bound
    .venv/bin/python -m benchmarks.diagnostics.lookup_bound --lengths 4096 32768 --draft 32 --max-match 64
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def contexts(length: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (tokens, 'hostile' or 'ordinary')."""
    return {
        "one repeated token": (np.full(length, 7, dtype=np.int64), "hostile"),
        "a two-token cycle": (np.tile(np.array([5, 6], dtype=np.int64), length // 2), "hostile"),
        "two symbols at random": (rng.integers(0, 2, length), "hostile"),
        "random tokens": (rng.integers(0, 50_000, length), "ordinary"),
        "text-like (Zipf)": (rng.zipf(1.3, length) % 50_000, "ordinary"),
    }


def milliseconds(context: np.ndarray, corpus: np.ndarray | None, draft: int, max_match: int, repeats: int) -> float:
    from vllm_selfspec.sources.lookup import suffix_draft

    suffix_draft(context, draft, corpus, max_match)  # compiled and cached before timing
    start = time.perf_counter()
    for _ in range(repeats):
        suffix_draft(context, draft, corpus, max_match)
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[4096, 32768, 131072], help="context and history lengths in tokens"
    )
    parser.add_argument("--draft", type=int, default=4, help="draft tokens asked for (K)")
    parser.add_argument("--max-match", type=int, default=24, help="lookup_max_match")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    from vllm_selfspec.sources.lookup import MAX_OCCURRENCES_FOLLOWED, MAX_OCCURRENCES_SCANNED, warm_up

    warm_up()
    rng = np.random.default_rng(0)
    print(
        f"ms per lookup, one core; K={args.draft}, max_match={args.max_match}; caps: "
        f"{MAX_OCCURRENCES_SCANNED} occurrences scanned, {MAX_OCCURRENCES_FOLLOWED} followed"
    )
    print("| tokens | kind | own context, ms | history of earlier outputs, ms | input |")
    print("|---|---|---|---|---|")
    worst = {"hostile": 0.0, "ordinary": 0.0}
    for length in args.lengths:
        for name, (tokens, kind) in contexts(length, rng).items():
            own = milliseconds(tokens, None, args.draft, args.max_match, args.repeats)
            # The same tokens as a history, looked up from a short context that ends like it.
            history = milliseconds(tokens[-64:], tokens, args.draft, args.max_match, args.repeats)
            worst[kind] = max(worst[kind], own, history)
            print(f"| {length} | {kind} | {own:.3f} | {history:.3f} | {name} |")
    print(f"\nworst hostile {worst['hostile']:.3f} ms, worst ordinary {worst['ordinary']:.3f} ms per lookup")


if __name__ == "__main__":
    main()
