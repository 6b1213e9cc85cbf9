#!/usr/bin/env bash
# Pre-flight for a GPU call, on the CPU: the GPU path's tests and the next card's calls (the
# `OUT=$OUT ...` lines of docs/GPU.md "The next card's calls", at tiny shapes) under the torch,
# triton and Python the card has (KINDS of the device machines: torch 2.11.0, triton 3.6.0,
# Python 3.12), so that an API this repository's torch 2.13 has and the card's lacks fails here,
# not in the card's minutes. Downloads torch's CUDA wheel and its NVIDIA libraries from PyPI
# (about 4.7 GB in the venv, kept for the next run). Run from the repository root:
#   PY=/path/to/python3.12 bash research/scripts/card_torch_check.sh     (NO_TESTS=1: the calls only)
set -euo pipefail
PY=${PY:-python3.12}
TORCH=${TORCH:-2.11.0}
TRITON=${TRITON:-3.6.0}
VENV=${VENV:-/tmp/card-torch-$TORCH}
OUT=${OUT:-/tmp/card-torch-out}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH" "triton==$TRITON" numpy sentencepiece \
        safetensors tqdm pytest pyarrow matplotlib scipy
fi
export PATH="$VENV/bin:$PATH" PYTHONPATH=$PWD
python -c 'import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
[ -n "${NO_TESTS:-}" ] || python -m pytest -q -p no:cacheprovider \
    tests/test_bench_gpu.py tests/test_compile.py \
    tests/test_compile_auto.py tests/test_fused_lookup.py tests/test_kernel_choice.py \
    tests/test_kernel_policy.py tests/test_memory_update.py tests/test_optim_muon.py \
    tests/test_sdpa_setting.py tests/test_sparse_triton.py tests/test_triton_bf16_output.py \
    tests/test_bench_gpu_tables.py tests/test_sparse_rows_coalesced.py \
    tests/test_bench_gpu_kernel_items.py
n=0
grep '^OUT=\$OUT ' docs/GPU.md | while read -r call; do
    n=$((n + 1))
    d=$OUT/$n
    rm -rf "$d" && mkdir -p "$d"
    echo "call $n: $call"
    # under the Triton interpreter the kernels section runs too (its Triton and inductor
    # variants); the other sections' lookups on CPU tensors take the C kernel as before
    (export OUT=$d TRITON_INTERPRET=1 && eval "${call#OUT=\$OUT }" > "$d/log" 2>&1) || {
        echo "call $n failed: $d/log"
        exit 1
    }
    grep -E "^python -m research bench gpu:|^wrote " "$d/log"
    # an item that raised is recorded with an "error" (the run goes on): none may have
    python - "$d" <<'PY'
import json, pathlib, sys
bad = [f"{f.name}: {s} {k}: {v['error']}" for f in pathlib.Path(sys.argv[1]).glob("*.json")
       for s, sec in json.loads(f.read_text())["sections"].items() for k, v in sec.items()
       if isinstance(v, dict) and "error" in v]
print("\n".join(bad) or "no item failed")
sys.exit(1 if bad else 0)
PY
done
