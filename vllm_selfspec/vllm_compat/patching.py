"""One helper for every change vllm-selfspec makes to vLLM: each is recorded, and none twice.

`patch(owner, name, replacement, why)` replaces `owner.name` and records the original and the
reason; patching the same attribute again is refused (it would wrap our own wrapper), so each
patch is applied exactly once per process whoever asks first. `applied()` lists what is in
place, for tests and diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any
    why: str

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
    _applied[key] = Patch(owner, name, getattr(owner, name), replacement, why)
    setattr(owner, name, replacement)
    return True


def original(owner: Any, name: str) -> Any:
    """What `owner.name` was before we patched it (itself if not patched)."""
    applied = _applied.get((id(owner), name))
    return applied.original if applied else getattr(owner, name)


def applied() -> list[Patch]:
    return list(_applied.values())
