"""Training configuration: nested frozen dataclasses, serialised to the run's config.json.

A run = a recipe function (tngram.train.recipes) + dotted overrides (`--set optim.matrix_lr=0.02`).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from types import UnionType
from typing import Any, Union, cast, get_args, get_origin, get_type_hints

from tngram.common import TngramError
from tngram.memory import memory_config_as, with_memory_fields
from tngram.model.gpt import GPTConfig
from tngram.train.config_checks import (
    check_field,
    check_data,
    check_finite,
    check_optim,
    check_run,
    check_train,
)


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

    def __post_init__(self) -> None:
        check_optim(self)


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    steps: int = 6000
    warmdown_steps: int = 1200  # constant lr, then linear decay to 0 over the last steps

    def __post_init__(self) -> None:
        check_finite(self)
        check_field(self.steps >= 1, "schedule.steps", ">= 1", self.steps)
        check_field(
            self.warmdown_steps >= 0, "schedule.warmdown_steps", ">= 0", self.warmdown_steps
        )


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    dir: str | None = None  # dataset folder; None -> the default offline corpus
    global_batch_tokens: int = 524_288  # tokens per optimiser step across all processes
    micro_batch_seqs: int = 64  # sequences per process per micro-step
    val_tokens: int | None = None  # cap on validation tokens (None -> the whole val split)
    seed: int = 0  # loader seed
    # train although the schedule reads the training split more than MAX_PASSES times
    # (tngram.train.health.check_passes); config.json omits it when false
    allow_repeat: bool = False

    def __post_init__(self) -> None:
        check_data(self)


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    seed: int = 1337
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16"
    compile: bool | str = "auto"  # true | false | "auto" (compiled on CUDA, eager on CPU)
    device: str = "auto"
    # CPU threads for torch (0: torch's default / OMP_NUM_THREADS; fewer when the CPUs are busy,
    # tngram.cpu)
    threads: int = 0
    log_every: int = 10
    val_every: int = 250  # 0: only at the end
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2
    init_from: str | None = None  # run folder or `tngram export --hf` folder to start from
    # multi-process training: "ddp" (replicas) | "fsdp" (FSDP2 shards, tngram.train.fsdp);
    # config.json omits it when "ddp"
    parallel: str = "ddp"
    # which attention kernel torch prefers (tngram.train.sdpa): "auto" (torch's order) | "cudnn"
    # | "flash" | "efficient" | "math"; config.json omits it when "auto"
    sdpa: str = "auto"

    def __post_init__(self) -> None:
        check_run(self)


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    name: str
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_train(self)

    def to_dict(self) -> dict[str, Any]:
        optim = asdict(self.optim)
        if optim["memory_update"] == "dense":  # written only when set: older runs' configs match
            del optim["memory_update"]
        if not optim["memory_catchup"]:
            del optim["memory_catchup"]
        run = asdict(self.run)
        if run["parallel"] == "ddp":
            del run["parallel"]
        if run["sdpa"] == "auto":
            del run["sdpa"]
        data = asdict(self.data)
        if not data["allow_repeat"]:
            del data["allow_repeat"]
        return {
            "name": self.name,
            "model": self.model.to_dict(),
            "optim": optim,
            "schedule": asdict(self.schedule),
            "data": data,
            "run": run,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        model, optim = GPTConfig.from_dict(d["model"]), dict(d["optim"])
        if model.memory is None:  # saved before they were refused there: they did nothing
            optim.pop("memory_update", None)
            optim.pop("memory_catchup", None)
        return cls(
            name=d["name"],
            model=model,
            optim=OptimConfig(**optim),
            schedule=ScheduleConfig(**d["schedule"]),
            data=DataConfig(**d["data"]),
            run=RunConfig(**d["run"]),
        )


# ---- validation and dotted overrides (`--set section.field=value`)


def validate_config(cfg: TrainConfig) -> None:
    """What a config's construction cannot check: the machine's state (run.init_from names a
    run or export that exists now). Every field was checked when the config was made (each
    section's __post_init__, then TrainConfig's for what crosses sections), so this does not
    check them again."""
    if not isinstance(cfg, TrainConfig):
        raise TngramError(f"expected a TrainConfig, got {type(cfg).__name__}")
    if cfg.run.init_from is not None:
        from tngram.train.init_from import check_init_from

        check_init_from(cfg.run.init_from)


# settings that act only on memory tables: refused on a model without memory (config_checks), and
# left out by the compare / experiment runners when their --set reaches a run without memory
MEMORY_ONLY_KEYS = ("optim.memory_update", "optim.memory_catchup", "optim.memory_table_lr")


def check_memory_layers_used(cfg: TrainConfig, recipe_cfg: TrainConfig) -> None:
    """memory_layers or optim.memory_table_lr changed from the recipe's on a config without
    memory has no effect: refused. (The recipe's own values, as in a --print-config round trip
    of a raw recipe, are accepted.)"""
    if cfg.model.memory is None and tuple(cfg.model.memory_layers) != tuple(
        recipe_cfg.model.memory_layers
    ):
        raise TngramError(
            f"model.memory_layers: recipe {cfg.name!r} has no memory module (model.memory is "
            f"none), so memory_layers={tuple(cfg.model.memory_layers)} would have no effect"
        )
    lr = cfg.optim.memory_table_lr
    if cfg.model.memory is None and lr != recipe_cfg.optim.memory_table_lr:
        raise TngramError(
            f"optim.memory_table_lr={lr} needs a model with memory (model.memory is none in "
            f"{cfg.name!r}: it has no memory tables, so the setting would do nothing); "
            "remove it or set model.memory.kind first"
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


def did_you_mean(key: str, keys: list[str]) -> str:
    """' (did you mean X?)' for the valid key closest to a mistyped one (difflib's ratio >= 0.6,
    or the only key with the same last part), "" when none is close."""
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:
        same = [k for k in keys if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
        close = same if len(same) == 1 else []
    return f" (did you mean {close[0]}?)" if close else ""


def _memory_kinds() -> dict[str, Any]:
    from tngram.memory import memory_config_classes

    return memory_config_classes()


def _parse_value(key: str, text: str, hint: Any) -> Any:
    """Parse `text` as the annotated type `hint` (int, float, bool, str, X | None,
    tuple[int, ...])."""
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
    (none removes it; between tngram and tngram-variant the shared fields are kept); later
    model.memory.* keys then refine it. A field the memory's kind handed to another kind
    (tngram's order_combine, hash_orders, ...: tngram-variant's) switches it to that kind first.
    `origin` prefixes errors (e.g. the config file's name). Consecutive model.memory.* fields are
    applied together (a memory config checks itself when it is made, and a pair such as cp_rank /
    min_cp_rank may only be valid once both are set)."""
    where = f"{origin}: " if origin else ""
    pending: dict[str, tuple[str, Any]] = {}  # memory field -> (key=text, parsed value)
    # a _Draft has TrainConfig's fields; the helpers below only read them and `replace` the draft
    cfg = cast(TrainConfig, _Draft(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)}))
    for key, value in settings:
        try:
            if not key.startswith("model.memory.") or key == "model.memory.kind":
                cfg = _apply_memory_fields(cfg, pending)
            cfg = _apply_one(cfg, key, value, pending)
        except TngramError as e:
            raise TngramError(f"{where}{e}") from None
    try:
        cfg = _apply_memory_fields(cfg, pending)
        out = TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})
        validate_config(out)
    except TngramError as e:
        raise TngramError(f"{where}{e}") from None
    return out


@dataclass(kw_only=True, frozen=True)
class _Draft:
    """A TrainConfig while apply_settings edits it: the same fields, each section checked as it
    is made, the checks across sections (TrainConfig's) once, when the settings are all in."""

    name: str
    model: GPTConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    data: DataConfig
    run: RunConfig


def _apply_memory_fields(cfg: TrainConfig, pending: dict[str, tuple[str, Any]]) -> TrainConfig:
    """Make the memory config with the pending model.memory.* values (then empties `pending`)."""
    if not pending:
        return cfg
    changes = {name: v for name, (_, v) in pending.items()}
    keys = ", ".join(k for k, _ in pending.values())
    pending.clear()
    try:
        mem = with_memory_fields(cfg.model.memory, **changes)
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
        mem = None if kind is None else memory_config_as(cfg.model.memory, kind)
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
            f"unknown config section {sec!r} in {key!r}{did_you_mean(key, config_keys(cfg))}; "
            "valid keys: " + ", ".join(config_keys(cfg))
        )
    obj = sections[sec]
    names = {f.name for f in fields(obj)} - ({"memory"} if sec == "model" else set())
    if sec == "model.memory" and fname in obj.moved_fields:  # e.g. tngram's order_combine
        obj = memory_config_as(obj, obj.moved_fields[fname])
        cfg = replace(cfg, model=replace(cfg.model, memory=obj))
        names = {f.name for f in fields(obj)}
    if fname not in names:
        raise TngramError(
            f"unknown config key {key!r}{did_you_mean(key, config_keys(cfg))}; "
            f"valid keys in {sec}: " + ", ".join(f"{sec}.{n}" for n in sorted(names))
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
