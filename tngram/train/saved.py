"""A run's config.json read back (tngram.readback for the file, this module for its fields).

`config_from_saved(d, where)` checks a saved config dict field by field before anything is built
from it: every key known, every value of its declared type (strictly: no string where an int
belongs, no float where an int belongs), every range of `validate_config`, and the model's size
against the memory available, so a hostile or damaged config.json is one line naming the file and
the field, never a long allocation or a model built from NaN.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from typing import Any, Union, get_args, get_origin, get_type_hints

from tngram.common import TngramError
from tngram.readback import BadRecordError

_SECTIONS = ("model", "optim", "schedule", "data", "run")


def _strict_ok(v: Any, hint: Any) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_strict_ok(v, a) for a in args)
    if hint is type(None):
        return v is None
    if origin is tuple:
        elem = args[0] if args else Any
        return isinstance(v, (list, tuple)) and all(_strict_ok(x, elem) for x in v)
    if hint is bool:
        return isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if hint is str:
        return isinstance(v, str)
    if hint is Any or hint is typing.Any:
        return True
    return True  # a type we do not know how to check: validate_config still runs


def _check_fields(
    sd: dict[str, Any], cls: type, prefix: str, where: str, skip: tuple[str, ...] = ()
) -> None:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for k, v in sd.items():
        if k in skip:
            continue
        if k not in known:
            raise BadRecordError(f"{where}: unknown field {prefix}{k}")
        if not _strict_ok(v, hints[k]):
            name = getattr(hints[k], "__name__", None) or str(hints[k]).replace("typing.", "")
            text = repr(v) if len(repr(v)) < 60 else repr(v)[:57] + "..."
            raise BadRecordError(f"{where}: field {prefix}{k} must be {name}, got {text}")


def config_from_saved(d: Any, where: str, check_memory: bool = True) -> Any:
    """The TrainConfig of a saved config dict, checked (see the module doc); BadRecordError
    (one line naming `where` and the field) otherwise."""
    from tngram.model.gpt import GPTConfig
    from tngram.train.config import (
        DataConfig,
        OptimConfig,
        RunConfig,
        ScheduleConfig,
        TrainConfig,
        validate_config,
    )

    if not isinstance(d, dict):
        raise BadRecordError(f"{where}: expected a JSON object")
    if not isinstance(d.get("name"), str):
        raise BadRecordError(f"{where}: field 'name' must be a string (the recipe name)")
    classes = {
        "model": GPTConfig,
        "optim": OptimConfig,
        "schedule": ScheduleConfig,
        "data": DataConfig,
        "run": RunConfig,
    }
    for sec in _SECTIONS:
        if sec not in d:
            raise BadRecordError(f"{where}: section {sec!r} is missing")
        if not isinstance(d[sec], dict):
            raise BadRecordError(f"{where}: section {sec!r} must be an object")
        _check_fields(
            d[sec], classes[sec], f"{sec}.", where, skip=("memory",) if sec == "model" else ()
        )
    extra = sorted(set(d) - set(_SECTIONS) - {"name"})
    if extra:
        raise BadRecordError(f"{where}: unknown field(s) {extra}")
    _check_memory_dict(d["model"].get("memory"), "model.", where)
    try:
        cfg = TrainConfig.from_dict(d)
        validate_config(cfg)
    except (TngramError, TypeError, ValueError, KeyError) as e:
        raise BadRecordError(
            f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if check_memory:
        check_model_fits(cfg, where)
    return cfg


def _check_memory_dict(mem: Any, prefix: str, where: str) -> None:
    """A saved memory config dict (or null): its kind known, its fields of their types."""
    from tngram.memory import memory_config_classes, migrate_memory_dict

    if mem is None:
        return
    if not isinstance(mem, dict):
        raise BadRecordError(f"{where}: field {prefix}memory must be an object or null")
    kinds = memory_config_classes()
    kind = mem.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise BadRecordError(
            f"{where}: field {prefix}memory.kind must be one of {sorted(kinds)}, got {kind!r}"
        )
    try:
        mem = migrate_memory_dict(mem)  # e.g. tngram with a variant field: tngram-variant
    except TngramError as e:
        raise BadRecordError(f"{where}: {prefix}memory: {e}") from None
    _check_fields(mem, kinds[mem["kind"]], f"{prefix}memory.", where, skip=("kind",))


def model_config_from_saved(d: Any, where: str, prefix: str = "gpt.") -> Any:
    """The GPTConfig of a saved model dict (an exported folder's config.json `gpt`), checked like
    a run's config.json model section: every key known, every value of its type, the ranges of
    validate_config, the memory's own rules and vocabulary, the memory layers distinct block
    indices. BadRecordError naming `where` and the field otherwise."""
    from tngram.model.gpt import GPTConfig

    # the model checks validate_config runs on a run's config (private there: one list of rules)
    from tngram.train.config_checks import validate_memory, validate_model

    if not isinstance(d, dict):
        raise BadRecordError(f"{where}: field {prefix.rstrip('.')} must be an object")
    _check_fields(d, GPTConfig, prefix, where, skip=("memory",))
    _check_memory_dict(d.get("memory"), prefix, where)
    try:
        m = GPTConfig.from_dict(d)
        validate_model(m)
        validate_memory(m.memory)
        if m.memory is not None:
            m.memory.check_vocab(m.vocab_size)
    except (TngramError, TypeError, ValueError, KeyError) as e:
        raise BadRecordError(
            f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    layers = list(m.memory_layers)
    if m.memory is not None and m.memory.injection == "block":
        if (
            not layers
            or len(set(layers)) != len(layers)
            or not all(0 <= i < m.n_layer for i in layers)
        ):
            raise BadRecordError(
                f"{where}: field {prefix}memory_layers must be distinct block indices in "
                f"[0, {m.n_layer}), got {layers}"
            )
    return m


def param_lower_bound(m: Any) -> int:
    """At most the GPT's parameter count: per block the q and output projections (d x d each)
    and the two MLP matrices (d x mlp_width each), plus the token embedding (V x d)."""
    d = m.n_embd
    return m.n_layer * (2 * d * d + 2 * d * m.mlp_width()) + m.vocab_size * d


def check_model_fits(cfg: Any, where: str) -> None:
    """The model's weights (counted on the meta device: nothing allocated) must fit the memory
    available; otherwise one line naming the sizes to lower."""
    import torch

    from tngram.model.gpt import GPT
    from tngram.train.health import available_memory

    have, what = available_memory("cpu")
    m = cfg.model
    # a lower bound first (q + out projections, the two MLP matrices, the embedding), so an absurd
    # size is refused at once; otherwise the exact count of the model built on the meta device
    n = param_lower_bound(m)
    if have is None or 4 * n <= have:
        try:
            with torch.device("meta"):
                n = GPT(cfg.model).num_params()
        except (TngramError, ValueError, RuntimeError, TypeError) as e:
            raise BadRecordError(
                f"{where}: the model cannot be built ({str(e).splitlines()[0][:160]})"
            ) from None
    need = 4 * n
    if have is not None and need > have:
        raise BadRecordError(
            f"{where}: the model has at least {n:,} parameters ({need / 2**30:,.1f} GiB) but only "
            f"{have / 2**30:,.1f} GiB {what}; the config's sizes (model.n_layer {m.n_layer}, "
            f"model.n_embd {m.n_embd}, model.vocab_size {m.vocab_size}, model.memory) are "
            f"too large for this machine"
        )
