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

Read it top to bottom: `train()` checks, locks the run folder and hands over to `Trainer`, whose
`__init__` sets up (resume checks, data, model, optimisers, records), `train_step()` is one
optimiser step and `run()` the loop, where logging, validation and checkpoints each happen when
one predicate (`should_log`, `should_validate`, `should_save`) says so; `StepClock` keeps the times.

A run is resumable from its latest checkpoint and bit-identical on CPU to an uninterrupted run:
weights, optimiser moments, loader position and RNG are restored, and the schedules depend only
on the step. A non-finite training loss stops the run before the update (TngramError), leaving
the checkpoints written so far untouched; parameters are also checked before every checkpoint.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from tngram.common import TngramError, atomic_write_json
from tngram.cpu import StepWatch
from tngram.eval.bpb import evaluate_bpb
from tngram.model.gpt import GPT, param_counts
from tngram.optim.groups import build_param_groups, format_param_table
from tngram.optim.memory_update import clip_grad_norm, settle_tables, settled_tables, setup_memory_update
from tngram.train.fsdp import gather_for_save, local_parameters, shard_model
from tngram.train.sharded_checkpoint import load_step_checkpoint, save_step_checkpoint
from tngram.train.warmstart import apply_warmstart
from tngram.optim.muon import Muon
from tngram.optim.schedules import lr_multiplier, muon_momentum
from tngram.train import checkpoint as ckpt
from tngram.train.config import TrainConfig, validate_config
from tngram.train.dist import (DistContext, all_reduce_mean, all_true, barrier, broadcast_str,
                               grad_accum_steps, init_distributed, no_sync, shutdown,
                               release_ddp, sync_sparse_grads, wrap_ddp)
from tngram.train.health import LossHealth, check_batch_vs_data, check_step_memory
from tngram.train.metrics import MetricsLog, Progress, check_logger, env_info, last_logged_loss
from tngram.train.portable import record_dataset
from tngram.train.rundir import claim_run_dir, release_run_dir
from tngram.train.signals import StopRequest, TrainingStopped, exit_code, signal_name

# run.* fields that may change between an interrupted run and its resumption
RESUMABLE_RUN_FIELDS = ("log_every", "val_every", "checkpoint_every", "keep_checkpoints", "threads",
                        "parallel")


def autocast_dtype(run_dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; on CPU only when asked (run.dtype=bf16)."""
    if run_dtype == "bf16" or (run_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def live_sizes(model: torch.nn.Module, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` (from model.gpt.param_counts) updated to the model's actual shapes (after CP-rank pruning)."""
    raw_total = sizes["total_params"] - sizes["delta_params"]
    total = model.num_params()
    return {"total_params": total, "memory_params": model.memory_params(),
            "delta_params": total - raw_total}


def _prune_at_step(cfg: TrainConfig, world_size: int) -> int:
    """The step after which the memory reshapes its parameters (TN-gram's adaptive CP rank
    pruning; 0: never), checked against the schedule and the process count."""
    mem = cfg.model.memory
    at = mem.reshape_step() if mem is not None else 0
    key = f"model.memory.{mem.reshape_step_field}" if at else ""
    if at and at >= cfg.schedule.steps:
        raise TngramError(f"{key} ({at}) must be < schedule.steps "
                          f"({cfg.schedule.steps}); 0 switches pruning off")
    if at and world_size > 1:
        raise TngramError(f"{key} > 0 (adaptive CP rank) runs in one process only; "
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
    check_step_memory(cfg)                     # before the folder exists or anything is allocated
    ctx = init_distributed(cfg.run.device)
    threads = torch.get_num_threads()
    watch = None
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    else:
        watch = _choose_threads(ctx, threads)
    lock = trainer = None
    try:
        lock = _claim(run_dir, cfg, resume, ctx)
        trainer = Trainer(cfg, run_dir, ctx, resume, max_steps, logger, progress)
        trainer.watch = watch
        with StopRequest() as signals:      # SIGTERM / SIGINT: finish the step, checkpoint, stop
            return trainer.run(signals)
    except TrainingStopped as stop:
        stopped = stop
    finally:
        if lock is not None:
            release_run_dir(lock)
        torch.set_num_threads(threads)
        if trainer is not None:
            release_ddp(trainer, ctx)    # the DDP wrapper goes before the process group
        shutdown(ctx)
    if ctx.is_main:    # the lock is released: the run can be resumed right away
        print(f"tngram: {cfg.name} stopped by {signal_name(stopped.signum)} after step {stopped.step}; "
              f"checkpoint {stopped.checkpoint}; to continue, run the same command with --resume "
              f"(exit {exit_code(stopped.signum)})", file=sys.stderr, flush=True)
    raise SystemExit(exit_code(stopped.signum))


def _choose_threads(ctx: DistContext, default: int) -> StepWatch | None:
    """run.threads 0 on CPU without OMP_NUM_THREADS: keep torch's default unless other jobs keep
    the CPUs busy or a quota caps them (tngram.cpu.choose_threads); say so in one line when the
    count changes. On an idle machine nothing changes. Returns the step-time watch that backs off
    later if a job starts during the run (one process, more than 1 thread), else None."""
    import os

    from tngram.cpu import auto_threads
    if ctx.device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    choice = auto_threads(default)
    if choice.changed:
        torch.set_num_threads(choice.threads)
        if ctx.is_main:
            print(f"tngram: note: {choice.reason}", flush=True)
    n = torch.get_num_threads()
    return StepWatch(n) if ctx.world_size == 1 and n > 1 else None


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
    saved = ckpt.read_checkpoint_meta(checkpoint).get("config")
    if saved is None:
        saved = ckpt.read_run_config(run_dir)
    new = json.loads(json.dumps(cfg.to_dict()))
    for d in (saved, new):
        for k in RESUMABLE_RUN_FIELDS:
            d.get("run", {}).pop(k, None)
    if str(new.get("name")).startswith(f"{saved.get('name')}+memory="):
        new["name"] = saved.get("name")   # a run made before resolve_config named memory changes
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


class StepClock:
    """Time spent in optimiser steps (not in evaluation or saving) and tokens trained: for this
    session, for the current logging window, plus the earlier sessions of a resumed run."""

    def __init__(self, train_time_prev: float = 0.0, wall_prev: float = 0.0) -> None:
        self.train_time_prev, self.wall_prev = train_time_prev, wall_prev
        self.start = time.perf_counter()
        self.train_time = 0.0                      # this session
        self.win_time, self.win_tokens = 0.0, 0    # since the last metrics row

    def begin(self) -> None:
        self.start = time.perf_counter()

    def add(self, seconds: float, tokens: int = 0) -> None:
        self.train_time += seconds
        self.win_time += seconds
        self.win_tokens += tokens

    def window_tokens_per_s(self) -> float:
        return self.win_tokens / max(self.win_time, 1e-9)

    def reset_window(self) -> None:
        self.win_time, self.win_tokens = 0.0, 0

    def total_train_time(self) -> float:
        return self.train_time_prev + self.train_time

    def wall(self) -> float:
        return self.wall_prev + time.perf_counter() - self.start


class Trainer:
    """One run on one process, in the order it happens: `__init__` sets up (resume checks, data,
    model, optimisers, records), `train_step()` is one optimiser step, `run()` is the loop (a step,
    then log / validate / checkpoint when their predicate says so) and the summary."""

    watch: StepWatch | None = None    # set by train() when the thread count is automatic

    def __init__(self, cfg: TrainConfig, run_dir: Path, ctx: DistContext, resume: bool,
                 max_steps: int | None, logger: str = "none", bar: bool = True) -> None:
        self.cfg, self.run_dir, self.ctx, self.bar = cfg, run_dir, ctx, bar
        self.say = print if ctx.is_main else (lambda *a, **k: None)
        self.accum = grad_accum_steps(cfg.data.global_batch_tokens, cfg.data.micro_batch_seqs,
                                      cfg.model.sequence_len, ctx.world_size)
        self.prune_at = _prune_at_step(cfg, ctx.world_size)
        steps = cfg.schedule.steps
        self.stop = min(steps, max_steps) if max_steps is not None else steps
        latest = self._resume_point(resume)
        self._setup_data()
        self._setup_model()
        self.step, self.tokens, self.clock = 0, 0, StepClock()
        if latest is not None:
            self._load(latest)
        self._setup_forward()
        self._write_records(logger)
        self.last_loss, self.last_eval = float("nan"), None
        self.lr_mult, self.momentum = 1.0, cfg.optim.muon_momentum_start

    # ---- setup -------------------------------------------------------------------------------
    def _resume_point(self, resume: bool) -> Path | None:
        """Refuse to overwrite checkpoints; on resume the newest checkpoint that verifies (saying
        which newer ones are skipped), whose config must match."""
        run_dir = self.run_dir
        existing = ckpt.list_checkpoints(run_dir)
        if existing and not resume:
            raise TngramError(f"{run_dir} already holds a run with checkpoints; pass --resume to "
                              f"continue it or choose another --out")
        latest = ckpt.newest_good_checkpoint(run_dir, self.say) if resume else None
        if resume and existing and latest is None:
            raise TngramError(f"cannot resume {run_dir}: none of its {len(existing)} checkpoint(s) verifies "
                              f"(see the lines above); move {run_dir / ckpt.CKPT_DIR} away to start over")
        if latest is not None:
            _check_resume_config(run_dir, latest, self.cfg)
        elif resume:
            self.say(f"tngram: no checkpoint in {run_dir}; starting from step 0")
        return latest

    def _setup_data(self) -> None:
        """The dataset (built on first use), the train loader, the validation tokens and the
        tokenizer's byte tables (for bits per byte)."""
        from tngram.data.bpb import token_byte_luts
        from tngram.data.loader import TokenLoader, load_val_tokens
        from tngram.data.tokenizer import load_tokenizer
        cfg, ctx = self.cfg, self.ctx
        V, T = cfg.model.vocab_size, cfg.model.sequence_len
        self.data = _open_data(cfg, ctx)
        self.loader = TokenLoader(self.data.train_files, cfg.data.micro_batch_seqs, T,
                                  ddp_rank=ctx.ddp_rank, world_size=ctx.world_size, seed=cfg.data.seed,
                                  vocab_size=V)
        check_batch_vs_data(cfg, sum(self.loader.counts))
        self.val_tokens = load_val_tokens(self.data.val_files, T, vocab_size=V)
        self.luts = token_byte_luts(load_tokenizer(self.data.tokenizer_path), V)

    def _setup_model(self) -> None:
        """The model (global RNG seeded first; memories seed their own), the parameter groups and
        the optimisers (Adam for embeddings, tables and controls; Muon for matrices)."""
        cfg, ctx, o = self.cfg, self.ctx, self.cfg.optim
        device = self.device = ctx.device
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.run.seed)
        model = self.model = GPT(cfg.model).to(device)
        apply_warmstart(model, cfg.run.init_from, o.trainable)
        # run.parallel=fsdp with > 1 process: blocks and memories sharded (tngram.train.fsdp)
        self.sharded = shard_model(model, cfg.run.parallel, ctx)
        self.groups = build_param_groups(model, o)
        # optim.memory_update sparse/rowwise: the tables get row-sparse gradients and their own
        # optimiser (tngram.optim.memory_update); "dense" leaves `groups` as they are
        table_opt, rest = setup_memory_update(model, self.groups, o.memory_update,
                                              (o.beta1, o.beta2), o.adam_eps, o.memory_catchup)
        muon_groups = [g for g in rest if g["optimizer"] == "muon"]
        adam_groups = [g for g in rest if g["optimizer"] == "adam"]
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            "adam": torch.optim.Adam(adam_groups, betas=(o.beta1, o.beta2), eps=o.adam_eps,
                                     fused=device.type == "cuda")}
        if muon_groups:
            self.optimizers["muon"] = Muon(muon_groups, lr=o.matrix_lr, momentum=o.muon_momentum_start,
                                           nesterov=True, ns_steps=o.muon_ns_steps,
                                           ddp_rank=ctx.ddp_rank, world_size=ctx.world_size)
        if table_opt is not None:
            self.optimizers["memory"] = table_opt
        self.sizes = param_counts(cfg.model)
        if ctx.is_main:   # a checkpoint holds the weights and up to two moments per parameter
            ckpt_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
            ckpt.check_free_space(self.run_dir, ckpt_bytes + ckpt_bytes // 3,
                                  "a checkpoint and the final weights")

    def _load(self, latest: Path) -> None:
        """Weights, optimiser moments, loader position, RNG, step, tokens and times of `latest`."""
        meta = load_step_checkpoint(latest, self.model, self.optimizers, self.sharded)  # any world size
        self.loader.load_state_dict(meta["loader"])
        self.step, self.tokens = meta["step"], meta["tokens"]
        self.clock = StepClock(meta["train_time_s"], meta["wall_s"])
        self.sizes = live_sizes(self.model, self.sizes)   # smaller if written after pruning
        if meta.get("world_size") != self.ctx.world_size:
            self.say(f"tngram: note: checkpoint was written with {meta.get('world_size')} processes, "
                     f"resuming with {self.ctx.world_size} (same global batch, so the same optimisation)")
        self.say(f"tngram: resumed {self.run_dir} from {latest.name}")

    def _setup_forward(self) -> None:
        """Autocast (bf16 on CUDA, fp32 on CPU unless run.dtype=bf16), torch.compile, DDP."""
        self.amp = amp = autocast_dtype(self.cfg.run.dtype, self.device)
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=amp)) if amp is not None
                         else nullcontext)
        fwd = torch.compile(self.model, dynamic=False) if self.cfg.run.compile else self.model
        self.fwd_model = fwd if self.sharded else wrap_ddp(fwd, self.ctx)

    def _write_records(self, logger: str) -> None:
        """config.json, the dataset record, env.json, the metrics log; then the run's header."""
        cfg, ctx, run_dir, sizes = self.cfg, self.ctx, self.run_dir, self.sizes
        if ctx.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.save_run_config(run_dir, cfg.to_dict())
            record_dataset(run_dir, self.data)  # tokenizer + manifest copy: the run folder stands alone
            atomic_write_json(run_dir / "env.json", env_info(self.device, ctx.world_size, self.accum))
        self.log = MetricsLog(run_dir, ctx.is_main, keep_until_step=self.step, logger=logger,
                              run_name=cfg.name, config=cfg.to_dict())
        self.say(f"tngram: {cfg.name}: {sizes['total_params']:,} params (memory {sizes['memory_params']:,}, "
                 f"delta {sizes['delta_params']:,}); {ctx.world_size} process(es) x {self.accum} "
                 f"micro-step(s) x {cfg.data.micro_batch_seqs} x {cfg.model.sequence_len} tokens = "
                 f"{cfg.data.global_batch_tokens:,} tokens/step; steps {self.step}->{self.stop} of "
                 f"{cfg.schedule.steps}; device {self.device}; autocast {self.amp or 'off (fp32)'}")
        self.say(format_param_table(self.groups))

    # ---- one optimiser step ------------------------------------------------------------------
    def train_step(self) -> float:
        """grad_accum micro-steps (forward, backward), the loss check, the schedule (lr, Muon
        momentum), clipping and the update. Returns the mean training loss of the step."""
        cfg, o, device = self.cfg, self.cfg.optim, self.device
        t0 = time.perf_counter()
        loss = self._forward_backward()
        self._check_finite_loss(loss)
        self.lr_mult = lr_multiplier(self.step, cfg.schedule.steps, cfg.schedule.warmdown_steps)
        self.momentum = muon_momentum(self.step, o.muon_momentum_start, o.muon_momentum,
                                      o.muon_momentum_warmup_steps)
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * self.lr_mult
                if "momentum" in g:
                    g["momentum"] = self.momentum
        sync_sparse_grads(self.model, self.ctx)     # row-sparse tables under DDP; no-op otherwise
        if o.grad_clip_norm > 0:                    # torch's clip_grad_norm_ unless grads are sparse
            clip_grad_norm(self.model.parameters(), o.grad_clip_norm)
        for opt in self.optimizers.values():
            opt.step()
        self.model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.step += 1
        self.tokens += cfg.data.global_batch_tokens
        self.clock.add(time.perf_counter() - t0, cfg.data.global_batch_tokens)
        self.last_loss = loss
        return loss

    def _forward_backward(self) -> float:
        """Sum of gradients over the micro-steps (DDP all-reduces on the last only); mean loss."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            x, y = self.loader.next_batch()
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with no_sync(self.fwd_model, micro == self.accum - 1):
                with self.autocast():
                    loss = self.fwd_model(x, y)
                (loss / self.accum).backward()
            loss_sum += loss.detach()
        return float(all_reduce_mean(loss_sum / self.accum, self.ctx))

    def _check_finite_loss(self, loss: float) -> None:
        if not math.isfinite(loss):
            last = ckpt.latest_checkpoint(self.run_dir)
            raise TngramError(
                f"non-finite training loss ({loss}) at step {self.step + 1}; stopped before the "
                f"update. Last good checkpoint: {last if last else 'none (none written yet)'}. "
                f"Lower the learning rates (optim.matrix_lr, optim.tied_embed_lr, "
                f"optim.scalar_lr) or check the data.")

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, signals: StopRequest | None = None) -> dict[str, Any]:
        """Train from self.step to self.stop; returns the summary (also RUN/summary.json). After
        a stop signal (tngram.train.signals) the step in progress finishes and is checkpointed,
        then TrainingStopped is raised."""
        cfg = self.cfg
        progress = Progress(self.stop, self.step, cfg.name, self.ctx.is_main, bar=self.bar,
                            log_every=cfg.run.log_every)
        health = LossHealth(cfg.model.vocab_size)
        self.clock.begin()
        self.model.train()
        try:
            while self.step < self.stop:
                t_step = time.perf_counter()
                loss = self.train_step()
                if self.watch is not None:
                    self._watch_threads(time.perf_counter() - t_step, progress)
                self._after_step(loss, health, progress)
                progress.update(loss, self.clock.window_tokens_per_s())
                if self.should_log():
                    self.log_row(loss, progress)
                if self.should_save():
                    self.save()
                if self.stop_requested(signals):
                    self.stop_now(signals)
            if self.last_eval is None:   # resumed a run that had already reached `stop`
                self.last_eval = self.evaluate()
        finally:
            progress.close()
            self.log.close()
        return self.finish(health)

    def _watch_threads(self, seconds: float, progress: Progress) -> None:
        """Fewer threads once the steps collapse beside a job that started after the run
        (tngram.cpu.StepWatch); one line says so."""
        choice = self.watch.add(seconds)
        if choice is None:
            return
        torch.set_num_threads(choice.threads)
        msg = (f"tngram: note: step {self.step}: steps took {self.watch.last:.2f} s (median of "
               f"{self.watch.window}), {self.watch.last / self.watch.best:.1f}x the best {self.watch.best:.2f} s; "
               + choice.reason.replace("training with", "continuing with"))
        progress.write(msg) if progress.bar is not None else self.say(msg)

    def stop_requested(self, signals: StopRequest | None) -> bool:
        """A stop signal reached this process (under DDP: any process, so all stop together)."""
        got = signals is not None and signals.signum is not None
        if self.ctx.world_size == 1:
            return got
        return not all_true(not got, self.ctx)

    def stop_now(self, signals: StopRequest) -> None:
        """Checkpoint this step (unless should_save just did) and raise TrainingStopped."""
        if not self.should_save():
            self.save()
        signum = signals.signum or signal.SIGTERM   # a DDP process the signal did not reach
        raise TrainingStopped(signum, self.step, str(ckpt.latest_checkpoint(self.run_dir)))

    def should_validate(self) -> bool:
        every = self.cfg.run.val_every
        return self.step == self.stop or (every > 0 and self.step % every == 0)

    def should_log(self) -> bool:
        return self.should_validate() or self.step % self.cfg.run.log_every == 0

    def should_save(self) -> bool:
        every = self.cfg.run.checkpoint_every
        return self.step == self.stop or (every > 0 and self.step % every == 0)

    def _after_step(self, loss: float, health: LossHealth, progress: Progress) -> None:
        """The loss-health warning, and the adaptive CP-rank pruning at its step."""
        warning = health.update(self.step, loss)
        if warning:
            progress.write(warning) if progress.bar is not None else self.say(warning)
        if self.prune_at and self.step == self.prune_at:    # tngram.memory.cp_rank
            from tngram.memory.cp_rank import prune_model
            t = time.perf_counter()
            changes = prune_model(self.model, self.optimizers.values())
            self.clock.add(time.perf_counter() - t)
            self.sizes = live_sizes(self.model, self.sizes)
            self.say(f"tngram: step {self.step}: CP rank pruned " + ", ".join(
                f"{n} {a}->{b}" for n, a, b in changes) + f"; delta params now {self.sizes['delta_params']:,}")

    def evaluate(self) -> dict[str, Any]:
        """Val loss and BPB; rows owed moves (optim.memory_catchup) settled for it, then restored."""
        cfg = self.cfg
        with settled_tables(self.optimizers.values()):
            return evaluate_bpb(self.model, self.val_tokens, cfg.model.sequence_len, self.luts,
                                cfg.data.micro_batch_seqs, ddp_rank=self.ctx.ddp_rank,
                                world_size=self.ctx.world_size, autocast_dtype=self.amp,
                                max_tokens=cfg.data.val_tokens, lockstep=self.sharded)

    def log_row(self, loss: float, progress: Progress) -> None:
        """One metrics row (tokens/s over the steps since the previous row), with validation when due."""
        row = {"step": self.step, "train_loss": loss, "lr": self.lr_mult * self.cfg.optim.matrix_lr,
               "lr_multiplier": self.lr_mult, "muon_momentum": self.momentum, "tokens": self.tokens,
               "tokens_per_s": self.clock.window_tokens_per_s()}
        self.clock.reset_window()
        if self.should_validate():
            self.last_eval = self.evaluate()
            self.model.train()
            row.update({"val_loss": self.last_eval["val_loss"], "val_bpb": self.last_eval["val_bpb"]})
            progress.write(f"step {self.step}/{self.stop}: train {loss:.4f} val "
                           f"{self.last_eval['val_loss']:.4f} bpb {self.last_eval['val_bpb']:.4f}")
        self.log.log(row)

    def save(self) -> None:
        """A checkpoint of this step: every process checks its weights are finite; the main one writes
        (FSDP-sharded: every process writes its shards through DCP, tngram.train.sharded_checkpoint)."""
        ctx = self.ctx
        if not all_true(all(bool(torch.isfinite(p).all()) for p in local_parameters(self.model)), ctx):
            raise TngramError(f"non-finite parameters after step {self.step}; not writing a checkpoint "
                              f"(the last good one is kept in {self.run_dir / ckpt.CKPT_DIR})")
        meta = {"tokens": self.tokens, "wall_s": self.clock.wall(),
                "train_time_s": self.clock.total_train_time(), "world_size": ctx.world_size,
                "loader": self.loader.state_dict(), "train_loss": self.last_loss,
                "config": self.cfg.to_dict()}
        save_step_checkpoint(self.run_dir, self.step, self.model, self.optimizers, meta,  # FSDP: DCP shards
                             self.cfg.run.keep_checkpoints, ctx, self.sharded)
        barrier(ctx)

    def finish(self, health: LossHealth) -> dict[str, Any]:
        """The summary (RUN/summary.json) and the final weights, written by the main process."""
        cfg, ctx, ev = self.cfg, self.ctx, self.last_eval
        total_train_time = self.clock.total_train_time()
        summary = {
            "recipe": cfg.name, **self.sizes, "steps": self.step, "schedule_steps": cfg.schedule.steps,
            "train_loss": (self.last_loss if math.isfinite(self.last_loss)
                           else last_logged_loss(self.run_dir)),
            "val_loss": ev["val_loss"], "val_bpb": ev["val_bpb"],
            "val_tokens": ev["tokens"], "val_bytes": ev["bytes"],
            "tokens": self.tokens, "tokens_per_s": self.tokens / max(total_train_time, 1e-9),
            "train_time_s": total_train_time, "wall_s": self.clock.wall(),
            "world_size": ctx.world_size, "grad_accum_steps": self.accum,
            "device": str(self.device), "dtype": str(self.amp or torch.float32).replace("torch.", ""),
        }
        healthy, why = health.verdict()
        summary.update(healthy=healthy, health_reason=why, health_steps_seen=health.steps)
        if self.prune_at:
            from tngram.memory.cp_rank import cp_ranks
            summary["cp_ranks"] = cp_ranks(self.model)
            summary["prune_at_step"] = self.prune_at
        settle_tables(self.optimizers.values())    # optim.memory_catchup: rows owed moves get them
        final_model = gather_for_save(self.model, {}, self.sharded)[0]   # FSDP: full tensors
        if ctx.is_main:
            ckpt.save_final_weights(self.run_dir, final_model, self.step)
            atomic_write_json(self.run_dir / "summary.json", summary)
            self.say(f"tngram: {cfg.name} done: step {self.step}, train {summary['train_loss']:.4f}, val "
                     f"{summary['val_loss']:.4f} (bpb {summary['val_bpb']:.4f}), "
                     f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['wall_s']:.0f} s -> {self.run_dir}")
            if not healthy:
                self.say(f"tngram: warning: the run is NOT healthy (summary.json healthy: false): {why}")
        barrier(ctx)
        return summary

