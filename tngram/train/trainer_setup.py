"""How a training run is set up: the checks and records before the first step, and the
`TrainerSetup` half of `tngram.train.loop.Trainer` (resume checks, data, model, optimisers,
compiled forward, records). `tngram.train.loop` holds the step and the loop; read it first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from tngram.common import TngramError, atomic_write_json
from tngram.model.gpt import GPT, param_counts
from tngram.optim.groups import build_param_groups, format_param_table
from tngram.optim.memory_update import setup_memory_update
from tngram.optim.muon import Muon, muon_impl
from tngram.train import checkpoint as ckpt
from tngram.train import compile_mode
from tngram.train.checkpoint import RESUMABLE_RUN_FIELDS
from tngram.train.compile_mode import compile_forward
from tngram.train.config import TrainConfig
from tngram.train.dist import DistContext, broadcast_str, wrap_ddp
from tngram.train.fsdp import shard_model
from tngram.train.health import check_batch_vs_data, check_passes
from tngram.train.metrics import MetricsLog, env_info
from tngram.train.portable import record_dataset
from tngram.train.rundir import claim_run_dir, release_run_dir
from tngram.train.sdpa import sdpa_pick
from tngram.train.sharded_checkpoint import load_step_checkpoint
from tngram.train.warmstart import apply_warmstart


def autocast_dtype(run_dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; on CPU only when asked (run.dtype=bf16)."""
    if run_dtype == "bf16" or (run_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 matrices on this CPU (it needs AVX-512). Without it torch
    runs CPU bf16 matmuls through a reference kernel, many times slower than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def live_sizes(model: GPT, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` (from model.gpt.param_counts) updated to the model's actual shapes (after CP-rank
    pruning)."""
    raw_total = sizes["total_params"] - sizes["delta_params"]
    total = model.num_params()
    return {
        "total_params": total,
        "memory_params": model.memory_params(),
        "delta_params": total - raw_total,
    }


def prune_at_step(cfg: TrainConfig, world_size: int) -> int:
    """The step after which the memory reshapes its parameters (TN-gram's adaptive CP rank
    pruning; 0: never), checked against the schedule and the process count."""
    mem = cfg.model.memory
    at = mem.reshape_step() if mem is not None else 0
    key = f"model.memory.{mem.reshape_step_field}" if at else ""
    if at and at >= cfg.schedule.steps:
        raise TngramError(
            f"{key} ({at}) must be < schedule.steps ({cfg.schedule.steps}); 0 switches pruning off"
        )
    if at and world_size > 1:
        raise TngramError(
            f"{key} > 0 (adaptive CP rank) runs in one process only; "
            "DDP cannot change parameter shapes mid-run"
        )
    return at


def claim(run_dir: Path, cfg: TrainConfig, resume: bool, ctx: DistContext):
    """The main process checks and locks the run folder; every process fails together if it
    can't."""
    lock, err = None, None
    if ctx.is_main:
        try:
            lock = claim_run_dir(run_dir, cfg.name, resume)
            if lock.stale:
                print(
                    f"tngram: note: took over the lock of {run_dir} from pid "
                    f"{lock.stale.get('pid')} "
                    f"on {lock.stale.get('host')}, which is no longer running"
                )
        except TngramError as e:
            err = str(e)
    err = broadcast_str(err, ctx)
    if err is not None:
        if lock is not None:
            release_run_dir(lock)
        raise TngramError(err)
    return lock


def check_resume_config(run_dir: Path, checkpoint: Path, cfg: TrainConfig) -> None:
    """The checkpoint's config must equal `cfg` except for RESUMABLE_RUN_FIELDS, and so must the
    run's config.json (an edit there would otherwise be signed by the next export)."""
    saved = ckpt.read_checkpoint_meta(checkpoint).get("config") or ckpt.read_run_config(run_dir)
    new = json.loads(json.dumps(cfg.to_dict()))
    if str(new.get("name")).startswith(f"{saved.get('name')}+memory="):
        new["name"] = saved.get("name")  # a run made before resolve_config named memory changes
    diffs = ckpt.config_differences(new, saved)
    if diffs:
        raise TngramError(
            f"cannot resume {run_dir}: the checkpoint's config differs in "
            f"{sorted(k for k, _, _ in diffs)}; resume with the same recipe and --set overrides "
            f"(only run.{{{','.join(RESUMABLE_RUN_FIELDS)}}} may change)"
        )
    if (run_dir / "config.json").exists():
        ckpt.check_recorded_config(
            ckpt.read_run_config(run_dir),
            saved,
            str(run_dir / "config.json"),
            str(checkpoint / "meta.json"),
        )


def open_data(cfg: TrainConfig, ctx: DistContext):
    from tngram.data.build import ensure_default_data, open_dataset, validate_dataset

    data_dir = cfg.data.dir
    if data_dir is None:  # the default corpus: built once by the main process
        data_dir = (
            str(ensure_default_data(vocab_size=cfg.model.vocab_size)) if ctx.is_main else None
        )
        data_dir = broadcast_str(data_dir, ctx)
    assert data_dir is not None  # broadcast from the main process
    info = open_dataset(data_dir)
    if info.vocab_size != cfg.model.vocab_size:
        raise TngramError(
            f"model.vocab_size is {cfg.model.vocab_size} but the dataset {info.dir} has "
            f"vocab {info.vocab_size}; pass --set model.vocab_size={info.vocab_size}"
        )
    err = None
    if ctx.is_main:  # every shard, before step 1 (cached in the dataset's manifest)
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
        self.train_time = 0.0  # this session
        self.win_time, self.win_tokens = 0.0, 0  # since the last metrics row

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


class TrainerSetup:
    """The setup half of Trainer (tngram.train.loop): each method runs once, from __init__."""

    # set by Trainer.__init__ before these methods run
    cfg: TrainConfig
    run_dir: Path
    ctx: DistContext
    say: Callable[..., None]
    accum: int
    stop: int
    step: int

    def _resume_point(self, resume: bool) -> Path | None:
        """Refuse to overwrite checkpoints; on resume the newest checkpoint that verifies (saying
        which newer ones are skipped), whose config must match."""
        run_dir = self.run_dir
        existing = ckpt.list_checkpoints(run_dir)
        if existing and not resume:
            raise TngramError(
                f"{run_dir} already holds a run with checkpoints; pass --resume to "
                f"continue it or choose another --out"
            )
        latest = ckpt.newest_good_checkpoint(run_dir, self.say) if resume else None
        if resume and existing and latest is None:
            raise TngramError(
                f"cannot resume {run_dir}: none of its {len(existing)} checkpoint(s) verifies "
                f"(see the lines above); move {run_dir / ckpt.CKPT_DIR} away to start over"
            )
        if latest is not None:
            check_resume_config(run_dir, latest, self.cfg)
        elif resume:
            self.say(f"tngram: no checkpoint in {run_dir}; starting from step 0")
        return latest

    def _setup_data(self) -> None:
        """The dataset (built on first use), the train loader, the validation tokens and the
        tokenizer's byte tables (for bits per byte)."""
        from tngram.data.bpb import token_byte_luts
        from tngram.data.loader import DeviceBatches, TokenLoader, load_val_tokens
        from tngram.data.tokenizer import load_tokenizer

        cfg, ctx = self.cfg, self.ctx
        V, T = cfg.model.vocab_size, cfg.model.sequence_len
        self.data = open_data(cfg, ctx)
        self.loader = TokenLoader(
            self.data.train_files,
            cfg.data.micro_batch_seqs,
            T,
            ddp_rank=ctx.ddp_rank,
            world_size=ctx.world_size,
            seed=cfg.data.seed,
            vocab_size=V,
        )
        train_tokens = sum(self.loader.counts)
        check_batch_vs_data(cfg, train_tokens)
        note = check_passes(cfg, train_tokens, self.data.dir, self.data.manifest.get("kind"))
        if note:
            self.say(note)
        # on CUDA: pinned, non_blocking, one batch ahead (tngram.data.loader.DeviceBatches)
        self.batches = DeviceBatches(self.loader, ctx.device)
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
        table_opt, rest = setup_memory_update(
            model, self.groups, o.memory_update, (o.beta1, o.beta2), o.adam_eps, o.memory_catchup
        )
        muon_groups = [g for g in rest if g["optimizer"] == "muon"]
        adam_groups = [g for g in rest if g["optimizer"] == "adam"]
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            "adam": torch.optim.Adam(
                adam_groups, betas=(o.beta1, o.beta2), eps=o.adam_eps, fused=device.type == "cuda"
            )
        }
        if muon_groups:
            self.optimizers["muon"] = Muon(
                muon_groups,
                lr=o.matrix_lr,
                momentum=o.muon_momentum_start,
                nesterov=True,
                ns_steps=o.muon_ns_steps,
                ddp_rank=ctx.ddp_rank,
                world_size=ctx.world_size,
                stack_shapes=muon_impl(device) == "stacked",  # CUDA: one stack per shape
            )
        if table_opt is not None:
            self.optimizers["memory"] = table_opt
        self.sizes = param_counts(cfg.model)
        if ctx.is_main:  # a checkpoint holds the weights and up to two moments per parameter
            ckpt_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
            ckpt.check_free_space(
                self.run_dir, ckpt_bytes + ckpt_bytes // 3, "a checkpoint and the final weights"
            )

    def _load(self, latest: Path) -> None:
        """Weights, optimiser moments, loader position, RNG, step, tokens and times of `latest`."""
        meta = load_step_checkpoint(
            latest, self.model, self.optimizers, self.sharded
        )  # any world size
        try:
            self.batches.load_state_dict(meta["loader"])
        except TngramError as e:  # the loader's own checks (other data, a position past it)
            raise TngramError(f"{latest / 'meta.json'}: field loader: {e}") from None
        self.step, self.tokens = meta["step"], meta["tokens"]
        self.clock = StepClock(meta["train_time_s"], meta["wall_s"])
        self.sizes = live_sizes(self.model, self.sizes)  # smaller if written after pruning
        if meta.get("world_size") != self.ctx.world_size:
            self.say(
                f"tngram: note: checkpoint was written with {meta.get('world_size')} processes, "
                f"resuming with {self.ctx.world_size} (same global batch, so the same optimisation)"
            )
        self.say(f"tngram: resumed {self.run_dir} from {latest.name}")

    def _setup_forward(self) -> None:
        """Autocast (bf16 on CUDA, fp32 on CPU unless run.dtype=bf16), run.compile
        (tngram.train.compile_mode: compiled on CUDA by default), DDP."""
        self.amp = amp = autocast_dtype(self.cfg.run.dtype, self.device)
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=amp))
            if amp is not None
            else nullcontext
        )
        fwd, self.compile_state = compile_forward(self.model, self.cfg.run.compile, self.device)
        if not self.compile_state.armed:  # "auto": once the first step compiled (loop.py)
            self.compile_newton_schulz()
        self.fwd_model = fwd if self.sharded else wrap_ddp(fwd, self.ctx)

    def compile_newton_schulz(self) -> None:
        """Muon's Newton-Schulz through torch.compile where the forward is compiled on CUDA, as
        parameter-golf compiles its own (tngram.optim.muon); eager on the CPU, even under
        run.compile=true (the CPU's bf16 Newton-Schulz keeps its bits)."""
        muon = self.optimizers.get("muon")
        on_cuda = compile_mode.compiles("auto", self.device)  # "auto" compiles on CUDA only
        if isinstance(muon, Muon) and self.compile_state.ran == "compiled" and on_cuda:
            muon.use_compiled_ns()
            self.compile_state.newton_schulz = "compiled"

    def write_env(self) -> None:
        """RUN/env.json (main process), with what the forward runs (compiled / eager, why)."""
        if self.ctx.is_main:
            self.env["compile"] = self.compile_state.record()
            atomic_write_json(self.run_dir / "env.json", self.env)

    def _write_records(self, logger: str) -> None:
        """config.json, the dataset record, env.json, the metrics log; then the run's header."""
        cfg, ctx, run_dir, sizes = self.cfg, self.ctx, self.run_dir, self.sizes
        if ctx.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.save_run_config(run_dir, cfg.to_dict())
            record_dataset(
                run_dir, self.data
            )  # tokenizer + manifest copy: the run folder stands alone
            self.env = env_info(self.device, ctx.world_size, self.accum)
            m = cfg.model  # the attention kernel torch picks for the model (run.sdpa)
            self.env["sdpa"] = cfg.run.sdpa
            self.env["sdpa_backend"] = sdpa_pick(
                m.n_head, m.n_kv_head, m.n_embd // m.n_head, m.sequence_len, self.device, self.amp
            )
            self.write_env()
        self.log = MetricsLog(
            run_dir,
            ctx.is_main,
            keep_until_step=self.step,
            logger=logger,
            run_name=cfg.name,
            config=cfg.to_dict(),
        )
        n = torch.get_num_threads()  # what train() chose (tngram.cpu rule, said if it changed)
        threads = f" ({n} thread{'s' if n != 1 else ''})" if self.device.type == "cpu" else ""
        self.say(
            f"tngram: {cfg.name}: {sizes['total_params']:,} params "
            f"(memory {sizes['memory_params']:,}, "
            f"delta {sizes['delta_params']:,}); {ctx.world_size} process(es) x {self.accum} "
            f"micro-step(s) x {cfg.data.micro_batch_seqs} x {cfg.model.sequence_len} tokens = "
            f"{cfg.data.global_batch_tokens:,} tokens/step; steps {self.step}->{self.stop} of "
            f"{cfg.schedule.steps}; device {self.device}{threads}; "
            f"autocast {self.amp or 'off (fp32)'}"
        )
        if self.device.type == "cpu" and self.amp is torch.bfloat16 and not cpu_has_native_bf16():
            self.say(
                "note: this CPU has no native bf16 matmul, so bf16 autocast runs many times slower "
                "than fp32 here; --set run.dtype=fp32 trains faster (and changes the numbers)"
            )
        self.say(format_param_table(self.groups))
