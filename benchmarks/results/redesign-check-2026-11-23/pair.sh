#!/usr/bin/env bash
# One side of the before/after check: $1 = tree (before or main), $2 = output prefix.
set -u
tree=$1; out=$2
cd "$tree"
common=(--mode full --methods self-admg --prompts 2 --max-tokens 32 --repeat 2 --kv-cache-gb 1 --no-ablations --dtype float32 --enforce-eager)
if [ -f benchmarks/__init__.py ]; then run=(-m benchmarks.run); else run=(benchmarks/run.py); fi
export PYTHONPATH=$tree LD_PRELOAD=/work/main/.venv/lib/libiomp5.so
/work/main/.venv/bin/python "${run[@]}" "${common[@]}" --workloads humaneval --cells 1:0 8:0 --out "$out-humaneval"
/work/main/.venv/bin/python "${run[@]}" "${common[@]}" --workloads news --cells 1:0 --prompts 1 --out "$out-news"
echo PAIR-DONE
