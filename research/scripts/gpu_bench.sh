#!/usr/bin/env bash
# `python -m research bench gpu` on one GPU machine without network, inside one 8-minute call (docs/GPU.md).
# Run from the repository root. Needs a dataset folder (DATA, default .gpu/default-sp1024: the
# default corpus copied there, for a machine without network); torch and triton come with the
# machine. Writes
# $OUT/gpu-<card>.json (after every item, so a run stopped from outside keeps what it measured)
# and $OUT/bench-gpu.log. Any further arguments go to `python -m research bench gpu`.
#   OUT=/tmp/out bash research/scripts/gpu_bench.sh
#   OUT=/tmp/out BUDGET=300 bash research/scripts/gpu_bench.sh --sections doctor fwdbwd
set -euo pipefail
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.gpu/default-sp1024}
mkdir -p "$OUT"
if [ ! -d "$DATA" ]; then
    echo "gpu_bench.sh: dataset folder $DATA not found: set DATA=<a dataset folder>, or copy the default corpus (\`tngram data build\` prints its folder) to $DATA" >&2
    exit 2
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TNGRAM_CACHE=${TNGRAM_CACHE:-/tmp/tngram-cache}
# the budget (420 s) stops starting new items; the timeout is the hard stop under 8 minutes
timeout "${LIMIT:-470}" python3 -m research bench gpu --out "$OUT" --data "$DATA" \
    --budget "${BUDGET:-420}" --force "$@" 2>&1 | tee "$OUT/bench-gpu.log"
