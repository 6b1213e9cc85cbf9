"""`python -m research bench gpu --sections attention`: the GPT's attention alone, per SDPA backend.

Attention is about a third of paper-l9's FLOPs by the bench's count (12 L d T = 57 M of 159 M a
token at T 1024, the rest 6 x 17.0 M matmul parameters). torch's scaled_dot_product_attention picks
its kernel by a priority list that depends on the torch build, the card and the cuDNN version:
FlashAttention 2, cuDNN's fused attention, the memory-efficient kernel or the math fallback.
parameter-golf enables only flash; reports disagree on which is faster on Hopper. This item times,
at paper-l9-raw's attention shapes and the fwdbwd batch (q (B, H, T, D) and k, v (B, H_kv, T, D),
laid out as the model's transposed projections, causal, GQA), forward + backward of:

    default        what torch picks here, named in `default_backend`
    <backend>      torch restricted to one backend (sdpa_kernel); an error if it cannot run

interleaved round by round in one process (research.bench.gpu_parts.interleaved_ms), each with
its FLOP rate (7 B H T^2 D a causal forward + backward: 2 for the forward's two matmuls over
half the square, 2.5 times that for the backward) and its output and gradients compared with
the math backend's on fp32 copies of q, k, v (`rel_diff`: bf16 rounding on CUDA, which bounds
it at about 1e-2; 0 up to fp32 order on the CPU). bf16 on CUDA, fp32 on the CPU (tiny shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from research.bench.gpu_kernels import max_rel_diff
from research.bench.gpu_parts import config, interleaved_ms
from tngram.train.sdpa import SDPA_SETTINGS, sdpa_backend, sdpa_name

BACKENDS = SDPA_SETTINGS[1:]  # cudnn, flash, efficient, math


def attention_backends(shapes: Any) -> dict[str, Any]:
    """The item (module docstring)."""
    from torch.nn.attention import sdpa_kernel

    dev = shapes.device
    m = config("paper-l9-raw", shapes).model
    B, T, H, KV = shapes.batch, m.sequence_len, m.n_head, m.n_kv_head
    D = m.n_embd // H
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)

    def leaf(heads: int) -> torch.Tensor:  # (B, heads, T, D) as the model's x.view().transpose()
        x = torch.randn(B, T, heads, D, generator=g).to(device=dev, dtype=dtype)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = leaf(H), leaf(KV), leaf(KV)
    up = torch.randn(B, T, H, D, generator=g).to(device=dev, dtype=dtype).transpose(1, 2)
    gqa = KV != H

    def run(
        backend: str | None, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (q, k, v)
    ) -> list[torch.Tensor]:
        ctx = sdpa_kernel(sdpa_backend(backend)) if backend else torch.enable_grad()
        with ctx:
            a, b, c = qkv
            y = F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)
            return [y.detach(), *torch.autograd.grad(y, qkv, up.to(y.dtype))]

    with torch.no_grad():
        choice = sdpa_name(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa))
    # the reference for every backend's values: the math backend on fp32 copies
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = run("math", (q32, k32, v32))
    fns: dict[str, Callable[[], Any]] = {"default": lambda: run(None)}
    rows: dict[str, dict[str, Any]] = {}
    for name in BACKENDS:
        try:
            got = run(name)
        except RuntimeError as e:  # this backend cannot run these shapes on this device
            rows[name] = {"error": str(e).strip().splitlines()[0][:200]}
            continue
        rows[name] = {"rel_diff": max_rel_diff(got, ref)}
        fns[name] = partial(run, name)
    t = interleaved_ms(fns, shapes.reps, shapes.warmup, dev)
    flops = 7 * B * H * T * T * D
    for name, timing in t.items():
        rows.setdefault(name, {}).update(
            {"fwdbwd": timing, "tflops": flops / (timing["median_ms"] * 1e-3) / 1e12}
        )
    rows["default"]["backend"] = choice
    timed = [n for n in BACKENDS if "fwdbwd" in rows[n]]
    return {
        "shape": {"batch": B, "heads": H, "kv_heads": KV, "seq": T, "head_dim": D},
        "dtype": str(dtype).replace("torch.", ""),
        "default_backend": choice,
        "flops_fwdbwd": flops,
        "backends": rows,
        "fastest": min(timed, key=lambda n: rows[n]["fwdbwd"]["median_ms"]) if timed else None,
    }
