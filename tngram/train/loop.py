"""The training loop: the one place that wires model, optimisers, data, evaluation and records.

Follows parameter-golf's baseline trainer (train_gpt.py) with the paper's App. E recipe:

    for step in 0 .. stop-1:
        for each of grad_accum micro-steps:      (DDP all-reduces gradients on the last only)
            loss = model(x, y) ; (loss / grad_accum).backward()
        mu    = muon_momentum(step) ; lr_g = base_lr_g * lr_multiplier(step)   (every group g)
        Muon.step() ; Adam.step() ; zero grads

Before the model is built the global RNG is seeded with run.seed (memory modules seed their own
RNG, so backbone init is identical across methods). bf16 autocast on CUDA (run.dtype "auto"),
fp32 on CPU unless run.dtype=bf16; parameters stay fp32 (parameter-golf keeps the tied
embedding itself in bf16; we keep fp32 master weights everywhere).

A run is resumable from its latest checkpoint and bit-identical on CPU to an uninterrupted run:
weights, optimiser moments, loader position and RNG are restored, and the schedules depend only
on the step. A non-finite training loss stops the run before the update (TngramError), leaving
the checkpoints written so far untouched; parameters are also checked before every checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tngram.common import TngramError, atomic_write_json
from tngram.eval.bpb import evaluate_bpb
from tngram.model.gpt import GPT
from tngram.optim.groups import build_param_groups, format_param_table
from tngram.optim.memory_update import clip_grad_norm, setup_memory_update
from tngram.train.warmstart import apply_warmstart
from tngram.optim.muon import Muon
from tngram.optim.schedules import lr_multiplier, muon_momentum
from tngram.train import checkpoint as ckpt
from tngram.train.config import TrainConfig, validate_config
from tngram.train.dist import (DistContext, all_reduce_mean, all_true, barrier, broadcast_str,
                               grad_accum_steps, init_distributed, no_sync, shutdown,
                               sync_sparse_grads, wrap_ddp)
from tngram.train.health import LossHealth, check_batch_vs_data, check_step_memory
from tngram.train.metrics import MetricsLog, Progress, check_logger, env_info
from tngram.train.portable import record_dataset
from tngram.train.rundir import claim_run_dir, release_run_dir

# run.* fields that may change between an interrupted run and its resumption
RESUMABLE_RUN_FIELDS = ("log_every", "val_every", "checkpoint_every", "keep_checkpoints", "threads")


def autocast_dtype(run_dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; on CPU only when asked (run.dtype=bf16)."""
    if run_dtype == "bf16" or (run_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def delta_params(cfg: TrainConfig) -> dict[str, int]:
    """total / memory / delta parameter counts, computed on the meta device (no allocation)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
        raw = GPT(replace(cfg.model, memory=None))
    return {"total_params": model.num_params(), "memory_params": model.memory_params(),
            "delta_params": model.num_params() - raw.num_params()}


def live_sizes(model: torch.nn.Module, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` (from delta_params) updated to the model's actual shapes (after CP-rank pruning)."""
    raw_total = sizes["total_params"] - sizes["delta_params"]
    total = model.num_params()
    return {"total_params": total, "memory_params": model.memory_params(),
            "delta_params": total - raw_total}


def _prune_at_step(cfg: TrainConfig, world_size: int) -> int:
    """The adaptive CP-rank pruning step of the memory config (0: none), checked."""
    at = int(getattr(cfg.model.memory, "prune_at_step", 0) or 0)
    if at and at >= cfg.schedule.steps:
        raise TngramError(f"model.memory.prune_at_step ({at}) must be < schedule.steps "
                          f"({cfg.schedule.steps}); 0 switches pruning off")
    if at and world_size > 1:
        raise TngramError("model.memory.prune_at_step > 0 (adaptive CP rank) runs in one process only; "
                          "DDP cannot change parameter shapes mid-run")
    return at


def train(cfg: TrainConfig, out_dir: str | Path, resume: bool = False,
          max_steps: int | None = None, logger: str = "none",
          progress: bool | None = None) -> dict[str, Any]:
    """Train `cfg` into run folder `out_dir`; returns the summary (also DIR/summary.json).

    max_steps stops after that many optimiser steps of the recipe's schedule (the schedule
    itself is unchanged, so a later --resume can continue it). Under torchrun every process
    calls this; only the main process writes files. logger: "none" | "tensorboard" | "wandb"
    (metrics.jsonl is always written). progress: a tqdm bar (True), plain lines every
    run.log_every steps (False), or None: a bar only when stderr is a terminal.
    """
    validate_config(cfg)
    check_logger(logger)
    if progress is None:
        progress = sys.stderr.isatty()
    if max_steps is not None and max_steps < 1:
        raise TngramError(f"--steps must be >= 1, got {max_steps}")
    run_dir = Path(out_dir)
    else:
        _choose_threads(ctx, threads)
    check_step_memory(cfg)                     # before the folder exists or anything is allocated
    ctx = init_distributed(cfg.run.device)
    threads = torch.get_num_threads()
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    lock = None
    try:
        lock = _claim(run_dir, cfg, resume, ctx)
        return _train(cfg, run_dir, ctx, resume, max_steps, logger, progress)
    finally:
        if lock is not None:
def _choose_threads(ctx: DistContext, default: int) -> None:
    """run.threads 0 on CPU without OMP_NUM_THREADS: keep torch's default unless other jobs keep
    the CPUs busy or a quota caps them (tngram.cpu.choose_threads); say so in one line when the
    count changes. On an idle machine nothing changes."""
    import os

    from tngram.cpu import auto_threads
    if ctx.device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    choice = auto_threads(default)
    if choice.changed:
        torch.set_num_threads(choice.threads)
        if ctx.is_main:
            print(f"tngram: note: {choice.reason}", flush=True)


            release_run_dir(lock)
        torch.set_num_threads(threads)
        shutdown(ctx)


def _claim(run_dir: Path, cfg: TrainConfig, resume: bool, ctx: DistContext):
    """The main process checks and locks the run folder; every process fails together if it can't."""
    lock, err = None, None
    if ctx.is_main:
        try:
            lock = claim_run_dir(run_dir, cfg.name, resume)
            if lock.stale:
                print(f"tngram: note: took over the lock of {run_dir} from pid {lock.stale.get('pid')} "
                      f"on {lock.stale.get('host')}, which is no longer running")
        except TngramError as e:
            err = str(e)
    err = broadcast_str(err, ctx)
    if err is not None:
        if lock is not None:
            release_run_dir(lock)
        raise TngramError(err)
    return lock


def _check_resume_config(run_dir: Path, checkpoint: Path, cfg: TrainConfig) -> None:
    """The checkpoint's config must equal `cfg` except for RESUMABLE_RUN_FIELDS."""
    saved = ckpt._load_json(checkpoint / "meta.json").get("config")
    if saved is None:
        saved = ckpt.read_run_config(run_dir)
    new = json.loads(json.dumps(cfg.to_dict()))
    for d in (saved, new):
        for k in RESUMABLE_RUN_FIELDS:
            d.get("run", {}).pop(k, None)
    if saved != new:
        diffs = [f"{sec}.{k}" for sec in new if isinstance(new[sec], dict)
                 for k in set(new[sec]) | set(saved.get(sec, {}))
                 if new[sec].get(k) != saved.get(sec, {}).get(k)]
        diffs += [k for k in new if not isinstance(new[k], dict) and new[k] != saved.get(k)]
        raise TngramError(f"cannot resume {run_dir}: the checkpoint's config differs in {sorted(diffs)}; "
                          f"resume with the same recipe and --set overrides (only run."
                          f"{{{','.join(RESUMABLE_RUN_FIELDS)}}} may change)")


def _open_data(cfg: TrainConfig, ctx: DistContext):
    from tngram.data.build import ensure_default_data, open_dataset, validate_dataset
    data_dir = cfg.data.dir
    if data_dir is None:  # the default corpus: built once by the main process
        data_dir = str(ensure_default_data(vocab_size=cfg.model.vocab_size)) if ctx.is_main else None
        data_dir = broadcast_str(data_dir, ctx)
    info = open_dataset(data_dir)
    if info.vocab_size != cfg.model.vocab_size:
        raise TngramError(f"model.vocab_size is {cfg.model.vocab_size} but the dataset {info.dir} has "
                          f"vocab {info.vocab_size}; pass --set model.vocab_size={info.vocab_size}")
    err = None
    if ctx.is_main:        # every shard, before step 1 (cached in the dataset's manifest)
        try:
            validate_dataset(info, cfg.model.vocab_size)
        except TngramError as e:
            err = str(e)
    err = broadcast_str(err, ctx)
    if err is not None:
        raise TngramError(err)
    return info


def _train(cfg: TrainConfig, run_dir: Path, ctx: DistContext, resume: bool,
           max_steps: int | None, logger: str = "none", bar: bool = True) -> dict[str, Any]:
    say = print if ctx.is_main else (lambda *a, **k: None)
    seq_len = cfg.model.sequence_len
    accum = grad_accum_steps(cfg.data.global_batch_tokens, cfg.data.micro_batch_seqs, seq_len,
                             ctx.world_size)
    steps = cfg.schedule.steps
    prune_at = _prune_at_step(cfg, ctx.world_size)
    stop = min(steps, max_steps) if max_steps is not None else steps

    # ---- run folder: refuse to overwrite checkpoints; on resume take the newest checkpoint
    # that verifies (saying which newer ones are skipped), and its config must match
    existing = ckpt.list_checkpoints(run_dir)
    if existing and not resume:
        raise TngramError(f"{run_dir} already holds a run with checkpoints; pass --resume to "
                          f"continue it or choose another --out")
    latest = ckpt.newest_good_checkpoint(run_dir, say) if resume else None
    if resume and existing and latest is None:
        raise TngramError(f"cannot resume {run_dir}: none of its {len(existing)} checkpoint(s) verifies "
                          f"(see the lines above); move {run_dir / ckpt.CKPT_DIR} away to start over")
    if resume and latest is not None:
        _check_resume_config(run_dir, latest, cfg)
    elif resume:
        say(f"tngram: no checkpoint in {run_dir}; starting from step 0")

    # ---- data (built on first use), tokenizer byte tables, validation stream
    from tngram.data.bpb import token_byte_luts
    from tngram.data.loader import TokenLoader, load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    info = _open_data(cfg, ctx)
    V = cfg.model.vocab_size
    loader = TokenLoader(info.train_files, cfg.data.micro_batch_seqs, seq_len, ddp_rank=ctx.ddp_rank,
                         world_size=ctx.world_size, seed=cfg.data.seed, vocab_size=V)
    check_batch_vs_data(cfg, sum(loader.counts))
    val_tokens = load_val_tokens(info.val_files, seq_len, vocab_size=V)
    luts = token_byte_luts(load_tokenizer(info.tokenizer_path), V)

    # ---- model and optimisers (global RNG seeded first)
    device = ctx.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).to(device)
    apply_warmstart(model, cfg.run.init_from, cfg.optim.trainable)
    groups = build_param_groups(model, cfg.optim)
    # optim.memory_update sparse/rowwise: the tables get row-sparse gradients and their own
    # optimiser (tngram.optim.memory_update); "dense" leaves `groups` as they are
    table_opt, rest = setup_memory_update(model, groups, cfg.optim.memory_update,
                                          (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.adam_eps)
    muon_groups = [g for g in rest if g["optimizer"] == "muon"]
    adam_groups = [g for g in rest if g["optimizer"] == "adam"]
    o = cfg.optim
    optimizers: dict[str, torch.optim.Optimizer] = {
        "adam": torch.optim.Adam(adam_groups, betas=(o.beta1, o.beta2), eps=o.adam_eps,
                                 fused=device.type == "cuda")}
    if muon_groups:
        optimizers["muon"] = Muon(muon_groups, lr=o.matrix_lr, momentum=o.muon_momentum_start,
                                  nesterov=True, ns_steps=o.muon_ns_steps, ddp_rank=ctx.ddp_rank,
                                  world_size=ctx.world_size)
    if table_opt is not None:
        optimizers["memory"] = table_opt
    sizes = delta_params(cfg)
    if ctx.is_main:   # a checkpoint holds the weights and up to two moments per parameter
        ckpt_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        ckpt.check_free_space(run_dir, ckpt_bytes + ckpt_bytes // 3, "a checkpoint and the final weights")

    step, tokens, wall_prev, train_time_prev = 0, 0, 0.0, 0.0
    if resume and latest is not None:
        meta = ckpt.load_checkpoint(latest, model, optimizers)
        loader.load_state_dict(meta["loader"])
        step, tokens = meta["step"], meta["tokens"]
        wall_prev, train_time_prev = meta["wall_s"], meta["train_time_s"]
        sizes = live_sizes(model, sizes)   # smaller if the checkpoint was written after pruning
        if meta.get("world_size") != ctx.world_size:
            say(f"tngram: note: checkpoint was written with {meta.get('world_size')} processes, "
                f"resuming with {ctx.world_size} (same global batch, so the same optimisation)")
        say(f"tngram: resumed {run_dir} from {latest.name}")

    amp = autocast_dtype(cfg.run.dtype, device)
    autocast_ctx = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else nullcontext
    fwd_model = torch.compile(model, dynamic=False) if cfg.run.compile else model
    fwd_model = wrap_ddp(fwd_model, ctx)

    # ---- records
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.save_run_config(run_dir, cfg.to_dict())
        record_dataset(run_dir, info)  # tokenizer + manifest copy: the run folder stands alone
        atomic_write_json(run_dir / "env.json", env_info(device, ctx.world_size, accum))
    log = MetricsLog(run_dir, ctx.is_main, keep_until_step=step, logger=logger, run_name=cfg.name,
                     config=cfg.to_dict())
    say(f"tngram: {cfg.name}: {sizes['total_params']:,} params (memory {sizes['memory_params']:,}, "
        f"delta {sizes['delta_params']:,}); {ctx.world_size} process(es) x {accum} micro-step(s) x "
        f"{cfg.data.micro_batch_seqs} x {seq_len} tokens = {cfg.data.global_batch_tokens:,} "
        f"tokens/step; steps {step}->{stop} of {steps}; device {device}; "
        f"autocast {amp or 'off (fp32)'}")
    say(format_param_table(groups))

    def evaluate() -> dict[str, Any]:
        return evaluate_bpb(model, val_tokens, seq_len, luts, cfg.data.micro_batch_seqs,
                            ddp_rank=ctx.ddp_rank, world_size=ctx.world_size, autocast_dtype=amp,
                            max_tokens=cfg.data.val_tokens)

    def save(at_step: int) -> None:
        if not all_true(all(bool(torch.isfinite(p).all()) for p in model.parameters()), ctx):
            raise TngramError(f"non-finite parameters after step {at_step}; not writing a checkpoint "
                              f"(the last good one is kept in {run_dir / ckpt.CKPT_DIR})")
        if ctx.is_main:
            ckpt.save_checkpoint(run_dir, at_step, model, optimizers, {
                "tokens": tokens, "wall_s": wall_prev + time.perf_counter() - t_start,
                "train_time_s": train_time_prev + train_time, "world_size": ctx.world_size,
                "loader": loader.state_dict(), "train_loss": last_loss, "config": cfg.to_dict()},
                keep=cfg.run.keep_checkpoints)
        barrier(ctx)

    # ---- loop
    t_start = time.perf_counter()
    train_time, session_tokens = 0.0, 0
    win_time, win_tokens = 0.0, 0
    last_loss, last_eval = float("nan"), None
    progress = Progress(stop, step, cfg.name, ctx.is_main, bar=bar, log_every=cfg.run.log_every)
    health = LossHealth(V)
    model.train()
    try:
        while step < stop:
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                x, y = loader.next_batch()
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with no_sync(fwd_model, micro == accum - 1):
                    with autocast_ctx():
                        loss = fwd_model(x, y)
                    (loss / accum).backward()
                loss_sum += loss.detach()
            train_loss = float(all_reduce_mean(loss_sum / accum, ctx))
            if not math.isfinite(train_loss):
                last = ckpt.latest_checkpoint(run_dir)
                raise TngramError(
                    f"non-finite training loss ({train_loss}) at step {step + 1}; stopped before the "
                    f"update. Last good checkpoint: {last if last else 'none (none written yet)'}. "
                    f"Lower the learning rates (optim.matrix_lr, optim.tied_embed_lr, "
                    f"optim.scalar_lr) or check the data.")
            mult = lr_multiplier(step, steps, cfg.schedule.warmdown_steps)
            mom = muon_momentum(step, o.muon_momentum_start, o.muon_momentum, o.muon_momentum_warmup_steps)
            for opt in optimizers.values():
                for g in opt.param_groups:
                    g["lr"] = g["base_lr"] * mult
                    if "momentum" in g:
                        g["momentum"] = mom
            sync_sparse_grads(model, ctx)       # row-sparse tables under DDP; no-op otherwise
            if o.grad_clip_norm > 0:            # torch's clip_grad_norm_ unless grads are sparse
                clip_grad_norm(model.parameters(), o.grad_clip_norm)
            for opt in optimizers.values():
                opt.step()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step += 1
            tokens += cfg.data.global_batch_tokens
            session_tokens += cfg.data.global_batch_tokens
            train_time, win_time = train_time + dt, win_time + dt
            win_tokens += cfg.data.global_batch_tokens
            last_loss = train_loss
            warning = health.update(step, train_loss)
            if warning:
                progress.write(warning) if progress.bar is not None else say(warning)
            if prune_at and step == prune_at:    # adaptive CP rank (tngram.memory.cp_rank)
                from tngram.memory.cp_rank import prune_model
                tp = time.perf_counter()
                changes = prune_model(model, optimizers.values())
                dp = time.perf_counter() - tp
                train_time, win_time = train_time + dp, win_time + dp
                sizes = live_sizes(model, sizes)
                say(f"tngram: step {step}: CP rank pruned " + ", ".join(
                    f"{n} {a}->{b}" for n, a, b in changes) + f"; delta params now {sizes['delta_params']:,}")
            progress.update(train_loss, win_tokens / max(win_time, 1e-9))
            # ---- log / evaluate / checkpoint
            is_last = step == stop
            do_val = is_last or (cfg.run.val_every > 0 and step % cfg.run.val_every == 0)
            if is_last or do_val or step % cfg.run.log_every == 0:
                row = {"step": step, "train_loss": train_loss, "lr": mult * o.matrix_lr,
                       "lr_multiplier": mult, "muon_momentum": mom, "tokens": tokens,
                       "tokens_per_s": win_tokens / max(win_time, 1e-9)}
                win_time, win_tokens = 0.0, 0
                if do_val:
                    last_eval = evaluate()
                    model.train()
                    row.update({"val_loss": last_eval["val_loss"], "val_bpb": last_eval["val_bpb"]})
                    progress.write(f"step {step}/{stop}: train {train_loss:.4f} val {last_eval['val_loss']:.4f} "
                                   f"bpb {last_eval['val_bpb']:.4f}")
                log.log(row)
            if is_last or (cfg.run.checkpoint_every > 0 and step % cfg.run.checkpoint_every == 0):
                save(step)
        if last_eval is None:  # resumed a run that had already reached `stop`
            last_eval = evaluate()
    finally:
        progress.close()
        log.close()

    # ---- summary
    total_train_time = train_time_prev + train_time
    summary = {
        "recipe": cfg.name, **sizes, "steps": step, "schedule_steps": steps,
        "train_loss": last_loss if math.isfinite(last_loss) else _last_logged_loss(run_dir),
        "val_loss": last_eval["val_loss"], "val_bpb": last_eval["val_bpb"],
        "val_tokens": last_eval["tokens"], "val_bytes": last_eval["bytes"],
        "tokens": tokens, "tokens_per_s": tokens / max(total_train_time, 1e-9),
        "train_time_s": total_train_time, "wall_s": wall_prev + time.perf_counter() - t_start,
        "world_size": ctx.world_size, "grad_accum_steps": accum,
        "device": str(device), "dtype": str(amp or torch.float32).replace("torch.", ""),
    }
    healthy, why = health.verdict()
    summary.update(healthy=healthy, health_reason=why, health_steps_seen=health.steps)
    if prune_at:
        from tngram.memory.cp_rank import cp_ranks
        summary["cp_ranks"] = cp_ranks(model)
        summary["prune_at_step"] = prune_at
    if ctx.is_main:
        ckpt.save_final_weights(run_dir, model, step)
        atomic_write_json(run_dir / "summary.json", summary)
        say(f"tngram: {cfg.name} done: step {step}, train {summary['train_loss']:.4f}, val "
            f"{summary['val_loss']:.4f} (bpb {summary['val_bpb']:.4f}), "
            f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['wall_s']:.0f} s -> {run_dir}")
        if not healthy:
            say(f"tngram: warning: the run is NOT healthy (summary.json healthy: false): {why}")
    barrier(ctx)
    return summary


def _last_logged_loss(run_dir: Path) -> float | None:
    from tngram.train.metrics import read_metrics
    rows = [r for r in read_metrics(run_dir) if "train_loss" in r]
    return rows[-1]["train_loss"] if rows else None
