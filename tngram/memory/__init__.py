"""Memory modules: TN-gram (ours), Engram (DeepSeek's reference) and Over-Encoding.

Every memory follows the contract of `tngram.memory.base` (a `MemoryConfig` subclass with
`kind`, `injection`, checks, keyword-only `build(*, d_model, vocab_size, layer_id, layer_ids)`
and `param_count(...)`; a module with `table_parameters()` / `control_parameters()`) and is
registered here by kind. Modules never import the model.

A kind may hand fields to another (`MemoryConfig.moved_fields`: TN-gram's variant settings are
kind tngram-variant's): `migrate_memory_dict` reads a saved config dict that names them as that
kind, and `with_memory_fields` / `--set` move a config there when one is set.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from typing import Any

from tngram.common import TngramError


# kind -> "module:ConfigClass" of the built-in memories, imported on first use (so that
# `import tngram.memory` stays light); register_memory adds more at run time.
MEMORY_KINDS: dict[str, str] = {
    "tngram": "tngram.memory.tngram:TNGramConfig",
    "tngram-hashed": "tngram.memory.tngram_hashed:TNGramHashedConfig",
    "tngram-variant": "tngram.memory.tngram_variants:TNGramVariantConfig",
    "engram": "tngram.memory.engram:EngramConfig",
    "oe": "tngram.memory.overencoding:OverEncodingConfig",
    "pkm": "tngram.memory.product_key:ProductKeyConfig",
    "stem": "tngram.memory.stem:StemConfig",
    "ple": "tngram.memory.per_layer_embedding:PerLayerEmbeddingConfig",
}
_registered: dict[str, type] = {}


def register_memory(config_cls: type) -> type:
    """Make a MemoryConfig subclass available by its `kind` (recipes, --set model.memory.kind,
    config.json). Usable as a class decorator."""
    from tngram.memory.base import MemoryConfig

    if not (
        isinstance(config_cls, type) and issubclass(config_cls, MemoryConfig) and config_cls.kind
    ):
        raise TngramError(
            f"register_memory expects a MemoryConfig subclass with a kind, got {config_cls!r}"
        )
    _registered[config_cls.kind] = config_cls
    return config_cls


def memory_config_classes() -> dict[str, type]:
    """{kind: config class} of every registered memory."""
    import importlib

    out = {}
    for kind, target in MEMORY_KINDS.items():
        module, _, name = target.partition(":")
        out[kind] = getattr(importlib.import_module(module), name)
    return {**out, **_registered}


def memory_config_to_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    return {"kind": cfg.kind, **asdict(cfg)}


def migrate_memory_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A memory config dict in today's spelling: fields its kind handed to another kind
    (`moved_fields`) make it that kind, unless each is at that kind's default (then they are
    dropped: the config is its own kind's). Other dicts are returned as they are."""
    classes, kind = memory_config_classes(), d.get("kind")
    cls: Any = classes.get(kind) if isinstance(kind, str) else None
    moved = {k: cls.moved_fields[k] for k in d if k in cls.moved_fields} if cls else {}
    if not moved:
        return d
    if len(set(moved.values())) > 1:
        raise TngramError(f"memory fields {sorted(moved)} belong to different kinds: set its kind")
    target = next(iter(moved.values()))
    default = {f.name: f.default for f in fields(classes[target])}
    if all((tuple(d[k]) if isinstance(d[k], list) else d[k]) == default[k] for k in moved):
        return {k: v for k, v in d.items() if k not in moved}
    return {**d, "kind": target}


def memory_config_from_dict(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    d = dict(migrate_memory_dict(d))
    kind, classes = d.pop("kind", None), memory_config_classes()
    if kind not in classes:
        raise TngramError(f"memory.kind must be one of {sorted(classes)}, got {kind!r}")
    cls = classes[kind]
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - valid)
    if unknown:
        raise TngramError(f"unknown {kind} memory field(s) {unknown}; valid: {sorted(valid)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def memory_dict_now(d: dict[str, Any]) -> dict[str, Any]:
    """A saved memory config dict as today's code writes it (today's kind, every field), for
    comparing configs saved at different times; `d` itself when it does not load."""
    try:
        return json.loads(json.dumps(memory_config_to_dict(memory_config_from_dict(d))))
    except (TngramError, TypeError):
        return d


def memory_config_as(cfg: Any, kind: str) -> Any:
    """`cfg` as memory kind `kind`: a kind whose config class extends cfg's (or the reverse, e.g.
    tngram and tngram-variant) keeps the fields they share; any other kind starts from its
    defaults."""
    cls = memory_config_classes()[kind]
    if cfg is None or cfg.kind == kind:
        return cfg if cfg is not None else cls()
    if not (isinstance(cfg, cls) or issubclass(cls, type(cfg))):
        return cls()
    names = {f.name for f in fields(cls)}
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in names})


def with_memory_fields(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace(cfg, **changes), where a field cfg's kind handed to another kind
    (`moved_fields`, e.g. TN-gram's order_combine) first makes cfg that kind."""
    moved = [cfg.moved_fields[k] for k in changes if k in cfg.moved_fields]
    return replace(memory_config_as(cfg, moved[0]) if moved else cfg, **changes)
