"""Memory modules: TN-gram (ours), Engram (DeepSeek's reference) and Over-Encoding.

Each config has `kind`, `injection` ("block": output added to a block's residual stream;
"embedding": replaces the input embedding), `build(d_model, vocab_size, layer_id, layer_ids)`
and `param_count(...)`. Modules never import the model.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from tngram.common import TngramError


def memory_config_classes() -> dict[str, type]:
    from tngram.memory.engram import EngramConfig
    from tngram.memory.overencoding import OverEncodingConfig
    from tngram.memory.tngram import TNGramConfig

    return {"tngram": TNGramConfig, "engram": EngramConfig, "oe": OverEncodingConfig}


def memory_config_to_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    return {"kind": cfg.kind, **asdict(cfg)}


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
