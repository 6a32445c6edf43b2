# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""One helper for every change vllm-selfspec makes to vLLM: each is recorded, and none twice.

`patch(owner, name, replacement, why)` replaces `owner.name` and records the original and the
reason; patching the same attribute again is refused (it would wrap our own wrapper), so each
patch is applied exactly once per process whoever asks first. `applied()` lists what is in
place, for tests and diagnostics; `roll_back()` restores every original (newest first), for a
start-up that failed half-way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any
    why: str
    stored: Any = None  # what the owner held, descriptors (classmethod, staticmethod) unresolved

    @property
    def target(self) -> str:
        owner = self.owner
        if isinstance(owner, type):
            where = f"{owner.__module__}.{owner.__qualname__}"
        else:  # a module, or an object such as a dataclass field
            where = getattr(owner, "__name__", None) or f"{type(owner).__name__}({getattr(owner, 'name', '')})"
        return f"{where}.{self.name}"


_applied: dict[tuple[int, str], Patch] = {}


def patch(owner: Any, name: str, replacement: Any, why: str) -> bool:
    """Replace `owner.name` with `replacement`; False (and nothing done) if already patched."""
    key = (id(owner), name)
    if key in _applied:
        return False
    before, stored = getattr(owner, name), inspect.getattr_static(owner, name)
    setattr(owner, name, replacement)  # first: a patch that could not be made is not recorded
    _applied[key] = Patch(owner, name, before, replacement, why, stored)
    return True


def original(owner: Any, name: str) -> Any:
    """What `owner.name` was before we patched it (itself if not patched)."""
    applied = _applied.get((id(owner), name))
    return applied.original if applied else getattr(owner, name)


def applied() -> list[Patch]:
    return list(_applied.values())


_complete = False  # whether every patch the plugin makes is in place in this process


def mark_complete() -> None:
    global _complete
    _complete = True


def complete() -> bool:
    """Whether every patch is in place: the proposer refuses to run without them (a self-draft
    without the scheduler's KV lookahead would write into blocks it does not own)."""
    return _complete


def roll_back() -> None:
    """Undo every recorded patch, newest first (a failed start-up must leave vLLM as it was)."""
    global _complete
    _complete = False
    for key, applied_patch in reversed(list(_applied.items())):
        setattr(applied_patch.owner, applied_patch.name, applied_patch.stored)
        del _applied[key]
    for hook in _after_roll_back:
        hook()


_after_roll_back: list = []


def after_roll_back(hook) -> None:
    """Run `hook()` after a roll-back (for caches built from a patched value)."""
    _after_roll_back.append(hook)
