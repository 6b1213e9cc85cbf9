"""`tngram doctor`: what this machine will run, and what to install when something is missing.

Prints the versions (Python, torch, CUDA, triton, the C compiler), the device(s), the CPU's
vector features, torch's threads, which lookup each memory uses on each device/dtype (running
the compiled kernels' first-use self-checks, as the kernel choice does) and their results. Exit
status 0 when every compiled kernel that would be used passed its self-check, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
from typing import Any


def _cc_version(cc: str) -> str | None:
    if shutil.which(cc) is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=20)
        return out.stdout.splitlines()[0] if out.stdout else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f.startswith("amx") for f in flags),
    }


def diagnose() -> dict[str, Any]:
    """Everything `doctor` prints, as a dict (runs the self-checks)."""
    import torch

    import tngram
    from tngram.kernels import resolved_impl, self_check_results, triton_available
    from tngram.kernels.tngram_c import c_build_info

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "tngram": tngram.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "triton": None,
        "cpu": _cpu(),
        "torch_threads": torch.get_num_threads(),
        "lookup_impl_env": os.environ.get("TNGRAM_LOOKUP_IMPL", "auto"),
        "check_ids_env": os.environ.get("TNGRAM_CHECK_IDS", "auto"),
    }
    if triton_available():
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception as e:  # installed but broken
            info["triton"] = f"installed but not importable: {type(e).__name__}: {e}"
    c = c_build_info()
    c["version"] = _cc_version(str(c["cc"]))
    info["c_kernel"] = c
    devices = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    if cuda:
        devices += [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    info["tngram_lookup"] = {
        f"{d}/{str(t).replace('torch.', '')}": resolved_impl(d, t) for d, t in devices
    }
    info["engram_lookup"] = "torch index_select on the hashed rows (every device)"
    info["overencoding_lookup"] = "torch index_select (every device)"
    info["self_checks"] = self_check_results()
    info["attention"], info["muon"] = _attention_and_muon(devices)
    info["sdpa_env"] = "run.sdpa=auto"
    from tngram.optim.muon import forced_muon_impl

    info["muon_impl_env"] = forced_muon_impl()  # TNGRAM_MUON_IMPL, validated
    info["advice"] = advice(info)
    return info


def _attention_and_muon(devices: list[tuple[str, Any]]) -> tuple[dict, dict]:
    """The attention kernel torch picks for paper-l9's attention in each device's training
    dtype (bf16 on CUDA, fp32 on the CPU; run.sdpa=auto), and how Muon runs on each device."""
    import torch

    from tngram.optim.muon import muon_impl
    from tngram.train.recipes import resolve_config
    from tngram.train.sdpa import sdpa_pick

    m = resolve_config("paper-l9-raw", []).model
    heads = (m.n_head, m.n_kv_head, m.n_embd // m.n_head, m.sequence_len)
    train_dtype = {"cpu": torch.float32, "cuda": torch.bfloat16}
    attention = {
        f"{d}/{str(t).replace('torch.', '')}": sdpa_pick(*heads, torch.device(d), t)
        for d, t in train_dtype.items()
        if any(d == dev for dev, _ in devices)
    }
    return attention, {d: muon_impl(d) for d in train_dtype if any(d == x for x, _ in devices)}


def advice(info: dict[str, Any]) -> list[str]:
    """What to install or check, one line each (empty when nothing is missing)."""
    out = []
    c = info["c_kernel"]
    if c["unavailable"]:
        out.append(
            "no working C compiler: the CPU TN-gram lookup uses the slower torch path; install "
            "gcc (Debian/Ubuntu: apt-get install gcc) or set CC to a working compiler"
        )
    elif not c["openmp"]:
        out.append(
            "the C kernel was built without OpenMP (single-threaded): install libgomp "
            "(gcc's OpenMP runtime) or use gcc rather than a compiler without -fopenmp"
        )
    if info["cuda_available"] and not info["triton"]:
        out.append(
            "CUDA without triton: TN-gram runs the torch path on the GPU; pip install triton "
            "(the version your torch build pins)"
        )
    if not info["cuda_available"]:
        out.append(
            "no CUDA device: CPU only. For GPU training install a CUDA build of torch "
            "(https://pytorch.org/get-started/locally/) and triton; then re-run tngram doctor"
        )
    for key, rec in info["self_checks"].items():
        if not rec["passed"]:
            out.append(
                f"the {key} kernel FAILED its self-check (max rel err {rec['max_rel_err']}, "
                f"error {rec['error']}): TN-gram uses the torch path there; please report it "
                "with this output"
            )
    return out


def report(info: dict[str, Any]) -> str:
    cpu, c = info["cpu"], info["c_kernel"]
    vec = ", ".join(k for k in ("avx2", "avx512f", "avx512_bf16", "amx") if cpu[k]) or "none"
    lines = [
        f"tngram {info['tngram']}  python {info['python']}  torch {info['torch']} "
        f"(CUDA build: {info['torch_cuda_build'] or 'no'})",
        f"device: {', '.join(info['gpus']) if info['gpus'] else 'CPU only (no CUDA device)'}",
        f"cpu: {cpu['model']}, {cpu['cores']} cores, vector: {vec}; torch threads "
        f"{info['torch_threads']}",
        f"triton: {info['triton'] or 'not installed'}",
        f"C compiler: {c['cc']} ({c['version'] or 'not found'}); kernel "
        + (
            f"built with {c['flags']}"
            if not c["unavailable"]
            else f"unavailable: {c['unavailable']}"
        ),
        f"TNGRAM_LOOKUP_IMPL={info['lookup_impl_env']}  TNGRAM_CHECK_IDS={info['check_ids_env']}",
        "",
        "lookups:",
    ]
    for key, impl in info["tngram_lookup"].items():
        lines.append(f"  TN-gram {key:14s} -> {impl}")
    lines.append(f"  Engram                 -> {info['engram_lookup']}")
    lines.append(f"  Over-Encoding          -> {info['overencoding_lookup']}")
    picks = ", ".join(f"{k} -> {v}" for k, v in info["attention"].items())
    lines.append(f"attention kernel torch picks for paper-l9 ({info['sdpa_env']}): {picks}")
    muon = ", ".join(f"{k} -> {v}" for k, v in info["muon"].items())
    lines.append(f"Muon's Newton-Schulz: {muon} (TNGRAM_MUON_IMPL={info['muon_impl_env']})")
    lines.append("self-checks (compiled kernel vs plain torch in fp64, forward + gradients):")
    if not info["self_checks"]:
        lines.append(
            "  none run (no compiled kernel would be used, or TNGRAM_LOOKUP_IMPL forces one)"
        )
    for key, r in info["self_checks"].items():
        lines.append(
            f"  {key:18s} {'passed' if r['passed'] else 'FAILED'}: max rel err "
            f"{r['max_rel_err'] if r['max_rel_err'] is None else format(r['max_rel_err'], '.2e')}"
            f" (tolerance {r['tolerance']:g}){', ' + r['error'] if r['error'] else ''}"
        )
    if info["advice"]:
        lines += ["", "to do:"] + [f"  - {a}" for a in info["advice"]]
    return "\n".join(lines)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="versions, device, which lookup each memory uses, kernel self-checks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    info = diagnose()
    print(json.dumps(info, indent=1) if args.json else report(info))
    return 0 if all(r["passed"] for r in info["self_checks"].values()) else 1
