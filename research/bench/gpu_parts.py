"""The measurements of `python -m research bench gpu` (research.bench.gpu runs them inside its time
budget).

Each function returns one JSON-ready dict. Times are CUDA-event milliseconds on a GPU (synchronised
after every rep) and wall-clock milliseconds on the CPU; "median_ms" is the median of the timed
reps after untimed warm-up reps.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


# torch.cuda.memory_stats() counters: segments the caching allocator had to get from the driver
# (cudaMalloc, which blocks the host) and allocations retried after freeing its cache
ALLOC_COUNTERS = {"cuda_mallocs": "segment.all.allocated", "alloc_retries": "num_alloc_retries"}


def alloc_deltas(before: dict[str, Any], after: dict[str, Any], reps: int) -> dict[str, float]:
    """Per timed call, how often the allocator went to the driver or retried (ALLOC_COUNTERS),
    from two torch.cuda.memory_stats() snapshots around `reps` calls: a step whose tensors
    change size from call to call (row-sparse tables: the distinct rows a batch reads) can
    miss the allocator's cache, and each miss is a blocking cudaMalloc."""
    return {
        name: (after.get(key, 0) - before.get(key, 0)) / max(1, reps)
        for name, key in ALLOC_COUNTERS.items()
    }


def call_ms(fn: Callable[[], Any], dev: str) -> float:
    """Milliseconds of one call of fn: CUDA events around it (then a synchronisation) on a GPU,
    the wall clock on the CPU."""
    if dev == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def spread(ts: list[float]) -> dict[str, Any]:
    """median / min / max ms and the number of timed calls."""
    return {
        "median_ms": statistics.median(ts),
        "min_ms": min(ts),
        "max_ms": max(ts),
        "reps": len(ts),
    }


def timed(fn: Callable[[], Any], reps: int, warmup: int, dev: str) -> dict[str, Any]:
    """median / min / max ms of `reps` calls of fn after `warmup` untimed ones; on CUDA also the
    allocator's trips to the driver per call (`alloc_deltas`)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    before = torch.cuda.memory_stats() if dev == "cuda" else None
    out = spread([call_ms(fn, dev) for _ in range(reps)])
    if before is not None:
        out.update(alloc_deltas(before, torch.cuda.memory_stats(), reps))
    return out


def interleaved_ms(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int, dev: str
) -> dict[str, dict[str, Any]]:
    """key -> median / min / max ms of `reps` timed calls of fns[key] (`call_ms`), after
    `warmup` untimed ones each, one call of every fn per round in turn, round r starting at the
    (r mod n)-th: a drift of clocks or load lands on all alike, and none always follows the same
    other. On CUDA also each key's allocator trips per call (`alloc_deltas`, read around its own
    calls)."""
    keys = list(fns)
    for _ in range(warmup):
        for k in keys:
            fns[k]()
    _sync(dev)
    ts: dict[str, list[float]] = {k: [] for k in keys}
    trips: dict[str, dict[str, float]] = {k: {} for k in keys}
    for r in range(reps):
        for j in range(len(keys)):
            k = keys[(r + j) % len(keys)]
            before = torch.cuda.memory_stats() if dev == "cuda" else None
            ts[k].append(call_ms(fns[k], dev))
            if before is not None:
                d = alloc_deltas(before, torch.cuda.memory_stats(), reps)
                trips[k] = {n: trips[k].get(n, 0.0) + x for n, x in d.items()}
    return {k: {**spread(ts[k]), **trips[k]} for k in keys}


def reset_peak(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(dev: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if dev == "cuda" else None


def _amp(dev: str) -> Any:
    """The trainer's run.dtype=auto: bf16 autocast on CUDA, fp32 on the CPU."""
    return torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")


def matmul_peak(dev: str, tiny: bool) -> dict[str, Any]:
    """Measured matmul FLOP/s: bf16 8192^3 on CUDA, fp32 512^3 on the CPU (tiny run)."""
    if dev == "cuda":
        n, dt = 8192, torch.bfloat16
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        t = timed(lambda: a @ b, 10, 3, dev)
    else:
        n, dt = 512, torch.float32
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = timed(lambda: a @ b, 5, 1, dev)
    return {"flops": 2 * n**3 / (t["median_ms"] / 1e3), "n": n, "dtype": str(dt)[6:]}


def config(
    recipe: str, shapes: Any, extra: list[str] | None = None, data: str | None = None
) -> Any:
    """The recipe's TrainConfig at the run's shapes (tiny sets on the CPU) plus `extra` settings."""
    from tngram.train.recipes import get_recipe, resolve_config

    has_memory = get_recipe(recipe).model.memory is not None
    return resolve_config(recipe, shapes.sets(has_memory) + list(extra or []), data)


# distinct batches a table step cycles through: a row-sparse step's tensors then change size from
# step to step (the distinct rows a batch reads), as in training, and the allocator's trips to the
# driver that this causes are counted
TABLE_BATCHES = 4


def _batch(V: int, B: int, T: int, dev: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) (B, T) of uniform random tokens below V, from `seed`."""
    s = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed)).to(dev)
    return s[:, :-1].contiguous(), s[:, 1:].contiguous()


def doctor_summary(info: dict[str, Any]) -> dict[str, Any]:
    """The parts of `tngram doctor --json` a GPU results file keeps."""
    checks = info.get("self_checks") or {}
    return {
        "passed": all(r.get("passed") for r in checks.values()),
        "self_checks": checks,
        "tngram_lookup": info.get("tngram_lookup"),
        "gpus": info.get("gpus"),
        "advice": info.get("advice"),
    }


def _memory_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().double().clone()
        for n, p in model.named_parameters()
        if p.grad is not None and ".memory." in n
    }


def lookup(shapes: Any) -> dict[str, Any]:
    """Compiled lookup (Triton on CUDA, C on the CPU) vs the torch path: inside paper-l9-tngram
    (loss, max relative memory-gradient error), and one paper-l9 TN-gram module's lookup alone,
    forward + backward, timed per implementation and precision."""
    from research.bench import modules
    from tngram.kernels import kernel_policy
    from tngram.model.gpt import GPT

    dev = shapes.device
    kernel = "triton" if dev == "cuda" else "c"
    cfg = config("paper-l9-tngram", shapes)
    T = cfg.model.sequence_len
    torch.manual_seed(0)
    model = GPT(cfg.model).to(dev)
    x, y = _batch(cfg.model.vocab_size, shapes.lookup_batch, T, dev)
    out: dict[str, Any] = {"kernel": kernel, "batch": shapes.lookup_batch, "seq": T}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        got = {}
        for impl in ("torch", kernel):
            model.zero_grad(set_to_none=True)
            with kernel_policy(lookup_impl=impl):
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(x, y)
                loss.backward()
            got[impl] = (loss.item(), _memory_grads(model))
        (l0, g0), (l1, g1) = got["torch"], got[kernel]
        rel = max(((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item() for n in g0)
        out[f"model_{name}"] = {
            "loss_torch": l0,
            "loss_kernel": l1,
            "max_rel_grad_err": rel,
            "n_grads": len(g0),
        }
    del model
    built = modules.build("tngram")
    assert built is not None  # "tngram" always builds a module
    m: Any = built.to(dev)
    ids = (
        x[:, : min(T, 1024)]
        if shapes.tiny
        else torch.randint(0, 1024, (shapes.lookup_batch, 1024), device=dev)
    )
    for name, bf16 in (("fp32", False), ("bf16", True)):
        for impl in ("torch", kernel):

            def f(impl: str = impl, bf16: bool = bf16) -> None:
                with kernel_policy(lookup_impl=impl):
                    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
                        v = m.memory_vector(ids)
                    v.backward(torch.ones_like(v))
                m.zero_grad(set_to_none=True)

            out[f"time_{impl}_{name}"] = timed(f, shapes.reps, shapes.warmup, dev)
        out[f"speedup_{name}"] = (
            out[f"time_torch_{name}"]["median_ms"] / out[f"time_{kernel}_{name}"]["median_ms"]
        )
    out["lookup_tokens"] = int(ids.numel())
    return out


def fwdbwd(
    recipe: str, shapes: Any, compiled: bool, peaks: tuple[Any, Any], profile: bool = False
) -> dict[str, Any]:
    """Forward + backward of the recipe's model on one micro-batch (bf16 autocast on CUDA),
    eager or torch.compile(dynamic=False) as the trainer compiles; tokens/s, peak memory, MFU.
    profile: after the timing, a few more steps under torch.profiler (research.bench.gpu_profile)
    give the item a "profile": the step's time by kernel and kernel category."""
    from tngram.model.flops import train_flops
    from tngram.model.gpt import GPT

    dev = shapes.device
    cfg = config(recipe, shapes)
    m = cfg.model
    torch.manual_seed(0)
    model = GPT(m).to(dev)
    x, y = _batch(m.vocab_size, shapes.batch, m.sequence_len, dev)
    graphs0 = fresh_dynamo()
    fwd = torch.compile(model, dynamic=False) if compiled else model

    def step() -> None:
        with _amp(dev):
            loss = fwd(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    reset_peak(dev)
    t0 = time.perf_counter()
    step()  # the first call compiles; counted in setup_s
    _sync(dev)
    setup_s = time.perf_counter() - t0
    graphs = _graphs() - graphs0
    if compiled and graphs == 0:  # dynamo gave up (e.g. its recompile limit) and ran eager
        return {"error": "torch.compile compiled no graph: this would be an eager timing"}
    t = timed(step, shapes.reps, shapes.warmup, dev)
    tokens = shapes.batch * m.sequence_len
    flops = train_flops(model, m.n_layer, m.n_embd, m.sequence_len, tokens)
    spec, measured = peaks
    achieved = flops / (t["median_ms"] / 1e3)
    prof = {}
    if profile:  # after the timing and its warm-up: nothing compiles inside the profile
        from research.bench.gpu_profile import profile_steps

        prof["profile"] = profile_steps(step, dev)
    return {
        **t,
        "tokens": tokens,
        "tokens_per_s": tokens / (t["median_ms"] / 1e3),
        "setup_s": setup_s,
        "graphs": graphs,  # graphs dynamo compiled for this item (0 when eager)
        "params": sum(p.numel() for p in model.parameters()),
        "flops": flops,
        "mfu_spec": achieved / spec if spec else None,
        "of_measured_matmul_peak": achieved / measured["flops"],
        "peak_gb": peak_gb(dev),
        **prof,
    }


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def fresh_dynamo() -> int:
    """Forget every model compiled before in this process, and return the graph count so far.
    One process compiles up to a dozen models through the same `GPT.forward`: without this,
    dynamo's recompile limit (8 per code object) is reached and the later "compiled" items run
    eager without an error (the first GPU run of this command: the 9th model's forward)."""
    import torch._dynamo

    torch._dynamo.reset()
    return _graphs()


def _dataset_vocab(data: str | None) -> int | None:
    if data is None:
        return None
    from tngram.data.dataset import open_dataset

    return int(open_dataset(data).vocab_size)


def trainer_compiles(recipe: str, shapes: Any) -> bool:
    """Whether the trainer will compile the recipe's model here (run.compile true, or "auto" on
    CUDA): the trainer item's time estimate then includes a compile."""
    c = config(recipe, shapes).run.compile
    return c is True or (c == "auto" and shapes.device == "cuda")


def trainer(
    recipe: str, shapes: Any, steps: int, data: str | None, extra: list[str] | None = None
) -> dict[str, Any]:
    """`tngram train RECIPE --stop-after steps [--set extra]` (log every step, no checkpoints, a
    short final evaluation) in a throw-away folder; tokens/s = median of the per-step windows
    from step 3."""
    from tngram.train.loop import train

    # a speed measurement on whatever data is at hand: the recipe's schedule may read it many
    # times over, and only the first steps run (tngram.train.health.check_passes)
    sets = [
        "run.log_every=1",
        "run.checkpoint_every=0",
        "run.val_every=0",
        "data.allow_repeat=true",
    ]
    if shapes.tiny:
        sets += ["data.global_batch_tokens=128", "data.micro_batch_seqs=2", "data.val_tokens=2048"]
        sets += ["run.device=cpu"]
    else:
        sets += ["data.val_tokens=1048576"]
    V = _dataset_vocab(data)
    if V is not None:
        sets.append(f"model.vocab_size={V}")
    cfg = config(recipe, shapes, sets + list(extra or []), data)
    out = Path(tempfile.mkdtemp(prefix="tngram-bench-gpu-"))
    graphs0 = fresh_dynamo()
    reset_peak(shapes.device)
    try:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the run's own lines
            summary = train(cfg, out / "run", max_steps=steps, progress=False)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
        env = json.loads((out / "run" / "env.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    row = {}
    if cfg.model.memory is not None and cfg.optim.memory_update != "dense":
        from tngram.kernels.row_update import resolved_row_impl

        row["row_update"] = resolved_row_impl(shapes.device)  # the Triton kernel or torch
    tr = [r for r in rows if "tokens_per_s" in r and "train_loss" in r]
    tps = [r["tokens_per_s"] for r in tr[2:]] or [r["tokens_per_s"] for r in tr]
    return {
        "steps": len(tr),
        "tokens_per_step": cfg.data.global_batch_tokens,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "losses": [round(float(r["train_loss"]), 4) for r in tr],
        "last_train_loss": float(tr[-1]["train_loss"]) if tr else None,
        "val_bpb": summary.get("val_bpb"),
        "wall_s": wall,
        "peak_gb": peak_gb(shapes.device),
        "lookup_impl": env.get("tngram_lookup_impl"),
        "muon_impl": env.get("muon_impl"),  # Muon per matrix ("loop") or stacked by shape
        "sdpa_backend": env.get("sdpa_backend"),  # the attention kernel torch picked (run.sdpa)
        "compile": env.get("compile") or {"setting": str(cfg.run.compile)},  # what ran
        "graphs": _graphs() - graphs0,  # graphs dynamo compiled in the run (0 when eager)
        **row,
    }


# bytes a table step holds per parameter at least: the fp32 weight, its gradient and Adam's two
# moments (16); on the CPU torch's foreach Adam also keeps one parameter-sized temporary (its
# sqrt of the second moment; the fused CUDA Adam none). Activations are not counted.
STEP_BYTES_PER_PARAM = {"cuda": 16, "cpu": 20}


def table_step_need(model: str, V: int, shapes: Any) -> tuple[int, float]:
    """(parameters, GiB at least) of `table_step`'s model at vocabulary V: the parameters counted
    on the meta device (nothing allocated) times STEP_BYTES_PER_PARAM."""
    from dataclasses import replace

    from tngram.model.gpt import GPT

    cfg = config(f"paper-l9-{model}", shapes)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(replace(cfg.model, vocab_size=V)).parameters())
    return n, n * STEP_BYTES_PER_PARAM.get(shapes.device, 16) / GIB


def free_gib(dev: str) -> float | None:
    """Memory free for a new item: the card's free memory (after torch's cache is emptied), or
    on the CPU MemAvailable of /proc/meminfo; None where neither can be read."""
    if dev == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0] / GIB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def memory_shortfall(model: str, V: int, shapes: Any) -> str:
    """Why `table_step` would not fit in memory here ("" when it fits or free memory is unknown):
    the run would otherwise die of it (the CPU's OOM killer takes every item's numbers)."""
    free = free_gib(shapes.device)
    n, need = table_step_need(model, V, shapes)
    if free is None or need <= free:
        return ""
    per = STEP_BYTES_PER_PARAM.get(shapes.device, 16)
    return (
        f"memory: needs at least {need:.1f} GiB ({n:,} parameters x {per} bytes: weight, "
        f"gradient, Adam's moments), {free:.1f} GiB free"
    )


def table_setup(
    model: str, V: int, update: str, shapes: Any
) -> tuple[Callable[[], None], dict[str, Any]]:
    """(step, facts) for `table_step`: the model paper-l9-MODEL at vocabulary V built on the
    device with the trainer's optimisers for optim.memory_update=`update`; step() runs one
    optimiser step on the next of TABLE_BATCHES batches. facts: tokens, parameters, table
    parameters, and which path updates the touched rows (row-sparse updates)."""
    from dataclasses import replace

    from research.bench.common import step_optimizers
    from tngram.model.gpt import GPT
    from tngram.optim.groups import memory_table_params

    dev = shapes.device
    extra = [] if model == "raw" else [f"optim.memory_update={update}"]
    cfg = config(f"paper-l9-{model}", shapes, extra)
    # V above 65536 is refused by the run config (uint16 token shards), not by the model: only the
    # model's section gets V (replacing it inside the run config would run the config's checks)
    o, m = cfg.optim, replace(cfg.model, vocab_size=V)
    torch.manual_seed(0)
    with torch.device(dev):  # initialised on the card: 2.8 B parameters at V 128k
        net = GPT(m)
    opts, table_opt = step_optimizers(
        net, o, o.memory_update, o.memory_catchup, fused=dev == "cuda"
    )
    batches = [
        _batch(V, shapes.table_batch, m.sequence_len, dev, seed) for seed in range(TABLE_BATCHES)
    ]
    done = [0]

    def step() -> None:
        x, y = batches[done[0] % len(batches)]
        done[0] += 1
        with _amp(dev):
            loss = net(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        net.zero_grad(set_to_none=True)

    facts: dict[str, Any] = {
        "tokens": shapes.table_batch * m.sequence_len,
        "batches": len(batches),
        "params": sum(p.numel() for p in net.parameters()),
        "table_params": sum(p.numel() for p in memory_table_params(net)),
    }
    if table_opt is not None:  # which path updated the touched rows (the Triton kernel or torch)
        from tngram.kernels.row_update import resolved_row_impl

        facts["row_update"] = resolved_row_impl(dev)
    return step, facts


def table_step(
    model: str, V: int, update: str, shapes: Any, profile: bool = False
) -> dict[str, Any]:
    """One optimiser step (forward, backward, Adam/Muon and the table optimiser of
    optim.memory_update, as the trainer sets them up) of paper-l9-MODEL at vocabulary V, timed
    alone (the tables section times the candidates of one V interleaved: research.bench.gpu_tables).
    profile: a few more steps under torch.profiler after the timing (research.bench.gpu_profile):
    where a row-sparse step's time goes (the sparse backward, the row update, the rest)."""
    step, facts = table_setup(model, V, update, shapes)
    dev = shapes.device
    reset_peak(dev)
    t = timed(step, shapes.reps, shapes.warmup, dev)
    if profile:  # after the timing and its warm-up
        from research.bench.gpu_profile import profile_steps

        t["profile"] = profile_steps(step, dev)
    return {**t, **facts, "peak_gb": peak_gb(dev)}
