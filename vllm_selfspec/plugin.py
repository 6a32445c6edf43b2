# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""vLLM general plugin: vLLM calls `register()` once in every process it starts (front end,
engine core, workers) through the `vllm.general_plugins` entry point.

`register()` runs inside vLLM's plugin loader, so nothing may escape it: if applying the patches
fails, whatever was patched is put back, one warning says why, and only a request for
self-admg is refused; plain vLLM runs as if the plugin were absent."""

import logging

logger = logging.getLogger("vllm.selfspec")

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from vllm_selfspec.vllm_integration import apply_patches

        apply_patches()
    except Exception as err:  # a plugin must never take plain vLLM down
        _roll_back()
        logger.warning(
            "vllm-selfspec could not patch vLLM (%s: %s): its patches are rolled back, plain "
            "vLLM runs unchanged, and the self-admg method is refused",
            type(err).__name__,
            err,
        )
        _refuse_self_admg(
            f"self-admg is unavailable: vllm-selfspec could not patch vLLM ({type(err).__name__}: "
            f"{err}); see the warning at start-up"
        )


def _roll_back() -> None:
    try:
        from vllm_selfspec.vllm_integration import patching

        patching.roll_back()
    except Exception as err:  # the proposer refuses to run in a process without its patches
        logger.warning("vllm-selfspec could not roll its patches back: %s", err)


def _refuse_self_admg(message: str) -> None:
    try:
        from vllm_selfspec.vllm_integration import front_door

        front_door.refuse_self_admg(message)
    except Exception as err:  # even the refusal failed: the proposer still refuses (`patching.complete`)
        logger.warning("vllm-selfspec could not install its refusal of self-admg either: %s", err)
