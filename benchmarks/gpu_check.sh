#!/usr/bin/env bash
# The prepared GPU check (issue 17): the GPU tests, seed 000's cost tables at the seed's shapes and
# a short pre-training quality check, in one command that ends in under 8 minutes on one H200.
# Writes $OUT/gpu_check.json and $OUT/gpu_check.md ($OUT defaults to benchmarks/results).
#
#   benchmarks/gpu_prepare.sh          # here, with network: wheels and the fortunes corpus
#   benchmarks/gpu_check.sh            # on the GPU machine (carry .gpu with the tree)
#   benchmarks/gpu_check.sh --dry-run  # anywhere: the smallest shapes on the CPU
#
# On a machine without fedlore's dependencies (the lent GPU machine: its own torch, no pydantic,
# no pip index), the wheels in .gpu/wheels are installed with --no-index --no-deps and fedlore
# itself with --no-deps on top of the machine's torch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
if ! "$PY" -c "import pydantic, fedlore" 2>/dev/null; then
  if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/fedlore-site .gpu/wheels/*.whl
    export PYTHONPATH="/tmp/fedlore-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # no installer: run from the tree
  fi
fi
"$PY" -c "import torch, fedlore; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 470 "$PY" benchmarks/gpu_tables.py --out "$OUT" "${DRY[@]}" 2>&1 | tee "$OUT/gpu_check.log"
