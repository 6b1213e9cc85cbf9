"""`python -m research bench modules`: the memory modules alone at the paper-l9 shapes, forward +
backward.

Modules (built exactly as the paper-l9 recipes build them, d 512, V 1024, memory layer 1 of
(1, 7)): Engram (orders 2..5, 8 heads x 64 per order, d_mem 2048), TN-gram (N 5, R 1024,
d_mem 4096), Over-Encoding (input n-gram embeddings, 8 slice tables). TN-gram three ways:
"tngram" is what training uses (`fused_lookup` impl "auto": the C kernel on fp32 CPU tensors when
it builds), "tngram-torch" the fused torch-ops path (impl "torch"), "tngram-ref" the
plain-autograd reference of memory/cp.py. "none" has no memory.

Per candidate: (a) the lookup stage alone (`memory_vector`: n-gram extraction/hashing, gathers,
products, norms, scales; everything before the K/V projections), forward + backward into the
tables; (b) the whole module forward(h, ids) + backward into h and every parameter; (c) analytic
bytes of (a) and FLOPs of (b) with the achieved rates; (d) peak memory as the peak-RSS increase
of one fwd+bwd in a fresh process (VmHWM minus the RSS after setup, same allocator env).

Byte model of (a), fp32, per token ("mirror" model, the issue's): forward reads the gathered rows
and writes the memory vector; backward reads the vector's gradient and writes the rows' gradient
-> 2 x (rows + vector) x 4 bytes. TN-gram: rows N R, vector (N-1) R; Engram: rows and vector
(N-1) E. A "full" model adds what each really must also move: the read-modify-write of the
scatter-add (2x rows), TN-gram's re-gather of the rows in the backward (N R), and the zero-fill of
the dense table gradient (once per batch: N V R for TN-gram, rows x 64 for Engram).

FLOP model of (b): matmuls 2 M K N forward, x3 for forward+backward (K and V projections per
branch, Over-Encoding's projection), plus elementwise estimates: the gate/conv ~40 d per token
(same code for both memories) and TN-gram's products/norm ~20 (N-1) R per token fwd+bwd.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from research.bench.common import (
    fmt_ms,
    fmt_si,
    interleaved,
    machine_info,
    matmul_peak,
    peak_rss_delta_subprocess,
    vm_hwm_bytes,
    vm_rss_bytes,
)
from tngram.kernels import kernel_policy

if TYPE_CHECKING:
    from tngram.memory.engram import Engram
    from tngram.memory.overencoding import OverEncoding
    from tngram.memory.tngram import TNGram

    Candidate = Engram | OverEncoding | TNGram  # what build() returns besides None

D_MODEL, VOCAB = 512, 1024
CANDIDATES = ("none", "engram", "tngram", "tngram-torch", "tngram-ref", "oe")
TN_IMPL = {"tngram": "auto", "tngram-torch": "torch"}  # lookup kernel per candidate


@contextmanager
def _impl(name: str) -> Iterator[None]:
    """Run the TN-gram candidates with their lookup kernel (tngram.kernels.kernel_policy)."""
    if name not in TN_IMPL:
        yield
        return
    with kernel_policy(lookup_impl=TN_IMPL[name]):
        yield


def build(name: str) -> nn.Module | None:
    """The paper-l9 module for a candidate name (seeded, so every process builds the same)."""
    from tngram.train.recipes import get_recipe

    torch.manual_seed(0)
    if name == "none":
        return None
    if name not in CANDIDATES:
        raise ValueError(f"unknown candidate {name!r}; valid: {', '.join(CANDIDATES)}")
    kind = {
        "engram": "engram",
        "tngram": "tngram",
        "tngram-torch": "tngram",
        "tngram-ref": "tngram",
        "oe": "oe",
    }[name]
    cfg = get_recipe(f"paper-l9-{kind}").model.memory
    if name == "tngram-ref":
        cfg = replace(cfg, fused=False)
    elif name in TN_IMPL:
        cfg = replace(cfg, fused=True)
    return cfg.build(d_model=D_MODEL, vocab_size=VOCAB, layer_id=1, layer_ids=(1, 7))


def lookup(name: str, m: nn.Module, ids: Tensor) -> Tensor:
    """The lookup stage (B, T) -> memory vector (B, T, d_mem)."""
    with _impl(name):
        return cast("Candidate", m).memory_vector(ids)


def module_forward(name: str, m: nn.Module, h: Tensor, ids: Tensor) -> Tensor:
    with _impl(name):
        return m(h, ids)


def d_mem(name: str, m: nn.Module) -> int:
    if name.startswith("tngram"):
        tn = cast("TNGram", m)
        return (tn.config.max_ngram - 1) * tn.config.cp_rank
    if name == "oe":
        oe = cast("OverEncoding", m)
        return oe.n_tables * oe.slice_dim
    return cast("Engram", m).d_mem


def lookup_bytes(name: str, m: nn.Module, tokens: int) -> dict[str, float]:
    """Analytic bytes of the lookup stage, fwd+bwd, fp32 (module docstring)."""
    if name == "none":
        return {"mirror": 0.0, "full": 0.0}
    vec = d_mem(name, m)
    if name.startswith("tngram"):
        tn = cast("TNGram", m)
        N, R = tn.config.max_ngram, tn.config.cp_rank
        rows, table = N * R, N * tn.vocab_size * R
        extra = N * R  # backward re-gather
    elif name == "oe":
        oe = cast("OverEncoding", m)
        rows, table, extra = vec, oe.n_rows * oe.slice_dim, 0
    else:
        en = cast("Engram", m)
        rows, table, extra = vec, en.n_rows * en.head_dim, 0
    mirror = 2 * (rows + vec) * 4 * tokens
    full = ((rows + vec) + (vec + 2 * rows + extra)) * 4 * tokens + table * 4
    return {"mirror": float(mirror), "full": float(full)}


def module_flops(name: str, m: nn.Module, tokens: int) -> float:
    """Analytic FLOPs of the whole module, fwd+bwd (module docstring)."""
    if name == "none":
        return 0.0
    d = D_MODEL
    vec = d_mem(name, m)
    if name == "oe":
        return 3 * 2 * tokens * vec * d + 10 * tokens * d
    n_proj = cast("Engram | TNGram", m).config.hc_mult + 1  # K per branch + V
    flops = 3 * 2 * tokens * vec * d * n_proj + 40 * tokens * d
    if name.startswith("tngram"):
        flops += 20 * tokens * vec
    return float(flops)


def _peak_child(name: str, part: str, batch: int, seq: int, threads: int) -> int:
    """Run in a fresh process: peak RSS increase of one fwd+bwd of `part` for candidate `name`."""
    torch.set_num_threads(threads)
    m = build(name)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    h = torch.randn(batch, seq, D_MODEL, requires_grad=True)
    if m is None:
        return 0
    base = vm_rss_bytes()
    if part == "lookup":
        e = lookup(name, m, ids)
        e.backward(torch.ones_like(e))
    else:
        y = module_forward(name, m, h, ids)
        y.backward(torch.ones_like(y))
    return max(0, vm_hwm_bytes() - base)


def run(
    names: tuple[str, ...] = CANDIDATES,
    batch: int = 4,
    seq: int = 256,
    reps: int = 15,
    warmup: int = 3,
    memory: bool = True,
    profile: bool = False,
) -> dict[str, Any]:
    """Measure every candidate (interleaved, one process); returns a JSON-able dict."""
    tokens = batch * seq
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    h = torch.randn(batch, seq, D_MODEL, generator=gen).requires_grad_()
    mods = {n: build(n) for n in names}
    live = {n: m for n, m in mods.items() if m is not None}
    g_vec = {n: torch.randn(batch, seq, d_mem(n, m), generator=gen) for n, m in live.items()}
    g_out = torch.randn(batch, seq, D_MODEL, generator=gen)

    def clear(name: str) -> None:
        h.grad = None
        for p in live[name.split(":")[1]].parameters():
            p.grad = None

    def lk(n: str):
        return lambda: lookup(n, live[n], ids).backward(g_vec[n])

    def md(n: str):
        return lambda: module_forward(n, live[n], h, ids).backward(g_out)

    cands = {f"lookup:{n}": lk(n) for n in live}
    cands.update({f"module:{n}": md(n) for n in live})
    load_before = machine_info()["loadavg"]
    times = interleaved(cands, reps, warmup, setup=clear)
    peaks = {"fp32": matmul_peak(torch.float32)}
    info = machine_info()
    info["loadavg_before"] = load_before
    rows: dict[str, Any] = {}
    for n in names:
        m = mods[n]
        if m is None:
            rows[n] = {"params": 0, "note": "no memory: nothing to look up or project (y = 0)"}
            continue
        lt, mt = times[f"lookup:{n}"], times[f"module:{n}"]
        by, fl = lookup_bytes(n, m, tokens), module_flops(n, m, tokens)
        rows[n] = {
            "params": sum(p.numel() for p in m.parameters()),
            "d_mem": d_mem(n, m),
            "lookup": lt.to_dict(),
            "module": mt.to_dict(),
            "lookup_bytes_mirror": by["mirror"],
            "lookup_bytes_full": by["full"],
            "lookup_bytes_per_s": by["mirror"] / lt.median,
            "lookup_full_bytes_per_s": by["full"] / lt.median,
            "module_flops": fl,
            "module_flops_per_s": fl / mt.median,
        }
        if memory:
            for part in ("lookup", "module"):
                rows[n][f"{part}_peak_rss_bytes"] = peak_rss_delta_subprocess(
                    "research.bench.modules",
                    "_peak_child",
                    {
                        "name": n,
                        "part": part,
                        "batch": batch,
                        "seq": seq,
                        "threads": torch.get_num_threads(),
                    },
                )
    out = {
        "benchmark": "modules",
        "shapes": {
            "d_model": D_MODEL,
            "vocab": VOCAB,
            "batch": batch,
            "seq": seq,
            "tokens": tokens,
        },
        "machine": info,
        "matmul_peak_flops": peaks,
        "reps": reps,
        "warmup": warmup,
        "memory_measure": "peak RSS increase (VmHWM - RSS after setup) of one fwd+bwd in a "
        "fresh process"
        if memory
        else None,
        "candidates": rows,
        "ratios": ratios(rows),
    }
    if profile:
        out["profile"] = {
            n: profile_top(n, live[n], ids, h, g_vec[n], g_out)
            for n in live
            if n in ("engram", *TN_IMPL)
        }
    return out


def ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """TN-gram/Engram time ratios beside the analytic ratios (for each TN-gram lookup impl)."""
    out: dict[str, Any] = {}
    en, ref = rows.get("engram"), rows.get("tngram-ref")
    for tn_name in TN_IMPL:
        tn = rows.get(tn_name)
        if not tn or "lookup" not in tn:
            continue
        if en and "lookup" in en:
            r = out[f"{tn_name}/engram"] = {
                "lookup_time": tn["lookup"]["median_s"] / en["lookup"]["median_s"],
                "lookup_time_min": tn["lookup"]["min_s"] / en["lookup"]["min_s"],
                "lookup_bytes_mirror": tn["lookup_bytes_mirror"] / en["lookup_bytes_mirror"],
                "lookup_bytes_full": tn["lookup_bytes_full"] / en["lookup_bytes_full"],
                "module_time": tn["module"]["median_s"] / en["module"]["median_s"],
                "module_time_min": tn["module"]["min_s"] / en["module"]["min_s"],
                "module_flops": tn["module_flops"] / en["module_flops"],
            }
            r["lookup_target_met"] = r["lookup_time"] <= r["lookup_bytes_mirror"]
            r["module_target_met"] = r["module_time"] <= 1.05 * r["module_flops"]
        if ref and "lookup" in ref:
            r = out[f"tngram-ref/{tn_name}"] = {
                "lookup_speedup": ref["lookup"]["median_s"] / tn["lookup"]["median_s"],
                "lookup_speedup_min": ref["lookup"]["min_s"] / tn["lookup"]["min_s"],
                "module_speedup": ref["module"]["median_s"] / tn["module"]["median_s"],
            }
            r["target_met"] = r["lookup_speedup"] >= 3
    return out


def profile_top(
    name: str, m: nn.Module, ids: Tensor, h: Tensor, g_vec: Tensor, g_out: Tensor, rows: int = 12
) -> dict[str, list[list[Any]]]:
    """Self-CPU time per op (ms per fwd+bwd) of the lookup and of the module, top `rows`."""
    from torch.profiler import ProfilerActivity, profile

    res: dict[str, list[list[Any]]] = {}
    for part in ("lookup", "module"):

        def fn(part: str = part) -> None:
            h.grad = None
            for p in m.parameters():  # as in the timed runs: fresh gradients every rep
                p.grad = None
            if part == "lookup":
                lookup(name, m, ids).backward(g_vec)
            else:
                module_forward(name, m, h, ids).backward(g_out)

        for _ in range(2):
            fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn()
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
        res[part] = [[e.key, round(e.self_cpu_time_total / 5000, 3), e.count // 5] for e in ev]
    return res


def report(res: dict[str, Any]) -> str:
    """Human-readable table of `run`'s result."""
    sh, mc = res["shapes"], res["machine"]
    lines = [
        f"python -m research bench modules: paper-l9 shapes (d {sh['d_model']}, V {sh['vocab']}), "
        f"batch {sh['batch']} x {sh['seq']} = {sh['tokens']} tokens, fwd+bwd, "
        f"median of {res['reps']} after {res['warmup']} warm-up (min in brackets)",
        f"machine: {mc['cpu']}, {mc['torch_threads']} torch threads, torch {mc['torch']}, "
        f"load {mc.get('loadavg_before')} -> {mc['loadavg']}, malloc env "
        f"{mc['malloc_env'] or 'default'}",
        f"fp32 matmul peak (2048^3 mm): {fmt_si(res['matmul_peak_flops']['fp32'], 'FLOP/s')}",
        "",
        f"{'candidate':12s} {'params':>11s} {'lookup ms':>17s} {'bytes':>10s} {'B/s':>11s} "
        f"{'module ms':>17s} {'FLOPs':>10s} {'FLOP/s':>12s} {'peak MB lk/mod':>15s}",
    ]
    for n, r in res["candidates"].items():
        if "lookup" not in r:
            lines.append(f"{n:12s} {r['params']:>11,d}  {r['note']}")
            continue
        pk = [r.get(f"{p}_peak_rss_bytes") for p in ("lookup", "module")]
        pk_s = (
            "/".join("?" if x is None else f"{x / 2**20:.0f}" for x in pk)
            if "lookup_peak_rss_bytes" in r
            else "-"
        )
        lines.append(
            f"{n:12s} {r['params']:>11,d} {fmt_ms(r['lookup']['median_s'])} "
            f"({fmt_ms(r['lookup']['min_s']).strip():>6s})"
            f" {r['lookup_bytes_mirror'] / 1e6:8.1f}MB "
            f"{fmt_si(r['lookup_bytes_per_s'], 'B/s'):>11s}"
            f" {fmt_ms(r['module']['median_s'])} ({fmt_ms(r['module']['min_s']).strip():>6s})"
            f" {r['module_flops'] / 1e9:7.2f}G {fmt_si(r['module_flops_per_s'], 'FLOP/s'):>12s} "
            f"{pk_s:>15s}"
        )
    lines.append("")
    for key, r in res["ratios"].items():
        if "lookup_time" in r:
            lines.append(
                f"{key}: lookup time ratio {r['lookup_time']:.2f} (min {r['lookup_time_min']:.2f}) "
                f"vs bytes ratio {r['lookup_bytes_mirror']:.2f} (full model "
                f"{r['lookup_bytes_full']:.2f}) "
                f"-> {'met' if r['lookup_target_met'] else 'NOT met'}; module time ratio "
                f"{r['module_time']:.2f} (min {r['module_time_min']:.2f}) vs FLOP ratio "
                f"{r['module_flops']:.2f} (target <= {1.05 * r['module_flops']:.2f}) -> "
                f"{'met' if r['module_target_met'] else 'NOT met'}"
            )
        else:
            lines.append(
                f"{key}: fused lookup {r['lookup_speedup']:.2f}x faster than plain autograd "
                f"(min {r['lookup_speedup_min']:.2f}x; target >= 3 -> "
                f"{'met' if r['target_met'] else 'NOT met'}), whole module "
                f"{r['module_speedup']:.2f}x"
            )
    for n, parts in res.get("profile", {}).items():
        for part, ops in parts.items():
            lines.append(f"profile {n} {part} (self CPU ms per fwd+bwd, calls):")
            lines.extend(f"    {op:40s} {ms:8.2f} {calls:6d}" for op, ms, calls in ops)
    return "\n".join(lines)
