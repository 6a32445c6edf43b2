# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""When to try again a draft source that stopped paying: self-drafting (`planner`) or looking
up (`lookup_gate`). A source not used is not measured, so it is retried after a wait that
doubles with each retry that did not bring it back, and starts again once it pays."""

from __future__ import annotations

from dataclasses import dataclass

FIRST_RETRY_AFTER = 16  # steps without the source before a retry; doubles after each
LAST_RETRY_AFTER = 1024


@dataclass
class Backoff:
    after: int = FIRST_RETRY_AFTER
    waited: int = 0  # steps without the source since it was last used or retried

    def in_use(self) -> None:
        """The source pays again: the next wait is the first."""
        self.waited, self.after = 0, FIRST_RETRY_AFTER

    def due(self) -> bool:
        """One more step without the source: whether a retry is due."""
        self.waited += 1
        return self.waited >= self.after

    def retried(self) -> None:
        self.waited, self.after = 0, min(2 * self.after, LAST_RETRY_AFTER)
