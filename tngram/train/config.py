"""Training configuration: nested frozen dataclasses, serialised to the run's config.json.

A run = a recipe function (tngram.train.recipes) + dotted overrides (`--set optim.matrix_lr=0.02`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from tngram.common import TngramError
from tngram.memory.base import MemoryConfig
from tngram.model.gpt import GPTConfig


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """Muon for block matrices, Adam for embeddings/tables, controls and scalars (paper App. E)."""

    matrix_lr: float = 0.04  # Muon
    muon_momentum: float = 0.95  # final Nesterov momentum ...
    muon_momentum_start: float = 0.85  # ... ramped linearly from this value
    muon_momentum_warmup_steps: int = 500
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    tied_embed_lr: float = 0.05  # Adam: tied embedding (and head)
    memory_table_lr: float | None = None  # Adam: CP factors / hash tables (None -> tied_embed_lr)
    scalar_lr: float = 0.04  # Adam: scalar / control parameters
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 0.0  # 0 disables
    trainable: str = "all"  # "all" | "memory" (backbone frozen; tngram.train.warmstart)
    # memory tables: "dense" Adam | "sparse" lazy Adam on touched rows | "rowwise" one second
    # moment per row (tngram.optim.memory_update); config.json omits it when "dense"
    memory_update: str = "dense"
    # sparse/rowwise only: add, when a row is read again, the moves dense Adam would have made on it
    # in the steps it was not read (closed form; tngram.optim.memory_update). Omitted when false
    memory_catchup: bool = False


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    steps: int = 6000
    warmdown_steps: int = 1200  # constant lr, then linear decay to 0 over the last steps


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    dir: str | None = None  # dataset folder; None -> the default offline corpus
    global_batch_tokens: int = 524_288  # tokens per optimiser step across all processes
    micro_batch_seqs: int = 64  # sequences per process per micro-step
    val_tokens: int | None = None  # cap on validation tokens (None -> the whole val split)
    seed: int = 0  # loader seed


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    seed: int = 1337
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16"
    compile: bool | str = "auto"  # true | false | "auto" (compiled on CUDA, eager on CPU)
    device: str = "auto"
    threads: int = 0  # CPU threads for torch (0: torch's default / OMP_NUM_THREADS; fewer when the CPUs are busy, tngram.cpu)
    log_every: int = 10
    val_every: int = 250  # 0: only at the end
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2
    init_from: str | None = None  # run folder or `tngram export --hf` folder to start from
    # multi-process training: "ddp" (replicas) | "fsdp" (FSDP2 shards, tngram.train.fsdp);
    # config.json omits it when "ddp"
    parallel: str = "ddp"


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    name: str
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        optim = asdict(self.optim)
        if optim["memory_update"] == "dense":  # written only when set: older runs' configs match
            del optim["memory_update"]
        if not optim["memory_catchup"]:
            del optim["memory_catchup"]
        run = asdict(self.run)
        if run["parallel"] == "ddp":
            del run["parallel"]
        return {
            "name": self.name,
            "model": self.model.to_dict(),
            "optim": optim,
            "schedule": asdict(self.schedule),
            "data": asdict(self.data),
            "run": run,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        return cls(
            name=d["name"],
            model=GPTConfig.from_dict(d["model"]),
            optim=OptimConfig(**d["optim"]),
            schedule=ScheduleConfig(**d["schedule"]),
            data=DataConfig(**d["data"]),
            run=RunConfig(**d["run"]),
        )


# ---- validation and dotted overrides (`--set section.field=value`)

DTYPES = ("auto", "fp32", "bf16")
_SECTION_NAME = {
    "OptimConfig": "optim",
    "ScheduleConfig": "schedule",
    "DataConfig": "data",
    "RunConfig": "run",
}


def _check(ok: bool, key: str, expected: str, got: Any) -> None:
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
    "sequence_len": 1 << 20,
    "memory_seed": 2**63 - 1,
}


def _validate_model(m: GPTConfig) -> None:
    for k, lo in MODEL_INT_MIN.items():
        _check(
            isinstance(getattr(m, k), int) and getattr(m, k) >= lo,
            f"model.{k}",
            f"an int >= {lo}",
            getattr(m, k),
        )
    _check(
        m.vocab_size <= MAX_VOCAB,
        "model.vocab_size",
        f"<= {MAX_VOCAB} (uint16 token shards)",
        m.vocab_size,
    )
    for k, hi in MODEL_INT_MAX.items():
        _check(getattr(m, k) <= hi, f"model.{k}", f"<= {hi}", getattr(m, k))
    for k in ("rope_base", "logit_softcap"):
        _check(
            _finite(getattr(m, k)) and getattr(m, k) > 0,
            f"model.{k}",
            "a finite float > 0",
            getattr(m, k),
        )
    for k in ("qk_gain_init", "tied_embed_init_std"):
        _check(
            _finite(getattr(m, k)) and getattr(m, k) >= 0,
            f"model.{k}",
            "a finite float >= 0",
            getattr(m, k),
        )
    _check(
        all(isinstance(i, int) for i in m.memory_layers),
        "model.memory_layers",
        "block indices",
        m.memory_layers,
    )


def _validate_memory(mem: Any) -> None:
    """The memory config checks itself (tngram.memory.base.MemoryConfig.check: field ranges and
    the memory's own rules); here only that it is one."""
    if mem is None:
        return
    if not isinstance(mem, MemoryConfig):
        raise TngramError(
            f"model.memory must be a memory config (tngram.memory.base.MemoryConfig), "
            f"got {type(mem).__name__}"
        )
    mem.check()


def validate_config(cfg: TrainConfig) -> None:
    """Cheap checks of every field (no data, no model weights); TngramError naming the field and
    its range. Every float must be finite (nan/inf are refused everywhere)."""
    o, s, d, r = cfg.optim, cfg.schedule, cfg.data, cfg.run
    for sec in (o, s, d, r):
        for f in fields(sec):
            v = getattr(sec, f.name)
            if isinstance(v, float):
                _check(
                    math.isfinite(v), f"{_SECTION_NAME[type(sec).__name__]}.{f.name}", "finite", v
                )
    _validate_model(cfg.model)
    _validate_memory(cfg.model.memory)
    for k in ("matrix_lr", "tied_embed_lr", "scalar_lr", "adam_eps", "grad_clip_norm"):
        _check(getattr(o, k) >= 0, f"optim.{k}", ">= 0", getattr(o, k))
    _check(
        o.memory_table_lr is None or o.memory_table_lr >= 0,
        "optim.memory_table_lr",
        ">= 0 or none",
        o.memory_table_lr,
    )
    for k in ("muon_momentum", "muon_momentum_start", "beta1", "beta2"):
        _check(0 <= getattr(o, k) < 1, f"optim.{k}", "in [0, 1)", getattr(o, k))
    _check(o.muon_ns_steps >= 1, "optim.muon_ns_steps", ">= 1", o.muon_ns_steps)
    _check(
        o.memory_update in ("dense", "sparse", "rowwise"),
        "optim.memory_update",
        "one of dense, sparse, rowwise",
        o.memory_update,
    )
    _check(
        isinstance(o.memory_catchup, bool),
        "optim.memory_catchup",
        "true or false",
        o.memory_catchup,
    )
    if o.memory_catchup and o.memory_update == "dense":
        raise TngramError(
            "optim.memory_catchup=true needs optim.memory_update=sparse or rowwise "
            "(dense Adam moves every row at every step already)"
        )
    _check(r.parallel in ("ddp", "fsdp"), "run.parallel", "ddp or fsdp", r.parallel)
    if r.parallel == "fsdp" and o.memory_update != "dense":
        raise TngramError(
            "run.parallel=fsdp needs optim.memory_update=dense (FSDP reduce-scatters "
            "dense gradients only); use run.parallel=ddp for sparse/rowwise tables"
        )
    _check(
        o.muon_momentum_warmup_steps >= 0,
        "optim.muon_momentum_warmup_steps",
        ">= 0",
        o.muon_momentum_warmup_steps,
    )
    _check(s.steps >= 1, "schedule.steps", ">= 1", s.steps)
    _check(s.warmdown_steps >= 0, "schedule.warmdown_steps", ">= 0", s.warmdown_steps)
    _check(0 <= d.seed < 2**63, "data.seed", "in [0, 2^63) (a 64-bit seed)", d.seed)
    _check(0 <= r.seed < 2**63, "run.seed", "in [0, 2^63) (a 64-bit seed)", r.seed)
    _check(
        r.device == "auto" or r.device == "cpu" or r.device == "mps" or r.device.startswith("cuda"),
        "run.device",
        "auto, cpu, cuda, cuda:N or mps",
        r.device,
    )
    _check(d.global_batch_tokens >= 1, "data.global_batch_tokens", ">= 1", d.global_batch_tokens)
    _check(d.micro_batch_seqs >= 1, "data.micro_batch_seqs", ">= 1", d.micro_batch_seqs)
    _check(
        d.val_tokens is None or d.val_tokens >= 1, "data.val_tokens", ">= 1 or none", d.val_tokens
    )
    _check(
        d.val_tokens is None
        or not isinstance(cfg.model.sequence_len, int)
        or d.val_tokens >= cfg.model.sequence_len,
        "data.val_tokens",
        f"none or >= model.sequence_len ({cfg.model.sequence_len}: one validation window)",
        d.val_tokens,
    )
    _check(r.dtype in DTYPES, "run.dtype", f"one of {DTYPES}", r.dtype)
    _check(
        isinstance(r.compile, bool) or r.compile == "auto",
        "run.compile",
        "true, false or auto",
        r.compile,
    )
    _check(r.log_every >= 1, "run.log_every", ">= 1", r.log_every)
    for k in ("val_every", "checkpoint_every"):
        _check(getattr(r, k) >= 0, f"run.{k}", ">= 0 (0: only at the end)", getattr(r, k))
    _check(r.keep_checkpoints >= 1, "run.keep_checkpoints", ">= 1", r.keep_checkpoints)
    _check(0 <= r.threads <= 4096, "run.threads", "in [0, 4096] (0: torch's default)", r.threads)
    from tngram.train.init_from import TRAINABLE, check_init_from

    _check(o.trainable in TRAINABLE, "optim.trainable", f"one of {TRAINABLE}", o.trainable)
    if o.trainable == "memory" and cfg.model.memory is None:
        raise TngramError("optim.trainable=memory needs a model with memory (model.memory is none)")
    if (
        o.memory_update != "dense"
        and cfg.model.memory is not None
        and cfg.model.memory.reshape_step()
    ):
        raise TngramError(
            "optim.memory_update sparse/rowwise cannot be combined with "
            f"model.memory.{cfg.model.memory.reshape_step_field} > 0 (reshaping "
            "the memory's parameters needs the dense Adam state); "
            "use optim.memory_update=dense"
        )
    if r.init_from is not None:
        check_init_from(r.init_from)
    cfg.model.validate()
    if cfg.model.memory is not None:
        cfg.model.memory.check_vocab(cfg.model.vocab_size)


def check_memory_layers_used(cfg: TrainConfig, recipe_cfg: TrainConfig) -> None:
    """memory_layers changed from the recipe's on a config without memory has no effect: refused.
    (The recipe's own value, as in a --print-config round trip of a raw recipe, is accepted.)"""
    if cfg.model.memory is None and tuple(cfg.model.memory_layers) != tuple(
        recipe_cfg.model.memory_layers
    ):
        raise TngramError(
            f"model.memory_layers: recipe {cfg.name!r} has no memory module (model.memory is "
            f"none), so memory_layers={tuple(cfg.model.memory_layers)} would have no effect"
        )


def _sections(cfg: TrainConfig) -> dict[str, Any]:
    out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "name"}
    if cfg.model.memory is not None:
        out["model.memory"] = cfg.model.memory
    return out


def config_keys(cfg: TrainConfig) -> list[str]:
    """Every key `--set` / a config file accepts for this config. model.memory.kind (tngram,
    engram, oe or none) is always accepted; the other model.memory.* keys are those of the current
    memory kind (set model.memory.kind first to add a memory to a recipe without one)."""
    keys = ["name", "model.memory.kind"]
    for sec, obj in _sections(cfg).items():
        keys += [
            f"{sec}.{f.name}"
            for f in fields(obj)
            if not (sec == "model" and f.name == "memory") and f"{sec}.{f.name}" not in keys
        ]
    return keys


def _memory_kinds() -> dict[str, Any]:
    from tngram.memory import memory_config_classes

    return memory_config_classes()


def _parse_value(key: str, text: str, hint: Any) -> Any:
    """Parse `text` as the annotated type `hint` (int, float, bool, str, X | None, tuple[int, ...])."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _parse_value(key, text, a)
            except TngramError:
                continue
        raise TngramError(f"{key} expects {_type_name(hint)}, got {text!r}")
    if origin is tuple:
        items = [t for t in text.strip().strip("()[]").split(",") if t.strip()]
        elem = args[0] if args else str
        try:
            return tuple(_parse_value(key, t.strip(), elem) for t in items)
        except TngramError:
            raise TngramError(
                f"{key} expects a comma-separated list of {_type_name(elem)} "
                f"(e.g. 1,3), got {text!r}"
            ) from None
    if hint is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise TngramError(f"{key} expects a bool (true/false), got {text!r}")
    if hint is int:
        try:
            return int(text.strip().replace("_", ""))
        except ValueError:
            raise TngramError(f"{key} expects an int, got {text!r}") from None
    if hint is float:
        try:
            return float(text.strip())
        except ValueError:
            raise TngramError(f"{key} expects a float, got {text!r}") from None
    if hint is str:
        return text
    if hint is Any:  # free-form: JSON if it parses, else the string
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    raise TngramError(f"{key} has type {_type_name(hint)}, which --set cannot parse")


def _coerce_value(key: str, value: Any, hint: Any) -> Any:
    """A typed value from a config file (TOML/YAML) checked against `hint`; strings are parsed
    as `--set` parses them (so "none" works where TOML has no null)."""
    if isinstance(value, str):
        return _parse_value(key, value, hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce_value(key, value, a)
            except TngramError:
                continue
        raise TngramError(f"{key} expects {_type_name(hint)}, got {value!r}")
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        elem = args[0] if args else Any
        return tuple(_coerce_value(key, v, elem) for v in items)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
    }
    if hint in ok:
        if not ok[hint]:
            raise TngramError(f"{key} expects {_type_name(hint)}, got {value!r}")
        return float(value) if hint is float else value
    if hint is Any:
        return value
    raise TngramError(f"{key} expects {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise TngramError(f"--set expects section.field=value, got {item!r}")
    key, text = (s.strip() for s in item.split("=", 1))
    return key, text


def apply_overrides(cfg: TrainConfig, items: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply `section.field=value` strings (e.g. "optim.matrix_lr=0.02", "model.memory.cp_rank=64")
    and validate. Unknown keys and unparsable values raise TngramError listing what is valid."""
    return apply_settings(cfg, [split_override(item) for item in items])


def apply_settings(
    cfg: TrainConfig, settings: list[tuple[str, Any]], origin: str = ""
) -> TrainConfig:
    """Apply (dotted key, value) pairs in order, then validate. A value is a `--set` string or a
    typed value from a config file. `model.memory.kind=K` switches the memory to K's defaults
    (none removes it); later model.memory.* keys then refine it. `origin` prefixes errors
    (e.g. the config file's name). Consecutive model.memory.* fields are applied together (a memory
    config checks itself when it is made, and a pair such as cp_rank / min_cp_rank may only be
    valid once both are set)."""
    where = f"{origin}: " if origin else ""
    pending: dict[str, tuple[str, Any]] = {}  # memory field -> (key=text, parsed value)
    for key, value in settings:
        try:
            if not key.startswith("model.memory.") or key == "model.memory.kind":
                cfg = _apply_memory_fields(cfg, pending)
            cfg = _apply_one(cfg, key, value, pending)
        except TngramError as e:
            raise TngramError(f"{where}{e}") from None
    try:
        cfg = _apply_memory_fields(cfg, pending)
        validate_config(cfg)
    except TngramError as e:
        raise TngramError(f"{where}{e}") from None
    return cfg


def _apply_memory_fields(cfg: TrainConfig, pending: dict[str, tuple[str, Any]]) -> TrainConfig:
    """Make the memory config with the pending model.memory.* values (then empties `pending`)."""
    if not pending:
        return cfg
    changes = {name: v for name, (_, v) in pending.items()}
    keys = ", ".join(k for k, _ in pending.values())
    pending.clear()
    try:
        mem = replace(cfg.model.memory, **changes)
    except TngramError as e:
        raise TngramError(f"{keys}: {e}") from None
    return replace(cfg, model=replace(cfg.model, memory=mem))


def _apply_one(
    cfg: TrainConfig, key: str, value: Any, pending: dict[str, tuple[str, Any]] | None = None
) -> TrainConfig:
    """`cfg` with one setting applied; a model.memory.* field goes into `pending` when given."""
    text = value if isinstance(value, str) else json.dumps(value)
    if key == "name":
        return replace(cfg, name=str(value))
    if key in ("model.memory.kind", "model.memory"):
        kinds = _memory_kinds()
        kind = (
            None
            if value is None or str(value).strip().lower() in ("none", "null")
            else str(value).strip()
        )
        if kind is not None and kind not in kinds:
            raise TngramError(f"{key} must be one of {sorted(kinds) + ['none']}, got {value!r}")
        mem = cfg.model.memory
        if kind is None:
            mem = None
        elif mem is None or mem.kind != kind:
            mem = kinds[kind]()
        return replace(cfg, model=replace(cfg.model, memory=mem))
    sec, _, fname = key.rpartition(".")
    sections = _sections(cfg)
    if sec not in sections:
        if sec == "model.memory":
            raise TngramError(
                f"{key}: recipe {cfg.name!r} has no memory module (model.memory is none); "
                f"set model.memory.kind={'|'.join(_memory_kinds())} first to add one"
            )
        raise TngramError(
            f"unknown config section {sec!r} in {key!r}; valid keys: " + ", ".join(config_keys(cfg))
        )
    obj = sections[sec]
    names = {f.name for f in fields(obj)} - ({"memory"} if sec == "model" else set())
    if fname not in names:
        raise TngramError(
            f"unknown config key {key!r}; valid keys in {sec}: "
            + ", ".join(f"{sec}.{n}" for n in sorted(names))
        )
    hint = get_type_hints(type(obj))[fname]
    new_value = (
        _parse_value(key, value, hint)
        if isinstance(value, str)
        else _coerce_value(key, value, hint)
    )
    if sec == "model.memory" and pending is not None:
        pending[fname] = (f"{key}={text}", new_value)
        return cfg
    try:
        new = replace(obj, **{fname: new_value})
    except TngramError as e:
        raise TngramError(f"{key}={text}: {e}") from None
    if sec == "model.memory":
        return replace(cfg, model=replace(cfg.model, memory=new))
    return replace(cfg, **{sec: new})


def with_schedule_steps(cfg: TrainConfig, steps: int | None) -> TrainConfig:
    """`--steps N`: the schedule's length set to N, warm-down scaled in proportion (at least 1,
    never longer than before)."""
    if steps is None:
        return cfg
    if steps < 1:
        raise TngramError(f"--steps must be >= 1, got {steps}")
    s = cfg.schedule
    warm = min(s.warmdown_steps, max(1, int(steps * s.warmdown_steps / s.steps)))
    return replace(cfg, schedule=replace(s, steps=steps, warmdown_steps=warm))
