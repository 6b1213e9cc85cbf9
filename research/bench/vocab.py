"""`python -m research bench vocab`: the training step as the vocabulary (and so every memory
table) grows.

For each V in `vocabs` the mini backbone (`mini-raw`, `mini-engram`, `mini-tngram` recipes with
model.vocab_size = V; Engram's table budget 5 V per head and TN-gram's V x R factors grow with it)
runs one optimiser step of one micro-batch (8 x 256 random tokens, bf16 autocast on CPU): forward,
backward, a gradient-norm clip call (as with optim.grad_clip_norm > 0; threshold never reached),
Muon for matrices, Adam for the rest, and for the memory tables each
`optim.memory_update` option ("dense" Adam, "sparse" lazy SparseAdam, "rowwise" RowwiseAdam; and
"sparse+catchup" / "rowwise+catchup" with optim.memory_catchup) -
the trainer's optimiser set-up (`tngram.optim.memory_update.setup_memory_update`). The candidates
of one V are timed interleaved in this process (medians of `reps` after `warmup` untimed steps);
the raw model is timed in the same rounds, so "overhead" = memory step - raw step of the same V.

Reported per candidate: step median/min, the memory's overhead, the optimiser-state bytes of the
table parameters divided by their count (exact, from the optimiser's state tensors after the
steps), and with `peak=True` the peak RSS increase of two steps in a fresh process (model built
before the baseline is read: the peak covers gradients, optimiser state and activations, not the
weights). A V whose candidates would not fit in `max_gb` (weights + gradients + state, estimated)
is timed in groups (raw in each), and candidates that do not fit alone are skipped and listed.

Goals (issue "memory at scale"): with sparse, the overhead at V=32k at most 1.5x the one at 1k,
and at 128k the TN-gram step at most 1.3x the raw step; rowwise at most 5 bytes of state per
table parameter.
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable

import torch

from research.bench.common import fmt_ms, interleaved, machine_info, peak_rss_delta_subprocess

DEFAULT_VOCABS = (1024, 8192, 32768, 131072)
MODELS = ("raw", "engram", "tngram")
UPDATES = ("dense", "sparse", "rowwise")
# also accepted: "sparse+catchup" / "rowwise+catchup" (optim.memory_catchup with that update)
UPDATE_CHOICES = UPDATES + ("sparse+catchup", "rowwise+catchup")


def _config(model: str, vocab: int):  # noqa: ANN202
    from tngram.train.recipes import get_recipe

    cfg = get_recipe(f"mini-{model}")
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab))


def build(
    model: str, vocab: int, update: str, batch: int = 8, seq: int = 256, dtype: str = "bf16"
) -> tuple[Callable[[], None], dict[str, Any]]:
    """A closure doing one training step, and facts about the candidate (sizes, optimisers)."""
    from research.bench.common import step_optimizers
    from tngram.model.gpt import GPT
    from tngram.optim.groups import memory_table_params
    from tngram.optim.memory_update import clip_grad_norm

    cfg = _config(model, vocab)
    o = cfg.optim
    torch.manual_seed(cfg.run.seed)
    net = GPT(cfg.model)
    mode, _, catchup = update.partition("+")
    opts, _ = step_optimizers(net, o, mode, bool(catchup))
    gen = torch.Generator().manual_seed(0)
    s = torch.randint(1, vocab, (batch, seq + 1), generator=gen)
    x, y = s[:, :-1].contiguous(), s[:, 1:].contiguous()
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bf16" else nullcontext
    params = list(net.parameters())

    def step() -> None:
        with ctx():
            loss = net(x, y)
        loss.backward()
        # the trainer's call when optim.grad_clip_norm > 0 (the recipes' default is 0, no call):
        # a full-gradient norm, so a dense table pays one extra pass; never clips here
        clip_grad_norm(params, 1e9)
        for opt in opts:
            opt.step()
        net.zero_grad(set_to_none=True)

    tables = memory_table_params(net)
    facts = {
        "model": model,
        "vocab": vocab,
        "update": update,
        "tokens": batch * seq,
        "dtype": dtype,
        "params": sum(p.numel() for p in params),
        "table_params": sum(p.numel() for p in tables),
        "_net": net,
        "_opts": opts,
        "_tables": tables,
    }
    return step, facts


def _state_bytes_per_table_param(facts: dict[str, Any]) -> float | None:
    from tngram.optim.memory_update import optimizer_state_bytes

    n = facts["table_params"]
    if not n:
        return None
    return sum(optimizer_state_bytes(o, facts["_tables"]) for o in facts["_opts"]) / n


def estimate_bytes(model: str, vocab: int, update: str) -> int:
    """Weights + gradient + optimiser state, fp32, from the parameter count (meta device)."""
    from tngram.model.gpt import GPT

    cfg = _config(model, vocab)
    with torch.device("meta"):
        net = GPT(cfg.model)
        from tngram.optim.groups import memory_table_params

        t = sum(p.numel() for p in memory_table_params(net))
    rest = net.num_params() - t
    table_state = {"dense": 8 + 4, "sparse": 8, "rowwise": 4.2}[
        update.partition("+")[0]
    ]  # + dense grad for dense
    return int(4 * rest * 3 + 4 * t + table_state * t)


def peak_step_bytes(model: str, vocab: int, update: str, threads: int = 1) -> int:
    """Run in a fresh process: build the candidate, read RSS, run two steps; returns VmHWM - RSS."""
    from research.bench.common import vm_hwm_bytes, vm_rss_bytes

    torch.set_num_threads(threads)
    step, _ = build(model, vocab, update)
    gc.collect()
    base = vm_rss_bytes()
    step()
    step()
    return vm_hwm_bytes() - base


def run(
    vocabs: tuple[int, ...] = DEFAULT_VOCABS,
    reps: int = 5,
    warmup: int = 1,
    updates: tuple[str, ...] = UPDATES,
    models: tuple[str, ...] = ("engram", "tngram"),
    max_gb: float = 8.0,
    peak: bool = True,
    threads: int = 1,
    large_reps: int = 3,
    peak_max_vocab: int = 32768,
    large_updates: tuple[str, ...] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time every candidate (module docstring); V >= 65536 runs `large_reps` reps (a step takes
    tens of seconds there) and only `large_updates` (default: all), and peak RSS is measured up
    to `peak_max_vocab`. Each step's wall time and CPU time (time.process_time: with one thread,
    the step's own work, without the time it waited for a core on a busy machine) are kept;
    overheads and ratios are computed from both."""
    torch.set_num_threads(threads)
    load_before = machine_info()["loadavg"]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for V in vocabs:
        ups = updates if (V < 65536 or large_updates is None) else large_updates
        cands = [("raw", "dense")] + [(m, u) for m in models for u in ups]
        est = {c: estimate_bytes(c[0], V, c[1]) for c in cands}
        cap = max_gb * 1e9
        groups: list[list[tuple[str, str]]] = []
        cur: list[tuple[str, str]] = []
        for c in cands[1:]:
            if est[("raw", "dense")] + est[c] > cap:
                skipped.append(
                    f"{c[0]}/{c[1]} at V={V} (~{est[c] / 1e9:.1f} GB > --max-gb {max_gb:g})"
                )
                continue
            if cur and est[("raw", "dense")] + sum(est[d] for d in cur) + est[c] > cap:
                groups.append(cur)
                cur = []
            cur.append(c)
        if cur:
            groups.append(cur)
        for gi, group in enumerate(groups):
            steps, facts = {}, {}
            for m, u in [("raw", "dense"), *group]:
                key = f"{m}/{u}"
                steps[key], facts[key] = build(m, V, u)
            say(f"bench vocab: V={V} group {gi + 1}/{len(groups)}: {', '.join(steps)}")
            cpu: dict[str, list[float]] = {k: [] for k in steps}
            n_reps = reps if V < 65536 else large_reps
            times = interleaved(
                {k: _cpu_timed(fn, cpu[k]) for k, fn in steps.items()}, n_reps, warmup
            )
            cpu = {k: v[warmup:] for k, v in cpu.items()}
            raw, raw_min = times["raw/dense"].median, times["raw/dense"].best
            raw_cpu = statistics.median(cpu["raw/dense"])
            for key, t in times.items():
                f = facts[key]
                if key == "raw/dense" and gi > 0:
                    continue
                row = {k: v for k, v in f.items() if not k.startswith("_")}
                step_cpu = statistics.median(cpu[key])
                row.update(
                    step_cpu_s=step_cpu,
                    overhead_cpu_s=step_cpu - raw_cpu if key != "raw/dense" else 0.0,
                    ratio_to_raw_cpu=step_cpu / raw_cpu,
                    raw_step_cpu_s=raw_cpu,
                )
                row.update(
                    step=t.to_dict(),
                    overhead_s=t.median - raw if key != "raw/dense" else 0.0,
                    overhead_min_s=t.best - raw_min if key != "raw/dense" else 0.0,
                    raw_step_s=raw,
                    ratio_to_raw=t.median / raw,
                    ratio_to_raw_min=t.best / raw_min,
                    state_bytes_per_table_param=_state_bytes_per_table_param(f),
                )
                rows.append(row)
                say(
                    f"  {key:16s} V={V:6d} step {fmt_ms(t.median)} "
                    f"cpu {step_cpu * 1e3:9.1f} ms, overhead "
                    f"{row['overhead_s'] * 1e3:8.1f} ms (cpu {row['overhead_cpu_s'] * 1e3:8.1f}) "
                    f"state/table param "
                    f"{row['state_bytes_per_table_param']}"
                )
            del steps, facts, times
            gc.collect()
    if peak:
        for row in rows:
            if row["vocab"] > peak_max_vocab:
                continue
            row["peak_rss_delta_bytes"] = peak_rss_delta_subprocess(
                "research.bench.vocab",
                "peak_step_bytes",
                {
                    "model": row["model"],
                    "vocab": row["vocab"],
                    "update": row["update"],
                    "threads": threads,
                },
                env={"OMP_NUM_THREADS": str(threads)},
                timeout=1800,
            )
            say(
                f"  peak {row['model']}/{row['update']} V={row['vocab']}: "
                f"{row['peak_rss_delta_bytes']}"
            )
    info = machine_info()
    info["loadavg_before"] = load_before
    res = {
        "benchmark": "vocab",
        "machine": info,
        "reps": reps,
        "large_reps": large_reps,
        "peak_max_vocab": peak_max_vocab,
        "warmup": warmup,
        "threads": threads,
        "batch": 8,
        "seq": 256,
        "dtype": "bf16",
        "max_gb": max_gb,
        "rows": rows,
        "skipped": skipped,
    }
    res["goals"] = goals(res)
    return res


def _cpu_timed(fn: Callable[[], None], sink: list[float]) -> Callable[[], None]:
    def wrapped() -> None:
        c0 = time.process_time()
        fn()
        sink.append(time.process_time() - c0)

    return wrapped


def _row(res: dict[str, Any], model: str, update: str, V: int) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in res["rows"]
            if r["model"] == model and r["update"] == update and r["vocab"] == V
        ),
        None,
    )


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, from the measured rows (None where a needed row did not run)."""
    out: dict[str, Any] = {}
    for m in ("engram", "tngram"):
        for u in UPDATE_CHOICES:
            a, b = _row(res, m, u, 1024), _row(res, m, u, 32768)
            if a and b and a["overhead_s"] > 0:
                out[f"{m}/{u} overhead 32k / 1k"] = b["overhead_s"] / a["overhead_s"]
            if a and b and a["overhead_min_s"] > 0:
                out[f"{m}/{u} overhead 32k / 1k (min)"] = b["overhead_min_s"] / a["overhead_min_s"]
            if a and b and a["overhead_cpu_s"] > 0:
                out[f"{m}/{u} overhead 32k / 1k (cpu)"] = b["overhead_cpu_s"] / a["overhead_cpu_s"]
        for u in UPDATE_CHOICES:
            r = _row(res, m, u, 131072)
            if r:
                out[f"{m}/{u} step / raw at 128k"] = r["ratio_to_raw"]
                out[f"{m}/{u} step / raw at 128k (min)"] = r["ratio_to_raw_min"]
                out[f"{m}/{u} step / raw at 128k (cpu)"] = r["ratio_to_raw_cpu"]
    for r in res["rows"]:
        if r["update"] == "rowwise" and r["state_bytes_per_table_param"] is not None:
            key = f"{r['model']}/rowwise max state bytes per table param"
            out[key] = max(out.get(key, 0.0), r["state_bytes_per_table_param"])
    return out


def report(res: dict[str, Any]) -> str:
    mc = res["machine"]
    lines = [
        f"python -m research bench vocab: 1 step of {res['batch']} x {res['seq']} tokens, "
        f"{res['dtype']} "
        f"autocast, {res['threads']} thread(s), median of {res['reps']} interleaved reps",
        f"machine: {mc['cpu']}, torch {mc['torch']}, load {mc.get('loadavg_before')} -> "
        f"{mc['loadavg']}",
        "",
        f"{'model/update':16s} {'V':>7s} {'table params':>13s} {'wall ms':>10s} {'cpu ms':>9s} "
        f"{'x raw':>6s} {'overhead cpu ms':>15s} {'state B/param':>13s} {'peak MB':>9s}",
    ]
    for r in res["rows"]:
        sb = r["state_bytes_per_table_param"]
        pk = r.get("peak_rss_delta_bytes")
        lines.append(
            f"{r['model'] + '/' + r['update']:16s} {r['vocab']:7d} {r['table_params']:13,d} "
            f"{r['step']['median_s'] * 1e3:10.1f} {r['step_cpu_s'] * 1e3:9.1f} "
            f"{r['ratio_to_raw_cpu']:6.2f} {r['overhead_cpu_s'] * 1e3:15.1f} "
            f"{'-' if sb is None else f'{sb:.2f}':>13s} "
            f"{'-' if pk is None else f'{pk / 1e6:.0f}':>9s}"
        )
    if res["skipped"]:
        lines += ["", "not run: " + "; ".join(res["skipped"])]
    lines += [""] + [f"{k}: {v:.3f}" for k, v in res["goals"].items()]
    return "\n".join(lines)
