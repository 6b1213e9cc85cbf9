"""The memory as an adapter: saved apart from its base, loaded onto the same base elsewhere.

    save_memory(model, dir)      dir/tngram_memory.safetensors  the memory weights only (tables,
                                                                projections, gates, conv, hash
                                                                constants), keys as in the model
                                 dir/tngram_memory.json         {"format", "spec", "base"}
    load_memory(base, dir)       attaches the memory to a plain base model, refusing a base
                                 whose identity differs from the saved one
    set_trainable(model, "memory")   freezes everything but the memory
    trainable_parameters / print_trainable_parameters   counts, like peft's report
    disable_memory(model)        a context manager: the model runs as if it had no memory

The base's identity is the part of its configuration that shapes the network (`config`: the
family config's fields without those that do not change what it computes: name_or_path,
dtype, transformers version, attention implementation, output flags, the special token ids,
init range; `config_hash`: their SHA-256), its vocabulary size (the input embedding's rows) and
its model type. load_memory compares them field by field and names the first that differs;
`name_or_path` is recorded but not compared (the same base may sit at another path on another
machine).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from tngram.common import TngramError
from tngram.hf.attach import (  # noqa: F401  (set_trainable re-exported)
    TRAINABLE,
    check_constants,
    convert_to_memory_class,
    attach_from_spec,
    check_memory_name,
    memory_modules,
    memory_names,
    remove_memory,
    set_memory,
    set_trainable,
)
from tngram.hf.classes import CONFIG_KEY, MEMORY_ATTR, TngramConfigMixin, base_class
from tngram.hf.peft_compat import memory_copies, running_memory
from tngram.hf.spec import (
    base_model,
    embedding_rows,
    family_of,
    check_digest,
    check_spec,
    memory_spec,
)

WEIGHTS_FILE = "tngram_memory.safetensors"
SPEC_FILE = "tngram_memory.json"
DIGEST_KEY = "weights_sha256"  # in SPEC_FILE: sha256 of WEIGHTS_FILE's payload (its tensors)
FORMAT = 1
# config fields that do not change the network a memory was trained on (and every special
# token id: `*_token_id` / `*_token_ids`, which recipes set freely; see _network_fields)
_RUNTIME_FIELDS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "architectures",
        "model_type",
        CONFIG_KEY,
        "dtype",
        "torch_dtype",
        "_commit_hash",
        "use_cache",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "attn_implementation",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "initializer_range",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
    }
)
# the fields the first format-1 files hashed left out (their config_hash still verifies)
_LEGACY_RUNTIME_FIELDS = _RUNTIME_FIELDS - {
    "initializer_range",
    "tokenizer_class",
    "id2label",
    "label2id",
    "problem_type",
}
MAX_SPEC_BYTES = 1 << 20


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft PeftModel (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def _family_fields(config: Any) -> dict[str, Any]:
    """The family config's to_dict() (a memory config's spec and class left out)."""
    plain = copy.deepcopy(config)
    if isinstance(plain, TngramConfigMixin):
        plain.__class__ = base_class(type(plain))
        plain.__dict__.pop(CONFIG_KEY, None)
    return plain.to_dict()


def _is_token_id(key: str) -> bool:
    return key.endswith(("_token_id", "_token_ids"))


def network_fields(config: Any) -> dict[str, Any]:
    """The config fields that shape the network, as JSON values (sorted keys): the family config
    without _RUNTIME_FIELDS and the special token ids (pad / bos / eos / ...)."""
    fields = {
        k: v
        for k, v in _family_fields(config).items()
        if k not in _RUNTIME_FIELDS and not _is_token_id(k)
    }
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def _sha256_json(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_hash(config: Any) -> str:
    """SHA-256 (hex) of network_fields(config)."""
    return _sha256_json(network_fields(config))


def base_identity(model: nn.Module) -> dict[str, Any]:
    """{"name_or_path", "model_type", "config_hash", "vocab_size", "config"} of a model's base
    ("config": network_fields, which load_memory compares field by field)."""
    model = _unwrap(model)
    config = model.config
    return {
        "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "model_type": family_of(config),
        "config_hash": config_hash(config),
        "vocab_size": embedding_rows(base_model(model)),
        "config": network_fields(config),
    }


def memory_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The memory's tensors (parameters and hash constants), keyed as in model.state_dict().
    A peft ModulesToSaveWrapper around a memory contributes its trained copy."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in memory_modules(_unwrap(model)).items():
        wrapped = getattr(mod, "modules_to_save", None)
        if isinstance(wrapped, nn.ModuleDict) and len(wrapped) > 0:
            active = cast("list[str]", mod.active_adapters)  # peft ModulesToSaveWrapper's
            mod = wrapped[active[0]]
        for key, t in mod.state_dict().items():
            out[f"{name}.{key}"] = t.detach().to("cpu").contiguous().clone()
    return out


def save_memory(model: nn.Module, directory: str | Path, *, overwrite: bool = False) -> Path:
    """Write the memory of `model` (a model with add_memory, or a PeftModel around one) to
    `directory`: its weights and spec with the base's identity, nothing of the base. Each file is
    written whole under a temporary name and renamed into place; an existing file is refused
    unless overwrite=True. Refused when an in-place change reached the backbone since the memory
    was added or loaded (an optimiser step with add_memory's default trainable="all"): the files
    would not give this model back. Returns the directory."""
    from safetensors.torch import save as save_tensors

    from tngram import safefs

    inner = _unwrap(model)
    spec = memory_spec(inner)
    if spec is None:
        raise TngramError("save_memory: the model has no n-gram memory (tngram.hf.add_memory)")
    seen = getattr(base_model(inner), "_tngram_state").backbone
    changed = None if seen is None else seen.changed(inner)
    if changed is not None:
        raise TngramError(
            f"save_memory: the backbone changed since the memory was added ({changed}: trained "
            "with add_memory's default trainable='all'?), and "
            "save_memory writes the memory alone, so loading it onto the base would not give "
            "this model: save the whole model (save_pretrained), or train with "
            "trainable='memory'"
        )
    directory = Path(directory)
    for name in (WEIGHTS_FILE, SPEC_FILE):
        if (directory / name).exists() and not overwrite:
            raise TngramError(
                f"{directory / name} exists; save to a new directory or pass overwrite=True"
            )
    data = save_tensors(memory_state_dict(inner))
    payload = memoryview(data)[8 + int.from_bytes(data[:8], "little") :]
    meta = {"format": FORMAT, "spec": spec, "base": base_identity(inner)}
    meta[DIGEST_KEY] = hashlib.sha256(payload).hexdigest()  # load_memory checks it
    safefs.write_bytes(directory / WEIGHTS_FILE, data, root=directory.parent)
    safefs.write_json(directory / SPEC_FILE, meta, root=directory.parent)
    return directory


def read_memory_meta(directory: str | Path) -> dict[str, Any]:
    """The checked contents of directory/tngram_memory.json (tngram.readback: no link, size,
    strict JSON, depth; then its fields), one TngramError naming the field."""
    from tngram.common import MissingFileError
    from tngram.readback import load_json

    path = Path(directory) / SPEC_FILE
    try:
        meta = load_json(path, directory, limit=MAX_SPEC_BYTES, want_dict=False)
    except MissingFileError:
        raise TngramError(f"{path}: not found (save_memory writes it)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise TngramError(f"{path}: format must be {FORMAT}, got {got!r}")
    base = meta.get("base")
    keys = ("name_or_path", "model_type", "config_hash", "vocab_size")
    if not isinstance(base, dict) or any(k not in base for k in keys):
        raise TngramError(f"{path}: base must be an object with the keys {list(keys)}")
    if not isinstance(base.get("config", {}), dict):
        raise TngramError(f"{path}: base.config must be an object (the base's config fields)")
    if not isinstance(meta.get("spec"), dict):
        raise TngramError(f"{path}: spec must be an object (the memory spec)")
    digest = meta.get(DIGEST_KEY)
    if digest is None:  # saved before the digest was recorded: shapes and finiteness still hold
        warnings.warn(
            f"{path}: no {DIGEST_KEY} (saved by an older tngram): its weights are checked for "
            "shape and finiteness only; save_memory again to record their digest",
            stacklevel=3,
        )
    elif not isinstance(digest, str) or len(digest) != 64:
        raise TngramError(
            f"{path}: field {DIGEST_KEY} must be the sha256 of {WEIGHTS_FILE}'s payload, which "
            f"save_memory writes; got {digest!r:.40}"
        )
    return meta


def check_base(
    base: nn.Module, saved: dict[str, Any], where: str, ignore: Iterable[str] = ()
) -> None:
    """One TngramError, naming the field, if `base` is not the base the memory was saved from:
    its model type, vocabulary size and network_fields (but the fields in `ignore`). A file
    without base.config (written before it was recorded) is checked by its config_hash."""
    have = base_identity(base)
    ignore = set(ignore)
    differ = [k for k in ("model_type", "vocab_size") if have[k] != saved[k]]
    if "config" in saved:
        mine, theirs = have["config"], saved["config"]
        differ += [
            f"config.{k}"
            for k in sorted(set(mine) | set(theirs))
            if k not in ignore and mine.get(k) != theirs.get(k)
        ]
    elif have["config_hash"] != saved["config_hash"]:
        legacy = {
            k: v for k, v in _family_fields(_unwrap(base).config).items()
            if k not in _LEGACY_RUNTIME_FIELDS
        }
        if _sha256_json(legacy) != saved["config_hash"]:
            differ.append("config_hash")  # no field record in this file to name the field
    if not differ:
        return
    key = differ[0]
    if key == "config_hash":
        there, here = saved[key], have[key]
        hint = "(this file records no config fields: save the memory again to have them named)"
    elif key.startswith("config."):
        there, here = saved["config"].get(key[7:]), have["config"].get(key[7:])
        hint = f"(if it does not change what the memory learned: ignore_base_fields=[{key[7:]!r}])"
    else:
        there, here = saved[key], have[key]
        hint = ""
    more = f" and {len(differ) - 1} more field(s)" if len(differ) > 1 else ""
    raise TngramError(
        f"{where}: the memory was saved from a different base ({saved['name_or_path']!r}): "
        f"{key} is {there!r} there, {here!r} here{more}; load it onto the base it was trained "
        f"on {hint}".rstrip()
    )


def load_memory(
    model: nn.Module,
    directory: str | Path,
    *,
    trainable: str = "all",
    ignore_base_fields: Iterable[str] = (),
    name: str = "default",
) -> nn.Module:
    """Attach the memory saved in `directory` (save_memory) to `model`, a plain transformers
    model of the same base; returns the model. Refused with one line: a different base (model
    type, vocabulary size, or a config field that shapes the network, named; special token ids
    such as pad / eos never count, and `ignore_base_fields` lists config fields you vouch for),
    a name the model's memories have, weights that do not match the spec. A memory running under
    another name is set aside (set_memory). On refusal the model is left as it was."""
    from tngram.hf.gpt_folder import pin_memory_tokenizer
    from tngram.readback.tensors import read_safetensors

    directory = Path(directory)
    where = str(directory / SPEC_FILE)
    meta = read_memory_meta(directory)
    try:
        check_memory_name(model, name)
    except TngramError as e:
        raise TngramError(f"{where}: {e}") from None
    if isinstance(ignore_base_fields, str):
        raise TngramError(
            f"ignore_base_fields must be a list of config field names, got {ignore_base_fields!r}"
        )
    check_base(model, meta["base"], where, ignore_base_fields)
    spec = meta["spec"]
    check_spec(spec, base_model(model), where=f"{where} spec")
    # a tokenizer the memory reads (Engram's compression): a plain name inside the folder
    saved_tok = pin_memory_tokenizer(spec["memory"], directory, where, {}, "spec.memory")
    weights = directory / WEIGHTS_FILE
    before = memory_names(model)["active"]
    set_memory(model, None)
    convert_to_memory_class(model, spec)
    try:
        attach_from_spec(model, spec, name)
        if saved_tok is not None:
            spec["memory"]["tokenizer_path"] = saved_tok
        want = {k: tuple(t.shape) for k, t in memory_state_dict(model).items()}
        tensors, _ = read_safetensors(  # no link, size, header, names, shapes, digest, finite
            weights,
            directory,
            limit=(1 << 20) + 8 * sum(math.prod(s) for s in want.values()),
            shapes=want,
            digest=meta.get(DIGEST_KEY),
        )
        model.load_state_dict(tensors, strict=False)
        check_constants(model, str(weights))
        check_digest(spec, f"{where} spec")
    except BaseException:
        remove_memory(model)
        set_memory(model, before)
        raise
    set_trainable(model, trainable)
    return model


def _idle_copies(model: nn.Module) -> set[int]:
    """ids of the parameters a forward does not use: in each peft wrapper that keeps copies of a
    module (modules_to_save), the copies other than the one that runs (its original, the other
    adapters' copies)."""
    idle: set[int] = set()
    for mod in model.modules():
        copies = memory_copies(mod)
        if len(copies) > 1:
            used = {id(p) for p in running_memory(mod).parameters()}
            for m in copies:
                idle |= {id(p) for p in m.parameters() if id(p) not in used}
    return idle


def trainable_parameters(model: nn.Module) -> dict[str, int]:
    """{"trainable", "all", "memory", "memory_trainable"}: parameter counts of the network that
    runs, each parameter once (shared ones once; of a module peft keeps copies of, only the copy
    a forward uses: the memory of a PeftModel is counted once, not with its frozen original)."""
    counts = dict.fromkeys(("trainable", "all", "memory", "memory_trainable"), 0)
    seen: set[int] = _idle_copies(model)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        in_memory = MEMORY_ATTR in name.split(".")
        counts["all"] += p.numel()
        counts["trainable"] += p.numel() if p.requires_grad else 0
        counts["memory"] += p.numel() if in_memory else 0
        counts["memory_trainable"] += p.numel() if in_memory and p.requires_grad else 0
    return counts


def print_trainable_parameters(model: nn.Module) -> str:
    """Print (and return) one line like peft's: trainable, memory and all parameters."""
    c = trainable_parameters(model)
    line = (
        f"trainable params: {c['trainable']:,} || memory params: {c['memory']:,} "
        f"(trainable {c['memory_trainable']:,}) || all params: {c['all']:,} || "
        f"trainable%: {100 * c['trainable'] / max(c['all'], 1):.4f}"
    )
    print(line)
    return line


@contextlib.contextmanager
def disable_memory(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes as if it had no memory (its hooks pass every call
    through). A cache filled inside the block holds no memory state, so the memory refuses it
    afterwards; start a new cache."""
    state = getattr(base_model(_unwrap(model)), "_tngram_state", None)
    if state is None:
        raise TngramError("disable_memory: the model has no n-gram memory (tngram.hf.add_memory)")
    before = state.disabled
    state.disabled = True
    try:
        yield model
    finally:
        state.disabled = before
