"""The memory spec of a model with a memory (`model.config.tngram_memory`) and its checks.

A spec is {"memory": memory config dict, "layers": decoder-layer ids, "layers_attr": dotted
path of the decoder-layer list, "memory_seed": int, "vocab_size": int}. `check_spec` checks it
field by field against a base model before anything is built; one TngramError names the field.

add_memory also writes `digest`: {spec key: sha256 of its value} (`spec_digest`). Loading a saved
memory (from_pretrained, load_memory) checks it after the weights (`check_digest`), so an edit
of any key that passes the field checks but changes what the weights compute (a TN-gram
`memory.pad_id`, Engram's `memory.seed`, `memory_seed`, the order of `layers`, ...) is refused
with one line naming the file and the key. The memory's `tokenizer_path` is left out of its
digest: it is a file name the folder resolves (tngram.hf.gpt_folder.pin_memory_tokenizer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from tngram.common import TngramError
from tngram.hf.classes import CONFIG_KEY, TngramConfigMixin
from tngram.hf.families import find_decoder_layers
from tngram.hf.placement import check_memory_config, check_table_device
from tngram.memory import memory_config_classes, memory_config_from_dict, migrate_memory_dict

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SPEC_KEYS = ("memory", "layers", "layers_attr", "memory_seed", "vocab_size")
# keys a spec may carry besides SPEC_KEYS: table_device (tngram.hf.placement: where the
# tables live, not what they compute)
OPTIONAL_KEYS = ("table_device",)
DIGEST_KEY = "digest"  # {spec key: sha256 of its value}, written by add_memory
_NOT_DIGESTED = ("tokenizer_path",)  # memory fields naming a file, not a number


def spec_digest(spec: dict[str, Any]) -> dict[str, str]:
    """{key: sha256 hex of the key's value as sorted JSON} for every key of SPEC_KEYS in spec
    (the memory's _NOT_DIGESTED fields left out)."""
    out = {}
    for key in SPEC_KEYS:
        if key not in spec:
            continue
        value = spec[key]
        if key == "memory" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in _NOT_DIGESTED}
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        out[key] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return out


def check_digest(spec: dict[str, Any], where: str) -> None:
    """One TngramError naming `where`.KEY unless spec's digest is the one add_memory wrote for
    these values: a saved memory whose spec was edited (or whose digest is gone) never loads."""
    saved = spec.get(DIGEST_KEY)
    if not isinstance(saved, dict) or not all(isinstance(v, str) for v in saved.values()):
        raise TngramError(
            f"{where}.{DIGEST_KEY} must be the object of sha256 digests add_memory writes, got "
            f"{saved!r}: the spec was edited, or saved before tngram wrote digests (if you "
            "trust the folder, add tngram.hf.spec.spec_digest(spec) as its digest)"
        )
    for key, value in spec_digest(spec).items():
        if saved.get(key) != value:
            raise TngramError(
                f"{where}.{key} was edited after saving (its sha256 is not "
                f"{DIGEST_KEY}.{key}): the weights were trained with the saved value; "
                "refusing a memory that would compute other numbers"
            )


def hidden_size_of(config: Any) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            return v
    raise TngramError(
        f"cannot find the hidden size in {type(config).__name__} (hidden_size / n_embd / d_model)"
    )


def base_model(model: nn.Module) -> nn.Module:
    if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise TngramError(
            f"add_memory expects a transformers PreTrainedModel, got {type(model).__name__}"
        )
    return getattr(model, "base_model", model)


def embedding_rows(base: nn.Module) -> int:
    emb = cast("PreTrainedModel", base).get_input_embeddings()  # a transformers base model
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        raise TngramError(f"the input embedding of {type(base).__name__} is not an nn.Embedding")
    return rows


def family_of(config: Any) -> str | None:
    cls = type(config)
    if issubclass(cls, TngramConfigMixin):
        return cls.base_model_type
    return getattr(config, "model_type", None)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_ids(layers: Any, n: int, what: str) -> tuple[int, ...]:
    """Distinct decoder-layer indices in [0, n) from ints in [-n, n); one error otherwise."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, list, tuple)):
        raise TngramError(f"{what} must be a list of decoder-layer indices (ints), got {layers!r}")
    if not all(is_int(i) for i in layers):
        raise TngramError(f"{what} must hold ints, got {list(layers)!r}")
    ids = tuple(i + n if i < 0 else i for i in layers)
    if not ids or any(not 0 <= i < n for i in ids) or len(set(ids)) != len(ids):
        raise TngramError(
            f"{what} {list(layers)} must be distinct decoder-layer indices in "
            f"[-{n}, {n}) (the model has {n} decoder layers)"
        )
    return ids


def _check_memory_fields(memory: Any, where: str) -> Any:
    """The memory config of a spec's `memory` dict; JSON types checked against the fields'."""
    if not isinstance(memory, dict):
        raise TngramError(f"{where}.memory must be an object, got {type(memory).__name__}")
    classes = memory_config_classes()
    kind = memory.get("kind")
    if kind not in classes:
        raise TngramError(f"{where}.memory.kind must be one of {sorted(classes)}, got {kind!r}")
    try:
        memory = migrate_memory_dict(memory)  # e.g. tngram with a variant field: tngram-variant
    except TngramError as e:
        raise TngramError(f"{where}.memory: {e}") from None
    for f in dataclasses.fields(classes[memory["kind"]]):
        if f.name not in memory:
            continue
        v, default = memory[f.name], f.default
        if default is dataclasses.MISSING or default is None:
            continue
        key = f"{where}.memory.{f.name}"
        if isinstance(default, bool):
            ok = isinstance(v, bool)
        elif isinstance(default, int):
            ok = is_int(v)
        elif isinstance(default, float):
            ok = (is_int(v) or isinstance(v, float)) and math.isfinite(v)
        elif isinstance(default, str):
            ok = isinstance(v, str)
        elif isinstance(default, tuple):
            ok = isinstance(v, (list, tuple)) and all(is_int(x) for x in v)
        else:
            ok = True
        if not ok:
            tname = type(default).__name__
            raise TngramError(
                f"{key} must be {'an' if tname[0] in 'aeiou' else 'a'} {tname} "
                f"like its default {default!r}, got {v!r}"
            )
    try:
        return memory_config_from_dict(memory)
    except TngramError as e:
        raise TngramError(f"{where}.memory: {e}") from None


def check_spec(
    spec: Any, base: nn.Module, where: str = "config.tngram_memory"
) -> tuple[Any, tuple[int, ...], nn.ModuleList]:
    """(memory config, layer ids, decoder-layer list) of a spec, or one TngramError naming the
    field (types, ranges, duplicates, the model's layer count and vocabulary)."""
    if not isinstance(spec, dict):
        raise TngramError(f"{where} must be an object, got {type(spec).__name__}")
    missing = [k for k in SPEC_KEYS if k not in spec]
    unknown = sorted(set(spec) - set(SPEC_KEYS) - set(OPTIONAL_KEYS) - {DIGEST_KEY})
    if missing or unknown:
        raise TngramError(
            f"{where} must have exactly the keys {list(SPEC_KEYS)} (and {DIGEST_KEY}); "
            f"missing {missing}, unknown {unknown}"
        )
    cfg = _check_memory_fields(spec["memory"], where)
    if spec.get("table_device") is not None:
        check_table_device(spec["table_device"], f"{where}.table_device")
        check_memory_config(cfg)
    seed, vocab, attr = spec["memory_seed"], spec["vocab_size"], spec["layers_attr"]
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise TngramError(f"{where}.memory_seed must be an int in [0, 2^63), got {seed!r}")
    if not is_int(vocab) or vocab < 1:
        raise TngramError(f"{where}.vocab_size must be a positive int, got {vocab!r}")
    if not isinstance(attr, str) or not attr:
        raise TngramError(f"{where}.layers_attr must be a dotted path (str), got {attr!r}")
    rows = embedding_rows(base)
    if rows != vocab:
        raise TngramError(
            f"vocab mismatch: {where}.vocab_size is {vocab} but the input embedding has {rows} rows"
        )
    try:
        _, layer_list = find_decoder_layers(base, family_of(base.config), attr)
    except TngramError as e:
        raise TngramError(f"{where}.layers_attr {attr!r}: {e}") from None
    if cfg.injection == "embedding":
        if spec["layers"] != []:
            raise TngramError(
                f"{where}.layers must be [] for an embedding memory "
                f"({cfg.kind}), got {spec['layers']!r}"
            )
        return cfg, (), layer_list
    ids = layer_ids(spec["layers"], len(layer_list), f"{where}.layers")
    if list(ids) != list(spec["layers"]):
        raise TngramError(f"{where}.layers must be non-negative, got {spec['layers']!r}")
    return cfg, ids, layer_list


def memory_spec(model: nn.Module) -> dict[str, Any] | None:
    """The memory spec of a model with a memory (model.config.tngram_memory), else None."""
    config = getattr(model, "config", None)
    return getattr(config, CONFIG_KEY, None) if isinstance(config, TngramConfigMixin) else None
