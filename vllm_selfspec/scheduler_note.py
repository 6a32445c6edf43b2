# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The one note the scheduler sends the workers with each step.

Everything the scheduler tells the workers travels as one `SchedulerNote` on one attribute of
vLLM's `SchedulerOutput`, which pickling carries to the workers: written once per step by the
scheduler hook (`vllm_integration.scheduler_queue`) and read once per step by the runner hook.
A note that is missing or of another version reads as `SchedulerNote()`: nothing waits, nothing
reset, no tenant known, which is the closed and plain-like reading. Pure: no vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

NOTE_ATTRIBUTE = "self_admg_note"
NOTE_VERSION = 1


@dataclass(frozen=True)
class SchedulerNote:
    """What a self-admg engine's scheduler tells its workers with one step."""

    version: int = NOTE_VERSION
    # Admissible requests left waiting after this step's admissions (none while the queue is
    # stuck: the workers would plan no drafts for a queue that cannot move).
    waiting_requests: int = 0
    closed_batches: bool = False  # offline: nobody waits for a first token before the batch's end
    # So far: a change in resets makes the workers forget their lookup history, as vLLM forgets
    # its cached prefixes; the scheduler hooks' faults are published on /metrics by the workers.
    prefix_cache_resets: int = 0
    scheduler_faults: int = 0
    # Each request admitted new in this step, with the 16-byte digest of its cache_salt (None:
    # it has none): lookup history stays within a tenant, and vLLM 0.32 does not tell the
    # worker a request's salt. A request missing here is of an unknown tenant: no history.
    tenants: tuple[tuple[str, bytes | None], ...] = ()


def salt_digest(salt: str | None) -> bytes | None:
    """A fixed-size tenant key for a cache_salt of any length: made once per request in the
    scheduler, so that a long salt costs the workers nothing more. None for no salt, and for an
    empty one, which vLLM treats as no salt too (it salts no block hash with it)."""
    if salt is None or salt == "":
        return None
    return hashlib.blake2b(str(salt).encode(), digest_size=16).digest()


def attach_note(scheduler_output, note: SchedulerNote) -> None:
    setattr(scheduler_output, NOTE_ATTRIBUTE, note)


def note_of(scheduler_output) -> SchedulerNote:
    note = getattr(scheduler_output, NOTE_ATTRIBUTE, None)
    return note if isinstance(note, SchedulerNote) and note.version == NOTE_VERSION else SchedulerNote()
