"""`python -m research.bench.hf_decode`: what the memory costs a token that transformers'
generate() decodes, on a Hugging Face Llama (hidden 256, 4 layers, vocabulary 32k, CPU, fp32,
batch 1, greedy).

Candidates, alternated in one process (rep i of each before rep i+1 of any; medians):

    raw                  LlamaForCausalLM
    engram, tngram       the same model (same seed) with the memory at `--layers` (HF.md's
                         configs: Engram max_ngram 3, 4 heads x 64 per order; TN-gram max_ngram
                         3, cp_rank 64; non-zero value projections: the output is used)
    hooks only           engram with each memory's forward replaced by zeros_like(h): what the
                         integration (hooks, ids and mask checks, cache state) costs alone

Per generated token = (t(prompt + n tokens) - t(prompt + 1 token)) / (n - 1), in wall time and in
this process's CPU time (the second is less disturbed by other work on a shared machine). The
overhead is each memory's per-token time over raw's. Written as JSON (`--out`), summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from research.bench.common import loadavg, machine_info


def git_head() -> str:
    """HEAD's short hash, "+dirty" when the code a decoded token runs (tngram's memory, kernels
    and hf packages) has uncommitted changes."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[2])]
    run = lambda *a: subprocess.run([*git, *a], capture_output=True, text=True).stdout.strip()
    dirty = run("status", "--porcelain", "tngram/memory", "tngram/kernels", "tngram/hf")
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def build(kind: str, layers: tuple[int, ...]) -> Any:
    import transformers

    from tngram.hf import add_memory
    from tngram.memory.engram import EngramConfig
    from tngram.memory.tngram import TNGramConfig

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # every run decodes its n tokens
    memory = {
        "engram": EngramConfig(
            max_ngram=3, n_head_per_ngram=4, n_embed_per_ngram=64, pad_id=0, zero_init_value=False
        ),
        "tngram": TNGramConfig(max_ngram=3, cp_rank=64, zero_init_value=False),
    }.get(kind.replace("hooks only", "engram"))
    if memory is not None:
        import warnings

        with warnings.catch_warnings():  # the memory outgrows this small model: expected here
            warnings.simplefilter("ignore")
            add_memory(model, memory, layers=layers)
    return model


def run(
    tokens: int = 64,
    prompt_len: int = 16,
    reps: int = 30,
    layers: tuple[int, ...] = (1,),
    threads: int = 1,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    kinds = ["raw", "engram", "tngram", "hooks only"]
    models = {k: build(k, layers) for k in kinds}
    from tngram.hf import memory_modules

    for mem in memory_modules(models["hooks only"]).values():  # the memory's own work taken out
        mem.forward = lambda h, *a, **k: torch.zeros_like(h)
    cands = {k: (models[k], nullcontext) for k in kinds}
    prompt = torch.randint(1, 32000, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    def gen(model: Any, n: int) -> None:
        model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)

    load_before = loadavg()
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in cands}
    with torch.no_grad():
        for i in range(1 + reps):  # the first round warms up
            for name, (model, ctx) in cands.items():
                with ctx():
                    w0, c0 = time.perf_counter(), time.process_time()
                    gen(model, tokens)
                    w1, c1 = time.perf_counter(), time.process_time()
                    gen(model, 1)
                    w2, c2 = time.perf_counter(), time.process_time()
                if i:
                    times[name]["wall"].append(((w1 - w0) - (w2 - w1)) / (tokens - 1))
                    times[name]["cpu"].append(((c1 - c0) - (c2 - c1)) / (tokens - 1))
    rows = {}
    for name, t in times.items():
        row: dict[str, Any] = {}
        for clock in ("wall", "cpu"):
            med, raw = statistics.median(t[clock]), statistics.median(times["raw"][clock])
            row[f"{clock}_ms_per_token"] = 1e3 * med
            row[f"{clock}_tokens_per_s"] = 1.0 / med
            row[f"{clock}_overhead"] = med / raw - 1.0
        rows[name] = row
    return {
        "benchmark": "hf_decode",
        "command": f"python -m research.bench.hf_decode --tokens {tokens} --prompt {prompt_len} "
        f"--reps {reps} --layers {','.join(map(str, layers))} --threads {threads}",
        "commit": git_head(),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "model": "LlamaForCausalLM hidden 256, 4 layers, 4 heads, vocab 32000, fp32, batch 1",
        "memory_layers": list(layers),
        "tokens": tokens,
        "prompt_len": prompt_len,
        "reps": reps,
        "threads": threads,
        "rows": rows,
    }


def report(res: dict[str, Any]) -> str:
    lines = [
        f"{res['command']}  (load {res['loadavg_before']} -> {res['loadavg_after']})",
        f"{'':14s} {'wall ms/tok':>11s} {'tok/s':>7s} {'overhead':>8s}   "
        f"{'CPU ms/tok':>10s} {'tok/s':>7s} {'overhead':>8s}",
    ]
    for name, r in res["rows"].items():
        lines.append(
            f"{name:14s} {r['wall_ms_per_token']:11.3f} {r['wall_tokens_per_s']:7.1f} "
            f"{100 * r['wall_overhead']:+7.1f}%   {r['cpu_ms_per_token']:10.3f} "
            f"{r['cpu_tokens_per_s']:7.1f} {100 * r['cpu_overhead']:+7.1f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.bench.hf_decode", description=__doc__)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--layers", default="1", help="memory layers, comma-separated (default 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the JSON here")
    a = p.parse_args(argv)
    res = run(a.tokens, a.prompt, a.reps, tuple(int(x) for x in a.layers.split(",")), a.threads)
    print(report(res))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
