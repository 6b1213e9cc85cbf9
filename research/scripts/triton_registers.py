"""Registers per thread of the TN-gram lookup's Triton kernels, compiled without a GPU.

    .venv/bin/python research/scripts/triton_registers.py [--arch 90] [--out FILE.json]

For each paper-l9 TN-gram recipe's lookup (N, R, absorption, norm, orders summed), compiles the
forward, the fused backward, and the split backward's two kernels (tngram.kernels.tngram_triton)
for sm_<arch> at the forward's num_warps and at twice it, with triton's own compiler and ptxas,
and reads each cubin's registers per thread and local (spill) bytes with triton's bundled
cuobjdump. `programs_per_sm` is min(65,536 registers / (registers x 32 x warps), 64 / warps),
rounded down: what the register file allows resident on one SM of an sm_80/sm_90 card (shared
memory and the allocation granularity ignored). A static count: which variant is faster is the
card's to say (`python -m research bench gpu --sections kernels`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default, without the warning

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tngram.kernels import tngram_triton as k  # noqa: E402
from tngram.train.metrics import git_info  # noqa: E402
from tngram.memory.tngram_variants import TNGramVariantConfig  # noqa: E402
from tngram.train.recipes import get_recipe  # noqa: E402

RECIPES = (
    "paper-l9-tngram",
    "paper-l9-tngram-hsum",
    "paper-l9-tngram-sum",
    "paper-l9-tngram-sum-lean",
)
PTR = "*fp32"
FWD = {"table_ptr": PTR, "idx_ptr": "*i64", "w_ptr": PTR, "s_ptr": PTR, "out_ptr": "*bf16",
       "rstd_ptr": PTR, "R": "i32", "eps": "fp32"}
BWD = {"table_ptr": PTR, "idx_ptr": "*i64", "w_ptr": PTR, "s_ptr": PTR, "rstd_ptr": PTR,
       "grad_ptr": "*bf16", "dtable_ptr": PTR, "drows_ptr": PTR, "dw_ptr": PTR, "ds_ptr": PTR,
       "M": "i32", "R": "i32"}
WS = {n: t for n, t in BWD.items() if n not in ("dtable_ptr", "drows_ptr")}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resources(fn, sig: dict[str, str], const: dict, warps: int, arch: int) -> dict[str, int]:
    """Registers per thread and local bytes of one compiled kernel."""
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
    cubin = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps}).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    if found[0] is None or found[1] is None:
        raise RuntimeError(f"cuobjdump printed no REG/LOCAL counts:\n{usage}")
    reg, local = int(found[0].group(1)), int(found[1].group(1))
    progs = min(65536 // (reg * 32 * warps), 64 // warps)
    return {"registers": reg, "local_bytes": local, "programs_per_sm": progs,
            "warps_per_sm": progs * warps}


def recipe_kernels(name: str, arch: int) -> dict:
    mem = get_recipe(name).model.memory
    N, R = mem.max_ngram, mem.cp_rank
    flags = {"N": N, "HAS_W": bool(mem.use_absorption) and N > 2, "HAS_S": bool(mem.learn_scales),
             "USE_NORM": bool(mem.use_norm), "BLOCK_R": triton.next_power_of_2(R),
             "SUM_ORDERS": isinstance(mem, TNGramVariantConfig) and mem.order_combine == "sum"}
    rows = {**flags, "NEED_TABLE": True, "BLOCK_M": 16,
            "BLOCK_K": triton.next_power_of_2(N - 1), "ROWS_OUT": False}
    warps0 = k.default_warps(R)
    out = {"max_ngram": N, "cp_rank": R, **{f: flags[f] for f in flags if f != "N"}, "by_warps": {}}
    for w in (warps0, 2 * warps0):
        out["by_warps"][str(w)] = {
            "forward": resources(k._tngram_fwd_kernel, FWD, flags, w, arch),
            "backward fused": resources(k._tngram_bwd_kernel, BWD, {**rows, "ACC_WS": True}, w,
                                        arch),
            "backward split, rows": resources(k._tngram_bwd_kernel, BWD,
                                              {**rows, "ACC_WS": False}, w, arch),
            "backward split, dW/ds": resources(k._tngram_bwd_ws_kernel, WS,
                                               {**flags, "BLOCK_M": k.SPLIT_WS_TOKENS}, w, arch),
            "backward sorted, rows": resources(k._tngram_bwd_kernel, BWD,
                                               {**rows, "ACC_WS": True, "ROWS_OUT": True}, w,
                                               arch),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    ap.add_argument("--out", type=Path, help="write the results JSON here (default: stdout)")
    a = ap.parse_args()
    res = {
        "kind": "triton-registers",
        "command": "python " + " ".join(["research/scripts/triton_registers.py", *sys.argv[1:]]),
        "commit": (git_info(Path(__file__).parent)["commit"] or "?")[:7]
        + (" (with uncommitted changes)" if git_info(Path(__file__).parent)["dirty"] else ""),
        "machine": f"{platform.system()} {platform.machine()}, no GPU (compiled, not run)",
        "triton": triton.__version__,
        "target": f"sm_{a.arch}",
        "recipes": {r: recipe_kernels(r, a.arch) for r in RECIPES},
    }
    text = json.dumps(res, indent=1) + "\n"
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
