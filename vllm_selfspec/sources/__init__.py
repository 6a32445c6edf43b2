# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Drafts that cost no forward pass, and what is kept per request to find them:
- `lookup`: drafts from the row's own context and from its tenant's earlier outputs (indexed);
- `prediction`, `prediction_cursor`: OpenAI's predicted outputs, and where the output stands in one;
- `row_lookup`: per request, its tenant, quarantine and cursor; each row's draft in a step.
"""
