"""`python -m research bench gpu --sections kernels`: the Triton lookup's backward variants, timed
on the card.

For each chosen recipe with a TN-gram memory, its first TN-gram module's lookup stage
(`memory_vector`, what the model runs before K/V: gathers, products, per-order norm and scale,
the orders summed for order_combine="sum") at the forward+backward batch of the fwdbwd section
(B x T uniform random ids), bf16 output on CUDA as under the trainer's autocast:

    fwd                        the forward alone (the same kernel for every variant)
    <backward>/w<warps>        forward + backward, for backward in kernel_policy's
                               TRITON_BACKWARDS ("fused": one kernel; "split": a rows kernel and a
                               dW / ds kernel; "sorted": the fused kernel storing its row
                               gradients, then a sort-based sum per row) at the forward's num_warps
                               and at twice it
    inductor                   forward + backward of the same stage with no hand-written kernel:
                               the plain-autograd path (model.memory.fused=false) under
                               torch.compile(fullgraph=True), the code inductor generates for it
                               (Triton on CUDA, C++ on the CPU); skipped with compile=False
                               (`--no-compile`). Does the hand-written kernel beat the compiler?

    row_grads                  the factor-gradient adds alone, the part of the backward that
                               runs as atomics: the M x N rows of R fp32 a backward adds into the
                               (N V, R) gradient (`row_grad_adds`), as index_add_ (atomic adds on
                               CUDA), as torch's sort-based index_put_(accumulate=True) under
                               torch.use_deterministic_algorithms, and a copy of the same rows
                               (the bytes alone), for the section's uniform ids and for ids drawn
                               from a Zipf law (p(rank r) ~ 1/r, as token frequencies in text
                               roughly are: a few rows take many of the adds). Whether a backward
                               that sorts before it adds would pay is the card's to say.

All variants are timed in one process, interleaved rep by rep (CUDA events around each call),
so their ratios share the card's state. Each variant's gradients (factors, absorption vectors,
log-scales) are compared with the default's ("fused" at the forward's warps): they differ only
in the fp32 order of the dW / ds sums (inductor's: in its own order, and e cast to bf16 after
an fp32 computation where the kernel writes bf16 itself). `fastest` names the variant with the
lowest median.

Runs where the Triton lookup runs: on CUDA, or on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1, as tests/test_bench_gpu.py runs it at tiny shapes: TINY_KERNEL_SETS and
TINY_KERNEL_TOKENS; those times are the interpreter's, no kernel figures). Elsewhere the item
says why it did not run.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from research.bench.gpu_parts import config, fresh_dynamo, interleaved_ms
from tngram.kernels import kernel_policy
from tngram.kernels.policy import TRITON_BACKWARDS
from tngram.memory.tngram_variants import TNGramVariantConfig

# at tiny shapes (the CPU, under the interpreter) a narrow CP rank, not a power of two (the lane
# masks): the interpreter runs a 1024-wide row op by op
TINY_KERNEL_SETS = ("model.memory.cp_rank=24",)
TINY_KERNEL_TOKENS = 40  # one sequence: 3 programs of the rows kernel, 1 of the dW / ds kernel


def triton_runs_here(device: str) -> str:
    """An empty string when the Triton lookup can run on `device` in this process, else why
    not."""
    from tngram.kernels import triton_available

    if not triton_available():
        return "triton is not installed"
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton lookup runs on CUDA (or on the CPU under TRITON_INTERPRET=1)"
    return ""


def max_rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest relative Frobenius difference ||got_i - ref_i|| / ||ref_i|| over the pairs (fp64)."""
    return max(
        float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        for a, b in zip(got, ref)
    )


def _tngram_module(recipe: str, shapes: Any) -> tuple[Any, Any]:
    """(the first TN-gram module of the recipe's model on the device, or None when it has none;
    the model's config)."""
    from tngram.memory.tngram import TNGram
    from tngram.model.gpt import GPT

    cfg = config(recipe, shapes, list(TINY_KERNEL_SETS) if shapes.tiny else [])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    mods = [m for m in model.modules() if isinstance(m, TNGram)]
    return (mods[0].to(shapes.device), cfg.model) if mods else (None, cfg.model)


def inductor_lookup(
    mod: Any, ids: torch.Tensor, dtype: torch.dtype, summed: bool
) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """(fn, leaves): fn() runs the lookup stage of a copy of `mod` with fused=False (the
    plain-autograd path, the same parameter values) compiled by torch.compile, e cast to
    `dtype`; leaves are the copy's factors, absorption vectors and log-scales, as
    lookup_backwards' leaves of `mod`."""
    plain = copy.deepcopy(mod)
    plain.config = replace(mod.config, fused=False)

    def stage(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, R) summed, else (N-1) R
        return plain.memory_vector(x, None, summed).to(dtype)

    fresh_dynamo()  # one compile per recipe through the same `stage` code: no recompile limit
    compiled = torch.compile(stage, fullgraph=True, dynamic=False)
    leaves = [p for p in (plain.factors, plain.absorb, plain.log_scales) if p is not None]
    return partial(compiled, ids), leaves


def zipf_ids(V: int, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Ids (shape) drawn with p(id r) ~ 1 / (r + 1), r = 0..V-1 (Zipf, exponent 1)."""
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    n = math.prod(shape)
    return torch.multinomial(p, n, replacement=True, generator=g).reshape(shape)


def row_grad_adds(
    N: int,
    V: int,
    R: int,
    pad_id: int,
    id_sets: dict[str, torch.Tensor],
    reps: int,
    warmup: int,
    dev: str,
) -> dict[str, Any]:
    """The factor-gradient adds of one lookup backward alone (module docstring, `row_grads`):
    for each (B, T) id set, rows = the (M N,) flat factor rows the lookup reads
    (ngram_row_index), vals (M N, R) fp32; timed interleaved: index_add_ ("atomic/<ids>"),
    sum_rows_sorted, the sorted backward's sum ("sorted/<ids>"), vals.clone() ("copy"). Each
    sorted sum is compared with its atomic one (`sorted_rel_diff`), and the item records how
    many adds the most-read row takes (`max_row_adds`)."""
    from tngram.kernels.tngram_lookup import ngram_row_index, sum_rows_sorted
    from tngram.memory.ngrams import suffix_ngrams

    g = torch.Generator().manual_seed(1)
    rows = {
        k: ngram_row_index(suffix_ngrams(x, N, pad_id), V).reshape(-1).to(dev)
        for k, x in id_sets.items()
    }
    M = next(iter(rows.values())).numel()
    vals = torch.randn(M, R, generator=g).to(dev)

    def atomic(r: torch.Tensor) -> torch.Tensor:
        return torch.zeros(N * V, R, device=dev).index_add_(0, r, vals)

    def sorted_(r: torch.Tensor) -> torch.Tensor:  # the sorted backward's own sum
        out = torch.zeros(N * V, R, device=dev)
        sum_rows_sorted(out, r, vals)
        return out

    fns: dict[str, Callable[[], Any]] = {"copy": vals.clone}
    for k, r in rows.items():
        fns[f"atomic/{k}"] = partial(atomic, r)
        fns[f"sorted/{k}"] = partial(sorted_, r)
    t = interleaved_ms(fns, reps, warmup, dev)
    out: dict[str, Any] = {"adds": M, "width": R, "rows": N * V, "timings": t}
    for k, r in rows.items():
        a, b = atomic(r), sorted_(r)
        out[f"sorted_rel_diff/{k}"] = max_rel_diff([b], [a])
        out[f"max_row_adds/{k}"] = int(torch.bincount(r.cpu(), minlength=N * V).max())
    return out


def lookup_backwards(recipe: str, shapes: Any, compile: bool = True) -> dict[str, Any]:
    """The item of one recipe (module docstring); compile=False leaves out `inductor`."""
    from tngram.kernels.tngram_triton import default_warps

    dev = shapes.device
    why = triton_runs_here(dev)
    if why:
        return {"error": f"not run: {why}"}
    mod, m = _tngram_module(recipe, shapes)
    if mod is None:
        return {"error": f"not run: {recipe} has no TN-gram memory"}
    c = mod.config
    summed = isinstance(c, TNGramVariantConfig) and c.order_combine == "sum"
    g = torch.Generator().manual_seed(0)
    B, T = (1, TINY_KERNEL_TOKENS) if shapes.tiny else (shapes.batch, m.sequence_len)
    ids = torch.randint(0, m.vocab_size, (B, T), generator=g).to(dev)
    out_dtype = torch.bfloat16 if dev == "cuda" else None
    with torch.no_grad():
        e0 = mod.memory_vector(ids, out_dtype, summed)
    up = torch.randn(e0.shape, generator=g).to(device=dev, dtype=e0.dtype)
    leaves = [p for p in (mod.factors, mod.absorb, mod.log_scales) if p is not None]
    warps = default_warps(c.cp_rank)
    variants = {f"{b}/w{w}": (b, w) for w in (warps, 2 * warps) for b in TRITON_BACKWARDS}

    def fwd() -> None:
        with torch.no_grad(), kernel_policy(lookup_impl="triton"):
            mod.memory_vector(ids, out_dtype, summed)

    def fwdbwd(bwd: str, w: int) -> list[torch.Tensor]:
        with kernel_policy(lookup_impl="triton", triton_backward=bwd, triton_backward_warps=w):
            e = mod.memory_vector(ids, out_dtype, summed)
            return list(torch.autograd.grad(e, leaves, up))

    fns: dict[str, Callable[[], Any]] = {"fwd": fwd}
    fns.update({k: partial(fwdbwd, b, w) for k, (b, w) in variants.items()})
    if compile:
        stage, plain_leaves = inductor_lookup(mod, ids, e0.dtype, summed)
        fns["inductor"] = lambda: list(torch.autograd.grad(stage(), plain_leaves, up))
    t = interleaved_ms(fns, shapes.reps, shapes.warmup, dev)
    grads = {k: fwdbwd(b, w) for k, (b, w) in variants.items()}
    ref = grads[f"fused/w{warps}"]  # the default: what every variant is compared with
    rows: dict[str, Any] = {}
    for k, (b, w) in variants.items():
        diff = max_rel_diff(grads[k], ref)
        rows[k] = {
            "backward": b,
            "warps": w,
            "fwdbwd": t[k],
            "bwd_ms": t[k]["median_ms"] - t["fwd"]["median_ms"],
            "grad_rel_diff": diff,
        }
    if compile:  # its own forward is not timed alone: no bwd_ms
        got = fns["inductor"]()
        rows["inductor"] = {
            "backward": "inductor",
            "warps": None,
            "fwdbwd": t["inductor"],
            "bwd_ms": None,
            "grad_rel_diff": max_rel_diff(got, ref),
        }
    id_sets = {"uniform": ids.cpu(), "zipf": zipf_ids(m.vocab_size, tuple(ids.shape), g)}
    adds = row_grad_adds(
        c.max_ngram, m.vocab_size, c.cp_rank, c.pad_id, id_sets, shapes.reps, shapes.warmup, dev
    )
    return {
        "tokens": int(ids.numel()),
        "ids": "uniform random",
        "max_ngram": c.max_ngram,
        "cp_rank": c.cp_rank,
        "order_combine": "sum" if summed else "concat",
        "use_norm": c.use_norm,
        "absorption": mod.absorb is not None,
        "out_dtype": str(out_dtype or mod.factors.dtype).replace("torch.", ""),
        "fwd": t["fwd"],
        "variants": rows,
        "fastest": min(rows, key=lambda k: rows[k]["fwdbwd"]["median_ms"]),
        "row_grads": adds,
    }
