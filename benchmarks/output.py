# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Where a benchmark or diagnostic writes its run unless `--out` says otherwise: a folder of its
own under `results/` in the lab's cache (``$VLLM_SELFSPEC_CACHE``, else ``~/.cache/vllm-selfspec``,
the same cache the models and prompt sets are fetched into), never inside the repository, so that
running the lab leaves the checkout clean.

A run that the docs cite is copied into `benchmarks/results/NAME/` by hand; .gitignore keeps only
what a reader needs of it there (the tables, the CSV, the environment and the plots).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path


def results_root() -> Path:
    """The folder every run's default folder is made in."""
    from benchmarks.assets import cache_root

    return cache_root() / "results"


def default_out(name: str) -> Path:
    """`results_root()/NAME-<date>_<time>`: a new folder for each run, named by what ran."""
    return results_root() / dt.datetime.now().strftime(f"{name}-%Y-%m-%d_%H%M%S")
