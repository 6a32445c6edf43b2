# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Each live request's slot: its row in arrays kept per request, given the first time a step
asks for it and freed when the request ends, so that a step reads its rows' state with one
gather rather than an object per row. Pure: no vLLM."""

from __future__ import annotations

import numpy as np

NO_SLOT = -1


class RequestSlots:
    """The map from request to slot, and the slots free for the next request. What the slots
    hold is a subclass's: it widens its arrays (`_grow`) and clears a slot that is freed
    (`_freed`). A request may be known without a slot (NO_SLOT: nothing kept for it)."""

    def __init__(self):
        self.slot_of: dict[str, int] = {}
        self.capacity = 0
        self._free: list[int] = []

    def _take(self, req_id: str) -> int:
        """A free slot for the request (the arrays grow first, if none is free)."""
        if not self._free:
            old, self.capacity = self.capacity, max(2 * self.capacity, 16)
            self._grow(old)
            self._free = list(range(self.capacity - 1, old - 1, -1))
        slot = self.slot_of[req_id] = self._free.pop()
        return slot

    def _grow(self, old: int) -> None:
        """Widen the arrays from `old` slots to `capacity`."""

    def _freed(self, slot: int) -> None:
        """What the slot held belongs to no request now."""

    def forget(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, NO_SLOT)
        if slot != NO_SLOT:
            self._freed(slot)
            self._free.append(slot)

    def keep_only(self, live_requests) -> None:
        """Free the slots of requests the runner no longer holds, should one never be forgotten."""
        if len(self.slot_of) > 2 * len(live_requests) + 64:
            for req_id in [r for r in self.slot_of if r not in live_requests]:
                self.forget(req_id)

    def __len__(self) -> int:
        return len(self.slot_of)


def widened(array: np.ndarray, slots: int) -> np.ndarray:
    """`array` (a row a slot) with room for `slots` rows, the new ones zero."""
    grown = np.zeros((slots, *array.shape[1:]), dtype=array.dtype)
    grown[: len(array)] = array
    return grown
