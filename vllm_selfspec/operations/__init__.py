# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What keeps drafting safe and visible to operators:
- `fail_safe`: a fault in drafting costs that step's drafts on every rank alike, never a request;
- `counters`, `metrics`: what the proposer did, on vLLM's /metrics from every worker;
- `worker_extension`: the proposer's state by name through /collective_rpc (benchmarks, tests).
"""
