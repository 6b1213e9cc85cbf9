"""Memory modules: TN-gram (ours), Engram (DeepSeek's reference) and Over-Encoding.

Every memory follows the contract of `tngram.memory.base` (a `MemoryConfig` subclass with
`kind`, `injection`, checks, keyword-only `build(*, d_model, vocab_size, layer_id, layer_ids)`
and `param_count(...)`; a module with `table_parameters()` / `control_parameters()`) and is
registered here by kind. Modules never import the model.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from tngram.common import TngramError


# kind -> "module:ConfigClass" of the built-in memories, imported on first use (so that
# `import tngram.memory` stays light); register_memory adds more at run time.
MEMORY_KINDS: dict[str, str] = {
    "tngram": "tngram.memory.tngram:TNGramConfig",
    "tngram-hashed": "tngram.memory.tngram_hashed:TNGramHashedConfig",
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
    d = {"kind": cfg.kind, **asdict(cfg)}
    # fields added after runs were saved (e.g. TN-gram's variant switches) are written only when
    # set, so the config.json of every existing setting (resume, run reuse) stays unchanged
    for f in fields(cfg):
        if f.name in cfg.omit_at_default and d[f.name] == f.default:
            del d[f.name]
    return d


def memory_config_from_dict(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    d = dict(d)
    kind = d.pop("kind", None)
    classes = memory_config_classes()
    if kind not in classes:
        raise TngramError(f"memory.kind must be one of {sorted(classes)}, got {kind!r}")
    cls = classes[kind]
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - valid)
    if unknown:
        raise TngramError(f"unknown {kind} memory field(s) {unknown}; valid: {sorted(valid)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
