"""`python -m research bench decode`: incremental-decoding speed of raw, Engram and TN-gram, batch
1.

For each shape (mini, paper-l9) and method, one new token at a time after a short prompt:

    ours   GPT.forward(ids (1, 1), cache=dict)      the model's own decode path
    hf     TngramGPTForCausalLM.generate(...)         through transformers (needs the hf extra);
                                                     per token = (t(n tokens) - t(1 token)) / (n -
                                                     1)

Reported: ms/token and tokens/s (median of interleaved reps, bench.common), the TN-gram/raw and
Engram/raw time ratios, and beside them the analytic per-token FLOP ratio:

    flops/token = 2 * (nn.Linear weights + tied head V*D)            every matmul, memory K/V
    included
                + 4 * D * L * c                                       attention scores and values at
                                                                      context c (mid-decode length)
                + memory elementwise work (per memory layer):
                    TN-gram  (N-1) R * 5   running Hadamard products (N-1)R, absorption (N-2)R,
                                           RMSNorm ~3(N-1)R (square, mean, scale)
                    Engram   0             gathers only (the hash is integer work on N ids)
                  + gate and conv ~ 8 D     (two RMSNorms, dot, sigmoid, conv w=3, SiLU)

Target (the issue): TN-gram/raw time ratio <= 1.1 x the FLOP ratio. Timings on a shared 2-core
machine are noisy: the JSON records threads and load average before and after.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from research.bench.common import interleaved, loadavg, machine_info

if TYPE_CHECKING:
    from tngram.model.gpt import GPT

SHAPES = {"mini": "mini", "paper-l9": "paper-l9"}
METHODS = ("raw", "engram", "tngram")
TARGET = 1.1


def decode_flops(model: GPT, context: int) -> float:
    """Analytic FLOPs of one decoded token at context length `context` (see the module doc)."""
    cfg = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    matmul += model.tok_emb.weight.numel()
    flops = 2.0 * matmul + 4.0 * cfg.n_embd * cfg.n_layer * context
    mem = cfg.memory
    if mem is not None and mem.injection == "block":
        per_layer = 8.0 * cfg.n_embd
        if mem.kind in ("tngram", "tngram-variant"):
            per_layer += 5.0 * (mem.max_ngram - 1) * mem.cp_rank
        flops += per_layer * len(cfg.memory_layers)
    return flops


def build(shape: str, method: str, tiny: bool = False) -> GPT:
    """The recipe's model with random weights (non-zero memory output), eval mode, fp32."""
    from tngram.model.gpt import GPT
    from tngram.train.recipes import get_recipe

    cfg = get_recipe(f"{SHAPES[shape]}-{method}").model
    if cfg.memory is not None:
        cfg = replace(cfg, memory=replace(cfg.memory, zero_init_value=False))
    if tiny:  # for the tests: same code paths, small shapes
        mem = cfg.memory
        if mem is not None and mem.kind in ("tngram", "tngram-variant"):
            mem = replace(mem, cp_rank=16)
        cfg = replace(
            cfg,
            n_layer=2,
            n_embd=32,
            n_head=2,
            n_kv_head=1,
            memory_layers=(0, 1),
            sequence_len=64,
            memory=mem,
        )
    torch.manual_seed(0)
    return GPT(cfg).eval()


def decode_ours(model: nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy incremental decoding with our cache; returns the n new ids (1, n)."""
    cache: dict = {}
    out = []
    with torch.no_grad():
        logits = model(prompt, cache=cache)
        for _ in range(n):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits = model(nxt, cache=cache)
    return torch.cat(out, dim=1)


def run(
    shapes: tuple[str, ...] = ("mini", "paper-l9"),
    methods: tuple[str, ...] = METHODS,
    tokens: int = 64,
    prompt_len: int = 16,
    reps: int = 5,
    warmup: int = 1,
    hf: bool = True,
    tiny: bool = False,
) -> dict[str, Any]:
    from tngram.common import TngramError
    from tngram.train.recipes import get_recipe

    if tokens < 2:
        raise TngramError(f"--tokens must be >= 2, got {tokens}")
    for shape in shapes:  # before any model is built: the whole decode must fit the context
        seq = 64 if tiny else get_recipe(f"{SHAPES[shape]}-raw").model.sequence_len
        if prompt_len + tokens > seq:
            raise TngramError(
                f"--prompt {prompt_len} + --tokens {tokens} must be at most the {shape} "
                f"model's sequence_len {seq}"
            )
    load_before = loadavg()
    rows = []
    use_hf = hf
    if hf:
        try:
            from tngram.hf.gpt_model import from_gpt
        except ModuleNotFoundError:
            use_hf = False
    for shape in shapes:
        models = {m: build(shape, m, tiny) for m in methods}
        V = next(iter(models.values())).config.vocab_size
        prompt = torch.randint(3, V, (1, prompt_len), generator=torch.Generator().manual_seed(0))
        cands: dict[str, Callable[[], Any]] = {}

        def ours(model: nn.Module, n: int, prompt: torch.Tensor = prompt) -> Callable[[], Any]:
            return lambda: decode_ours(model, prompt, n)

        def via_hf(w: Any, kw: dict[str, Any], prompt: torch.Tensor = prompt) -> Callable[[], Any]:
            return lambda: w.generate(prompt, **kw)

        for m, model in models.items():
            cands[f"ours:{m}:n"] = ours(model, tokens)
            cands[f"ours:{m}:1"] = ours(model, 1)
            if use_hf:
                wrapped = from_gpt(model)
                kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
                cands[f"hf:{m}:n"] = via_hf(
                    wrapped, dict(kw, max_new_tokens=tokens, min_new_tokens=tokens)
                )
                cands[f"hf:{m}:1"] = via_hf(wrapped, dict(kw, max_new_tokens=1))
        with torch.no_grad():
            t = interleaved(cands, reps=reps, warmup=warmup)
        context = prompt_len + tokens // 2
        for m, model in models.items():
            row = {
                "shape": shape,
                "method": m,
                "flops_per_token": decode_flops(model, context),
                "context": context,
            }
            for impl in ("ours", "hf") if use_hf else ("ours",):
                per_tok = max(t[f"{impl}:{m}:n"].median - t[f"{impl}:{m}:1"].median, 1e-12) / (
                    tokens - 1
                )
                row[f"{impl}_ms_per_token"] = 1e3 * per_tok
                row[f"{impl}_tokens_per_s"] = 1.0 / per_tok
            rows.append(row)
    out = {
        "benchmark": "decode",
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "tokens": tokens,
        "prompt_len": prompt_len,
        "reps": reps,
        "batch": 1,
        "dtype": "fp32",
        "hf": use_hf,
        "rows": rows,
        "ratios": ratios(rows),
    }
    return out


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Memory/raw time ratio next to the FLOP ratio, per shape and implementation."""
    out = []
    by = {(r["shape"], r["method"]): r for r in rows}
    for (shape, method), r in by.items():
        raw = by.get((shape, "raw"))
        if method == "raw" or raw is None:
            continue
        flop = r["flops_per_token"] / raw["flops_per_token"]
        entry = {"shape": shape, "method": method, "flop_ratio": flop}
        for impl in ("ours", "hf"):
            key = f"{impl}_ms_per_token"
            if key in r:
                tr = r[key] / raw[key]
                entry[f"{impl}_time_ratio"] = tr
                entry[f"{impl}_meets_target"] = tr <= TARGET * flop
        out.append(entry)
    return out


def report(res: dict[str, Any]) -> str:
    mc = res["machine"]
    lines = [
        f"decode, batch 1, fp32, {res['tokens']} new tokens after a {res['prompt_len']}-token "
        f"prompt, "
        f"median of {res['reps']} interleaved reps; {mc['cpu']}, {mc['torch_threads']} threads, "
        f"load {res['loadavg_before']} -> {res['loadavg_after']}",
        f"{'shape':9s} {'method':7s} {'GFLOP/tok':>9s} {'ours ms/tok':>11s} {'ours tok/s':>10s}"
        + (f" {'hf ms/tok':>10s} {'hf tok/s':>9s}" if res["hf"] else ""),
    ]
    for r in res["rows"]:
        line = (
            f"{r['shape']:9s} {r['method']:7s} {r['flops_per_token'] / 1e9:9.4f} "
            f"{r['ours_ms_per_token']:11.3f} {r['ours_tokens_per_s']:10.1f}"
        )
        if res["hf"]:
            line += f" {r['hf_ms_per_token']:10.3f} {r['hf_tokens_per_s']:9.1f}"
        lines.append(line)
    lines.append(f"\nratio vs raw (target: time ratio <= {TARGET} x FLOP ratio)")
    for q in res["ratios"]:
        s = (
            f"{q['shape']:9s} {q['method']:7s} FLOP {q['flop_ratio']:.3f}  "
            f"ours {q['ours_time_ratio']:.3f}"
        )
        s += " (ok)" if q["ours_meets_target"] else " (MISSES)"
        if "hf_time_ratio" in q:
            s += f"  hf {q['hf_time_ratio']:.3f}" + (
                " (ok)" if q["hf_meets_target"] else " (MISSES)"
            )
        lines.append(s)
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    t0 = time.time()
    print(report(run()))
    print(f"{time.time() - t0:.0f} s")
