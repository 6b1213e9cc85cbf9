"""Triton kernels checked in a subprocess, on the CPU: run under the Triton interpreter, and
lowered to an sm_80 cubin without a GPU (triton's bundled ptxas: the interpreter accepts code the
GPU compiler rejects).

    lines = run_under_interpreter(SCRIPT)      # SCRIPT's stdout lines; fails on its stderr
    assert_lowers_to_sm80_cubin("tngram.kernels.tngram_triton", [(KERNEL, SIGNATURE, CONSTS)])

run_under_interpreter runs a Python script with TRITON_INTERPRET=1 and one OpenMP thread.
assert_lowers_to_sm80_cubin compiles each (kernel name in that module, argument types, constexpr
values) with num_warps 4 in a subprocess whose environment has no TRITON_INTERPRET, and fails
unless every case yields a cubin. Both run from the repository root, 300 s at most.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module, cases = json.loads(sys.stdin.read())
    k = importlib.import_module(module)
    for name, sig, const in cases:
        src = ASTSource(fn=getattr(k, name), signature={**sig, **{c: "constexpr" for c in const}},
                        constexprs=const)
        asm = triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}).asm
        assert "cubin" in asm, name
    print("ok")
""")

Case = tuple[str, dict[str, str], dict[str, bool | int]]


def _run(script: str, env: dict[str, str], stdin: str | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def run_under_interpreter(script: str) -> list[str]:
    """The script's stdout lines, run with TRITON_INTERPRET=1 (CPU tensors) and one thread."""
    return _run(script, dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))


def assert_lowers_to_sm80_cubin(module: str, cases: list[Case]) -> None:
    """Each case (kernel name, signature, constexprs) of `module` compiles to an sm_80 cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = _run(COMPILE_SCRIPT, env, stdin=json.dumps([module, cases]))
    assert lines[-1:] == ["ok"], lines
