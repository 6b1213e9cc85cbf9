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
on the step. A non-finite training loss stops the run (TngramError), leaving the checkpoints
written so far untouched: on the CPU before the update, on CUDA at the next sync point, where the
losses are read (tngram.train.step_reads: no host read between sync points); parameters are also
checked before every checkpoint. The forward is compiled on CUDA by default, eager on the CPU
(run.compile, tngram.train.compile_mode; a failure to compile falls back to eager at step 1).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from tngram.common import TngramError, atomic_write_json
from tngram.cpu import StepWatch
from tngram.eval.bpb import evaluate_bpb
from tngram.kernels.sparse_rows import accumulate_at_exit
from tngram.optim.memory_update import clip_grad_norm, settle_tables, settled_tables
from tngram.optim.schedules import lr_multiplier, muon_momentum
from tngram.train import checkpoint as ckpt
from tngram.train.config import TrainConfig, validate_config
from tngram.train.dist import (
    DistContext,
    all_reduce_mean,
    all_true,
    barrier,
    grad_accum_steps,
    init_distributed,
    no_sync,
    release_ddp,
    shutdown,
    sync_sparse_grads,
    wrap_ddp,
)
from tngram.train.fsdp import gather_for_save, local_parameters
from tngram.train.health import LossHealth, check_step_memory
from tngram.train.metrics import Progress, check_logger, last_logged_loss, tail_seconds, timed
from tngram.train.rundir import release_run_dir
from tngram.train.sdpa import sdpa_preference
from tngram.train.sharded_checkpoint import save_step_checkpoint
from tngram.train.signals import StopRequest, TrainingStopped, exit_code, signal_name
from tngram.train.step_reads import (
    StepLosses,
    first_nonfinite,
    nonfinite_message,
    reads_every_step,
    stop_check_due,
)
from tngram.train.trainer_setup import StepClock, TrainerSetup, claim, live_sizes, prune_at_step


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    max_steps: int | None = None,
    logger: str = "none",
    progress: bool | None = None,
) -> dict[str, Any]:
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
    check_step_memory(cfg)  # before the folder exists or anything is allocated
    ctx = init_distributed(cfg.run.device)
    threads = torch.get_num_threads()
    watch = None
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    else:
        watch = _choose_threads(ctx, threads)
    lock = trainer = None
    try:
        lock = claim(run_dir, cfg, resume, ctx)
        with sdpa_preference(cfg.run.sdpa):  # the attention kernel torch prefers (run.sdpa)
            trainer = Trainer(cfg, run_dir, ctx, resume, max_steps, logger, progress)
            trainer.watch = watch
            with StopRequest() as signals:  # SIGTERM, SIGINT, SIGHUP: checkpoint, stop
                return trainer.run(signals)
    except TrainingStopped as stop:
        stopped = stop
    finally:
        if lock is not None:
            release_run_dir(lock)
        torch.set_num_threads(threads)
        if trainer is not None:
            release_ddp(trainer, ctx)  # the DDP wrapper goes before the process group
            if getattr(trainer, "sharded", False):  # and FSDP's state, which holds the group
                release_ddp(trainer, ctx, "model")
        shutdown(ctx)
    if ctx.is_main:  # the lock is released: the run can be resumed right away
        print(
            f"tngram: {cfg.name} stopped by {signal_name(stopped.signum)} after step "
            f"{stopped.step}; "
            f"checkpoint {stopped.checkpoint}; to continue, {resume_hint()} "
            f"(exit {exit_code(stopped.signum)})",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(exit_code(stopped.signum))


def resume_hint() -> str:
    """How to continue a stopped run: `--resume` for `tngram train`; a compare / experiment
    child is told by its runner (TNGRAM_RESUME_HINT), whose command resumes it by itself."""
    import os

    return os.environ.get("TNGRAM_RESUME_HINT") or "run the same command with --resume"


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


class Signals(Protocol):
    """What the loop reads of tngram.train.signals.StopRequest: the first signal's number."""

    signum: int | None


class Trainer(TrainerSetup):
    """One run on one process, in the order it happens: `__init__` sets up (resume checks, data,
    model, optimisers, records), `train_step()` is one optimiser step, `run()` is the loop (a step,
    then log / validate / checkpoint when their predicate says so) and the summary."""

    watch: StepWatch | None = None  # set by train() when the thread count is automatic
    _val_s: float | None = None  # seconds of the last validation / checkpoint (@timed)
    _save_s: float | None = None

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        ctx: DistContext,
        resume: bool,
        max_steps: int | None,
        logger: str = "none",
        bar: bool = True,
    ) -> None:
        self.cfg, self.run_dir, self.ctx, self.bar = cfg, run_dir, ctx, bar
        self.say = print if ctx.is_main else (lambda *a, **k: None)
        self.accum = grad_accum_steps(
            cfg.data.global_batch_tokens,
            cfg.data.micro_batch_seqs,
            cfg.model.sequence_len,
            ctx.world_size,
        )
        self.prune_at = prune_at_step(cfg, ctx.world_size)
        steps = cfg.schedule.steps
        self.stop = min(steps, max_steps) if max_steps is not None else steps
        latest = self._resume_point(resume)
        self._setup_data()
        self._setup_model()
        self.step, self.tokens, self.clock = 0, 0, StepClock()
        if latest is not None:
            self._load(latest)
        self.resumed_from, self.resumed_step = latest, self.step  # named if the loss soon goes NaN
        self._setup_forward()
        self._write_records(logger)
        self.last_loss = float("nan")
        self.last_eval: dict[str, Any] | None = None
        self.lr_mult, self.momentum = 1.0, cfg.optim.muon_momentum_start
        # the losses stay on the device until a sync point on CUDA (tngram.train.step_reads)
        self.every_step = reads_every_step(self.device)
        self.losses = StepLosses()
        self.health: LossHealth | None = None
        self.progress: Progress | None = None
        self._since: float | None = None  # start of the steps not yet on the clock
        self._pending_tokens = 0

    # ---- one optimiser step ------------------------------------------------------------------
    def train_step(self) -> Tensor:
        """grad_accum micro-steps (forward, backward), the loss check, the schedule (lr, Muon
        momentum), clipping and the update. Returns the mean training loss of the step, a 0-d
        tensor on the device; where losses are read every step (the CPU) it is checked before
        the update, elsewhere at the next sync point (tngram.train.step_reads)."""
        cfg, o = self.cfg, self.cfg.optim
        t0 = time.perf_counter()
        if self._since is None:
            self._since = t0
        loss = self._first_step() if self.compile_state.armed else self._forward_backward()
        self.losses.add(self.step + 1, loss)
        if self.every_step:
            self._read_losses()  # a non-finite loss stops here, before the update
        self.lr_mult = lr_multiplier(self.step, cfg.schedule.steps, cfg.schedule.warmdown_steps)
        self.momentum = muon_momentum(
            self.step, o.muon_momentum_start, o.muon_momentum, o.muon_momentum_warmup_steps
        )
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * self.lr_mult
                if "momentum" in g:
                    g["momentum"] = self.momentum
        sync_sparse_grads(self.model, self.ctx)  # row-sparse tables under DDP; no-op otherwise
        if o.grad_clip_norm > 0:  # torch's clip_grad_norm_ unless grads are sparse
            clip_grad_norm(self.model.parameters(), o.grad_clip_norm)
        for opt in self.optimizers.values():
            opt.step()
        if self.compile_state.newton_schulz == "compiled":
            self._check_compiled_ns()
        self.model.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += cfg.data.global_batch_tokens
        self._pending_tokens += cfg.data.global_batch_tokens
        if self.every_step:
            self._flush_clock()
        return loss

    def _forward_backward(self) -> Tensor:
        """Sum of gradients over the micro-steps (DDP all-reduces on the last only; row-sparse
        tables add theirs up once, at the end: accumulate_at_exit); the mean loss, on the device
        (averaged over processes)."""
        loss_sum = torch.zeros((), device=self.device)
        with accumulate_at_exit():
            for micro in range(self.accum):
                x, y = self.batches.next_batch()  # on the device (CUDA: pinned, sent one ahead)
                with no_sync(self.fwd_model, micro == self.accum - 1):
                    with self.autocast():
                        loss = self.fwd_model(x, y)
                    (loss / self.accum).backward()
                loss_sum += loss.detach()
        return all_reduce_mean(loss_sum / self.accum, self.ctx)

    def _first_step(self) -> Tensor:
        """The first step of run.compile=auto (tngram.train.compile_mode): torch.compile
        compiles here; if that fails, one line says why and the step runs again eager, from
        the same batches, and so does the rest of the run (env.json records it)."""
        state = self.batches.state_dict()
        try:
            loss = self._forward_backward()
        except TngramError:
            raise
        except Exception as exc:  # noqa: BLE001  (dynamo / inductor / backend errors vary)
            self.say(self.compile_state.fall_back(exc), flush=True)
            self.model.zero_grad(set_to_none=True)
            self.batches.load_state_dict(state)
            release_ddp(self, self.ctx)  # a DDP wrapper around the compiled module
            self.fwd_model = self.model if self.sharded else wrap_ddp(self.model, self.ctx)
            self.write_env()
            return self._forward_backward()
        self.compile_state.armed = False
        self.compile_newton_schulz()
        self.write_env()
        return loss

    def _check_compiled_ns(self) -> None:
        """Muon's compiled Newton-Schulz fell back to eager at its first step: one line and
        env.json say so."""
        error = getattr(self.optimizers["muon"], "ns_compile_error", None)
        if error is not None:
            self.compile_state.newton_schulz = f"eager (torch.compile failed: {error})"
            self.say(f"tngram: note: Muon's Newton-Schulz: torch.compile failed: {error}; eager")
            self.write_env()

    def _read_losses(self) -> float:
        """The pending losses to the host (one transfer): a non-finite one stops the run, the
        others feed the health check. Returns the newest."""
        got = self.losses.read()
        bad = first_nonfinite(got)
        if bad is not None:
            self._stop_nonfinite(*bad)
        for step, loss in got:
            warning = self.health.update(step, loss) if self.health is not None else None
            progress = self.progress
            if warning and progress is not None and progress.bar is not None:
                progress.write(warning)
            elif warning:
                self.say(warning)
        self.last_loss = self.losses.last
        return self.last_loss

    def _stop_nonfinite(self, step: int, loss: float) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        hint = ckpt.resume_suspect(self.resumed_from, self.resumed_step, step)
        read_at = None if self.every_step else self.step
        raise TngramError(nonfinite_message(step, loss, read_at, last, hint))

    def _flush_clock(self) -> None:
        """Put the steps since the last flush on the clock (after the GPU finished them)."""
        if self._since is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clock.add(time.perf_counter() - self._since, self._pending_tokens)
        self._since, self._pending_tokens = None, 0

    def sync_due(self) -> bool:
        """A step after which the host reads the device: a metrics row (validation, the last
        step), a checkpoint or the CP-rank pruning."""
        return self.should_log() or self.should_save() or self.step == self.prune_at

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, signals: Signals | None = None) -> dict[str, Any]:
        """Train from self.step to self.stop; returns the summary (also RUN/summary.json). After
        a stop signal (tngram.train.signals) the step in progress finishes and is checkpointed,
        then TrainingStopped is raised."""
        cfg = self.cfg
        progress = Progress(
            self.stop,
            self.step,
            cfg.name,
            self.ctx.is_main,
            bar=self.bar,
            log_every=cfg.run.log_every,
            tail=self.tail_estimate,
        )
        health = self.health = LossHealth(cfg.model.vocab_size)
        self.progress = progress
        self.clock.begin()
        self.model.train()
        try:
            while self.step < self.stop:
                t_step = time.perf_counter()
                self.train_step()
                if self.watch is not None:
                    self._watch_threads(time.perf_counter() - t_step, progress)
                sync = self.sync_due()
                due = stop_check_due(self.every_step, self.ctx.world_size, sync)
                stop = due and self.stop_requested(signals)  # DDP on CUDA: at sync points
                if len(self.losses) and (stop or sync):  # CUDA: only here
                    self._read_losses()
                    self._flush_clock()
                self._after_step()
                progress.update(self.last_loss, self.clock.window_tokens_per_s())
                if self.should_log():
                    self.log_row(self.last_loss, progress)
                if self.should_save():
                    self.save()
                if stop:
                    self.stop_now(signals)
            if self.last_eval is None:  # resumed a run that had already reached `stop`
                self.last_eval = self.evaluate()
        finally:
            progress.close()
            self.log.close()
        return self.finish(health)

    def _watch_threads(self, seconds: float, progress: Progress) -> None:
        """Fewer threads once the steps collapse beside a job that started after the run
        (tngram.cpu.StepWatch); one line says so."""
        watch = self.watch
        choice = watch.add(seconds) if watch is not None else None
        if watch is None or choice is None:
            return
        torch.set_num_threads(choice.threads)
        last, best = watch.last or 0.0, watch.best or 0.0  # both set once add() decides
        msg = (
            f"tngram: note: step {self.step}: steps took {last:.2f} s (median of "
            f"{watch.window}), {last / best if best else float('inf'):.1f}x the best "
            f"{best:.2f} s; " + choice.reason.replace("training with", "continuing with")
        )
        progress.write(msg) if progress.bar is not None else self.say(msg)

    def stop_requested(self, signals: Signals | None) -> bool:
        """A stop signal reached this process (under DDP: any process, so all stop together)."""
        got = signals is not None and signals.signum is not None
        if self.ctx.world_size == 1:
            return got
        return not all_true(not got, self.ctx)

    def stop_now(self, signals: Signals | None) -> None:
        """Checkpoint this step (unless should_save just did) and raise TrainingStopped."""
        if not self.should_save():
            self.save()
        signum = (
            signals.signum if signals is not None else None
        ) or signal.SIGTERM  # a DDP process the signal did not reach
        raise TrainingStopped(signum, self.step, str(ckpt.latest_checkpoint(self.run_dir)))

    def should_validate(self) -> bool:
        every = self.cfg.run.val_every
        return self.step == self.stop or (every > 0 and self.step % every == 0)

    def should_log(self) -> bool:
        return self.should_validate() or self.step % self.cfg.run.log_every == 0

    def should_save(self) -> bool:
        every = self.cfg.run.checkpoint_every
        return self.step == self.stop or (every > 0 and self.step % every == 0)

    def _after_step(self) -> None:
        """The adaptive CP-rank pruning at its step."""
        if self.prune_at and self.step == self.prune_at:  # tngram.memory.cp_rank
            from tngram.memory.cp_rank import prune_model

            t = time.perf_counter()
            changes = prune_model(self.model, self.optimizers.values())
            self.clock.add(time.perf_counter() - t)
            self.sizes = live_sizes(self.model, self.sizes)
            self.say(
                f"tngram: step {self.step}: CP rank pruned "
                + ", ".join(f"{n} {a}->{b}" for n, a, b in changes)
                + f"; delta params now {self.sizes['delta_params']:,}"
            )

    def tail_estimate(self, step_s: float) -> float:
        """The ETA's tail: final validation and checkpoint (tngram.train.metrics.tail_seconds)."""
        val, batch = (
            self.cfg.data.val_tokens or self.val_tokens.numel(),
            self.cfg.data.global_batch_tokens,
        )
        return tail_seconds(step_s, batch, int(val), self._val_s, self._save_s)

    @timed("_val_s")
    def evaluate(self) -> dict[str, Any]:
        """Val loss and BPB; rows owed moves (optim.memory_catchup) settled for it, then
        restored."""
        cfg = self.cfg
        with settled_tables(self.optimizers.values()):
            return evaluate_bpb(
                self.model,
                self.val_tokens,
                cfg.model.sequence_len,
                self.luts,
                cfg.data.micro_batch_seqs,
                ddp_rank=self.ctx.ddp_rank,
                world_size=self.ctx.world_size,
                autocast_dtype=self.amp,
                max_tokens=cfg.data.val_tokens,
                lockstep=self.sharded,
            )

    def log_row(self, loss: float, progress: Progress) -> None:
        """One metrics row (tokens/s over the steps since the previous row), with validation
        when due."""
        row = {
            "step": self.step,
            "train_loss": loss,
            "lr": self.lr_mult * self.cfg.optim.matrix_lr,
            "lr_multiplier": self.lr_mult,
            "muon_momentum": self.momentum,
            "tokens": self.tokens,
            "tokens_per_s": self.clock.window_tokens_per_s(),
        }
        self.clock.reset_window()
        if self.should_validate():
            self.last_eval = ev = self.evaluate()
            self.model.train()
            row.update({"val_loss": ev["val_loss"], "val_bpb": ev["val_bpb"]})
            progress.write(
                f"step {self.step}/{self.stop}: train {loss:.4f} val "
                f"{ev['val_loss']:.4f} bpb {ev['val_bpb']:.4f}"
            )
        self.log.log(row)

    @timed("_save_s")
    def save(self) -> None:
        """A checkpoint of this step: every process checks its weights are finite; the main one
        writes (FSDP-sharded: every process writes its shards through DCP,
        tngram.train.sharded_checkpoint)."""
        ctx = self.ctx
        if len(self.losses):  # the losses first: a non-finite one is reported as such
            self._read_losses()
            self._flush_clock()
        flags = [torch.isfinite(p).all() for p in local_parameters(self.model)]
        if not all_true(bool(torch.stack(flags).all()) if flags else True, ctx):  # one read
            raise TngramError(
                f"non-finite parameters after step {self.step}; not writing a checkpoint "
                f"(the last good one is kept in {self.run_dir / ckpt.CKPT_DIR})"
            )
        meta = {
            "tokens": self.tokens,
            "wall_s": self.clock.wall(),
            "train_time_s": self.clock.total_train_time(),
            "world_size": ctx.world_size,
            "loader": self.batches.state_dict(),  # before any batch held ahead
            "train_loss": self.last_loss,
            "config": self.cfg.to_dict(),
        }
        save_step_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.optimizers,
            meta,  # FSDP: DCP shards
            self.cfg.run.keep_checkpoints,
            ctx,
            self.sharded,
        )
        barrier(ctx)

    def finish(self, health: LossHealth) -> dict[str, Any]:
        """The summary (RUN/summary.json) and the final weights, written by the main process."""
        cfg, ctx, ev = self.cfg, self.ctx, self.last_eval
        assert ev is not None, "run() evaluates at the last step"
        if len(self.losses):
            self._read_losses()
            self._flush_clock()
        total_train_time = self.clock.total_train_time()
        summary = {
            "recipe": cfg.name,
            **self.sizes,
            "steps": self.step,
            "schedule_steps": cfg.schedule.steps,
            "train_loss": (
                self.last_loss if math.isfinite(self.last_loss) else last_logged_loss(self.run_dir)
            ),
            "val_loss": ev["val_loss"],
            "val_bpb": ev["val_bpb"],
            "val_tokens": ev["tokens"],
            "val_bytes": ev["bytes"],
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / max(total_train_time, 1e-9),
            "train_time_s": total_train_time,
            "wall_s": self.clock.wall(),
            "world_size": ctx.world_size,
            "grad_accum_steps": self.accum,
            "device": str(self.device),
            "dtype": str(self.amp or torch.float32).replace("torch.", ""),
        }
        healthy, why = health.verdict()
        summary.update(healthy=healthy, health_reason=why, health_steps_seen=health.steps)
        if self.prune_at:
            from tngram.memory.cp_rank import cp_ranks

            summary["cp_ranks"] = cp_ranks(self.model)
            summary["prune_at_step"] = self.prune_at
        settle_tables(self.optimizers.values())  # optim.memory_catchup: rows owed moves get them
        final_model = gather_for_save(self.model, {}, self.sharded)[0]  # FSDP: full tensors
        ckpt.check_final(self.run_dir, local_parameters(self.model), ev["val_loss"], self.step, ctx)
        if ctx.is_main:
            ckpt.save_final_weights(self.run_dir, final_model, self.step, self.cfg.to_dict())
            atomic_write_json(self.run_dir / "summary.json", summary)
            self.say(
                f"tngram: {cfg.name} done: step {self.step}, train "
                f"{summary['train_loss']:.4f}, val {summary['val_loss']:.4f} (bpb "
                f"{summary['val_bpb']:.4f}), {summary['tokens_per_s']:,.0f} tokens/s, "
                f"{summary['wall_s']:.0f} s -> {self.run_dir}"
            )
            if not healthy:
                self.say(
                    f"tngram: warning: the run is NOT healthy (summary.json healthy: false): {why}"
                )
        barrier(ctx)
        return summary
