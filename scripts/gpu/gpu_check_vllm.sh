#!/usr/bin/env bash
# GPU check of vLLM colocated generation with TLT (issue #9): installs trl-tlt with vLLM from carried wheels (if
# a wheel folder is given), then trains the embedded policy a few GRPO steps with vLLM colocate, without and with
# the online EAGLE-3 drafter, and prints rollout time and acceptance length. Sized for ~10 minutes on one H200.
#
#   bash scripts/gpu/gpu_check_vllm.sh [WHEEL_DIR] [OUTPUT_JSON]
#
# WHEEL_DIR holds vllm (0.31.x, CUDA) and its dependencies, trl, peft, liger-kernel, datasets (pip download ...);
# without it the current environment must already have them. Pass the cached policy/drafter with POLICY=... DRAFTER=...
# to skip building them (~10 minutes on 2 CPU cores; less on a GPU machine's CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-}
OUTPUT=${2:-gpu_check_vllm.json}
PY=${PYTHON:-python3}
if [ -n "$WHEELS" ]; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" "vllm>=0.31,<0.32" trl peft liger-kernel datasets
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
ARGS=(--steps "${STEPS:-6}" --output "$OUTPUT")
[ -n "${POLICY:-}" ] && ARGS+=(--policy "$POLICY")
[ -n "${DRAFTER:-}" ] && ARGS+=(--drafter "$DRAFTER")
PYTHONUNBUFFERED=1 timeout 570 $PY scripts/gpu/gpu_check_vllm.py "${ARGS[@]}"
