"""The checks of the training config's fields, one place per config class: each section
(OptimConfig, DataConfig, RunConfig, ScheduleConfig in tngram.train.config) calls its check from
__post_init__, TrainConfig calls `check_train` for what crosses sections (the model's shape rules,
memory-only settings, the memory's optional hooks of tngram.memory.base). A memory config checks
itself when it is made (MemoryConfig.check). Each error is one line naming the field."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from tngram.common import TngramError
from tngram.memory.base import MemoryConfig
from tngram.train.sdpa import SDPA_SETTINGS

DTYPES = ("auto", "fp32", "bf16")
_SECTION_NAME = {
    "OptimConfig": "optim",
    "ScheduleConfig": "schedule",
    "DataConfig": "data",
    "RunConfig": "run",
}


def check_field(ok: bool, key: str, expected: str, got: Any) -> None:
    if not ok:
        raise TngramError(f"{key} must be {expected}, got {got!r}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MODEL_INT_MIN = {
    "vocab_size": 2,
    "n_layer": 1,
    "n_embd": 2,
    "n_head": 1,
    "n_kv_head": 1,
    "mlp_mult": 1,
    "mlp_hidden": 0,  # 0: mlp_mult * n_embd
    "sequence_len": 1,
    "memory_seed": 0,
}
MAX_VOCAB = 65536  # token shards store uint16 ids
# upper bounds far above any real model, so a typo (an extra zero run) fails here instead of
# looping for hours while the model is built
MODEL_INT_MAX = {
    "n_layer": 1024,
    "n_head": 1024,
    "n_kv_head": 1024,
    "n_embd": 65536,
    "mlp_mult": 64,
    "mlp_hidden": 1 << 20,
    "sequence_len": 1 << 20,
    "memory_seed": 2**63 - 1,
}


def validate_model(m: Any) -> None:
    for k, lo in MODEL_INT_MIN.items():
        check_field(
            isinstance(getattr(m, k), int) and getattr(m, k) >= lo,
            f"model.{k}",
            f"an int >= {lo}",
            getattr(m, k),
        )
    check_field(
        m.vocab_size <= MAX_VOCAB,
        "model.vocab_size",
        f"<= {MAX_VOCAB} (uint16 token shards)",
        m.vocab_size,
    )
    for k, hi in MODEL_INT_MAX.items():
        check_field(getattr(m, k) <= hi, f"model.{k}", f"<= {hi}", getattr(m, k))
    for k in ("rope_base", "logit_softcap"):
        check_field(
            _finite(getattr(m, k)) and getattr(m, k) > 0,
            f"model.{k}",
            "a finite float > 0",
            getattr(m, k),
        )
    for k in ("qk_gain_init", "tied_embed_init_std"):
        check_field(
            _finite(getattr(m, k)) and getattr(m, k) >= 0,
            f"model.{k}",
            "a finite float >= 0",
            getattr(m, k),
        )
    check_field(
        all(isinstance(i, int) for i in m.memory_layers),
        "model.memory_layers",
        "block indices",
        m.memory_layers,
    )


def validate_memory(mem: Any) -> None:
    """That model.memory is a memory config (which checked its fields when it was made)."""
    if mem is not None and not isinstance(mem, MemoryConfig):
        raise TngramError(
            f"model.memory must be a memory config (tngram.memory.base.MemoryConfig), "
            f"got {type(mem).__name__}"
        )


def check_finite(sec: Any) -> None:
    """Every float of a section is finite (nan/inf are refused everywhere)."""
    name = _SECTION_NAME[type(sec).__name__]
    for f in fields(sec):
        v = getattr(sec, f.name)
        if isinstance(v, float):
            check_field(math.isfinite(v), f"{name}.{f.name}", "finite", v)


def check_optim(o: Any) -> None:
    check_finite(o)
    for k in ("matrix_lr", "tied_embed_lr", "scalar_lr", "adam_eps", "grad_clip_norm"):
        check_field(getattr(o, k) >= 0, f"optim.{k}", ">= 0", getattr(o, k))
    check_field(
        o.memory_table_lr is None or o.memory_table_lr >= 0,
        "optim.memory_table_lr",
        ">= 0 or none",
        o.memory_table_lr,
    )
    for k in ("muon_momentum", "muon_momentum_start", "beta1", "beta2"):
        check_field(0 <= getattr(o, k) < 1, f"optim.{k}", "in [0, 1)", getattr(o, k))
    check_field(o.muon_ns_steps >= 1, "optim.muon_ns_steps", ">= 1", o.muon_ns_steps)
    check_field(
        o.memory_update in ("dense", "sparse", "rowwise"),
        "optim.memory_update",
        "one of dense, sparse, rowwise",
        o.memory_update,
    )
    check_field(
        isinstance(o.memory_catchup, bool),
        "optim.memory_catchup",
        "true or false",
        o.memory_catchup,
    )
    check_field(
        o.muon_momentum_warmup_steps >= 0,
        "optim.muon_momentum_warmup_steps",
        ">= 0",
        o.muon_momentum_warmup_steps,
    )
    from tngram.train.init_from import TRAINABLE

    check_field(o.trainable in TRAINABLE, "optim.trainable", f"one of {TRAINABLE}", o.trainable)


def check_data(d: Any) -> None:
    check_field(
        d.global_batch_tokens >= 1, "data.global_batch_tokens", ">= 1", d.global_batch_tokens
    )
    check_field(d.micro_batch_seqs >= 1, "data.micro_batch_seqs", ">= 1", d.micro_batch_seqs)
    check_field(
        d.val_tokens is None or d.val_tokens >= 1, "data.val_tokens", ">= 1 or none", d.val_tokens
    )
    check_field(0 <= d.seed < 2**63, "data.seed", "in [0, 2^63) (a 64-bit seed)", d.seed)


def check_run(r: Any) -> None:
    check_finite(r)
    check_field(r.parallel in ("ddp", "fsdp"), "run.parallel", "ddp or fsdp", r.parallel)
    check_field(r.sdpa in SDPA_SETTINGS, "run.sdpa", " / ".join(SDPA_SETTINGS), r.sdpa)
    check_field(0 <= r.seed < 2**63, "run.seed", "in [0, 2^63) (a 64-bit seed)", r.seed)
    check_field(
        r.device == "auto" or r.device == "cpu" or r.device == "mps" or r.device.startswith("cuda"),
        "run.device",
        "auto, cpu, cuda, cuda:N or mps",
        r.device,
    )
    check_field(r.dtype in DTYPES, "run.dtype", f"one of {DTYPES}", r.dtype)
    check_field(
        isinstance(r.compile, bool) or r.compile == "auto",
        "run.compile",
        "true, false or auto",
        r.compile,
    )
    check_field(r.log_every >= 1, "run.log_every", ">= 1", r.log_every)
    for k in ("val_every", "checkpoint_every"):
        check_field(getattr(r, k) >= 0, f"run.{k}", ">= 0 (0: only at the end)", getattr(r, k))
    check_field(r.keep_checkpoints >= 1, "run.keep_checkpoints", ">= 1", r.keep_checkpoints)
    check_field(
        0 <= r.threads <= 4096, "run.threads", "in [0, 4096] (0: torch's default)", r.threads
    )


def check_train(cfg: Any) -> None:
    """What involves several sections (each section checked itself when it was made; a memory
    config too, tngram.memory.base.MemoryConfig.check). TngramError naming the field."""
    o, d, r, m = cfg.optim, cfg.data, cfg.run, cfg.model
    validate_model(m)
    mem = m.memory
    validate_memory(mem)
    check_field(
        d.val_tokens is None
        or not isinstance(m.sequence_len, int)
        or d.val_tokens >= m.sequence_len,
        "data.val_tokens",
        f"none or >= model.sequence_len ({m.sequence_len}: one validation window)",
        d.val_tokens,
    )
    check_memory_settings(cfg)
    if r.parallel == "fsdp" and o.memory_update != "dense":
        raise TngramError(
            "run.parallel=fsdp needs optim.memory_update=dense (FSDP reduce-scatters "
            "dense gradients only); use run.parallel=ddp for sparse/rowwise tables"
        )
    m.validate()
    if mem is not None:
        mem.check_vocab(m.vocab_size)


def check_memory_settings(cfg: Any) -> None:
    """Settings that act on memory tables: refused on a model without memory (they would do
    nothing) and when the memory cannot honour them (tngram.memory.base.MemoryConfig hooks)."""
    o, mem = cfg.optim, cfg.model.memory
    if mem is None:
        for key, on in (
            (f"optim.memory_update={o.memory_update}", o.memory_update != "dense"),
            ("optim.memory_catchup=true", o.memory_catchup),
            ("optim.trainable=memory", o.trainable == "memory"),
        ):
            if on:
                raise TngramError(
                    f"{key} needs a model with memory (model.memory is none in "
                    f"{cfg.name!r}: it has no memory tables, so the setting would do nothing); "
                    "remove it or set model.memory.kind first"
                )
    if o.memory_catchup and o.memory_update == "dense":
        raise TngramError(
            "optim.memory_catchup=true needs optim.memory_update=sparse or rowwise "
            "(dense Adam moves every row at every step already)"
        )
    if mem is None or o.memory_update == "dense":
        return
    problem = mem.row_sparse_problem()
    if problem:
        raise TngramError(problem)
    if mem.reshape_step():
        raise TngramError(
            "optim.memory_update sparse/rowwise cannot be combined with "
            f"model.memory.{mem.reshape_step_field} > 0 (reshaping "
            "the memory's parameters needs the dense Adam state); "
            "use optim.memory_update=dense"
        )
