"""An exported `tngram_gpt` folder read back (docs/RELIABILITY.md, "Files read back").

A folder may come from a hub or have been edited, so `TngramGPTForCausalLM.from_pretrained`
checks, before a model is built:

- config.json's `gpt` field by field like a run's model section (types, ranges, memory layers
  distinct block indices, the memory's own rules), `cp_ranks` ints in [1, the memory's cp_rank],
  the token ids (bos/eos/pad) inside the vocabulary;
- its `gpt_digest` (sha256 of `gpt` and `cp_ranks`, written by export): an edit that changes
  no weight shape but changes what the model computes (memory.seed and the hash constants it
  makes, pad_id, memory_layers, rope_base, ...) is refused;
- a memory's `tokenizer_path` (Engram's compression): a plain file name inside the folder, never
  a path outside it (a downloaded folder must not make the loader open other files);

and after the weights are read: none missing, unexpected or of another shape; last, a folder
without its `gpt_digest` is refused (`require_digest`).
Every failure is one BadRecordError naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from tngram.readback import BadRecordError, plain_name
from tngram.train.saved import model_config_from_saved

# from_pretrained's arguments that say where a hub file comes from (passed on to cached_file)
HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "proxies",
)


def gpt_digest(gpt: Any, cp_ranks: Any) -> str:
    """sha256 of the model dict and the CP ranks (canonical JSON): what the weights were
    trained with."""
    text = json.dumps({"gpt": gpt, "cp_ranks": cp_ranks}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_folder_config(config: Any, where: str) -> Any:
    """Check an exported folder's TngramGPTConfig (see the module doc); its GPTConfig."""
    gpt = getattr(config, "gpt", None)
    m = model_config_from_saved(gpt, where, prefix="gpt.")
    digest = getattr(config, "gpt_digest", None)
    ranks = getattr(config, "cp_ranks", None)
    if ranks is not None:
        top = getattr(m.memory, "cp_rank", None)
        if (
            not isinstance(ranks, list)
            or not ranks
            or not all(_is_int(r) and 1 <= r <= (top or 0) for r in ranks)
        ):
            raise BadRecordError(
                f"{where}: field cp_ranks must be a list of ints in [1, {top}] (the memory's "
                f"cp_rank), got {ranks!r:.80}"
            )
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, k, None)
        if v is not None and not (_is_int(v) and 0 <= v < m.vocab_size):
            raise BadRecordError(
                f"{where}: field {k} must be null or a token id in [0, {m.vocab_size}), got {v!r}"
            )
    # the transformers-side fields export derives from gpt (TngramGPTConfig.from_gpt_config):
    # tools read them (generation's length, lm-eval's width), so they must say what gpt says
    derived = {
        "vocab_size": ("vocab_size", m.vocab_size),
        "hidden_size": ("n_embd", m.n_embd),
        "num_hidden_layers": ("n_layer", m.n_layer),
        "num_attention_heads": ("n_head", m.n_head),
        "max_position_embeddings": ("sequence_len", m.sequence_len),
    }
    for k, (field, want) in derived.items():
        if getattr(config, k, want) != want:
            raise BadRecordError(
                f"{where}: field {k} {getattr(config, k)!r:.40} differs from gpt.{field} {want}"
            )
    if digest is not None and digest != gpt_digest(gpt, ranks):
        raise BadRecordError(
            f"{where}: fields gpt / cp_ranks were edited after export (they do not match "
            f"gpt_digest): the weights were trained with other settings (e.g. memory.seed, "
            f"pad_id, memory_layers); re-export the run instead"
        )
    return m


def require_digest(config: Any, where: str) -> None:
    """After every other check: a folder without gpt_digest is refused (with the digest gone, an
    edit that keeps every shape, e.g. rope_base, would load with other logits)."""
    if getattr(config, "gpt_digest", None) is None:
        raise BadRecordError(
            f"{where}: field gpt_digest is missing: the config was edited, or exported before "
            "tngram wrote digests (if you trust the folder, set it to "
            "tngram.hf.gpt_folder.gpt_digest(gpt, cp_ranks))"
        )


def pin_tokenizer_path(config: Any, source: Any, where: str, kwargs: dict) -> str | None:
    """`pin_memory_tokenizer` for an exported tngram_gpt folder's config.gpt.memory."""
    mem = (getattr(config, "gpt", None) or {}).get("memory")
    return pin_memory_tokenizer(mem, source, where, kwargs, "gpt.memory")


def pin_memory_tokenizer(mem: Any, source: Any, where: str, kwargs: dict, field: str) -> str | None:
    """A memory dict's tokenizer_path read from a folder (`field`: where it sits in config.json):
    a plain file name of a regular file inside the folder (a local folder: no link; a hub repo:
    fetched by transformers' cached_file). Rewrites the dict's tokenizer_path to that file's
    path for building; returns the name as saved (to put back after loading), or None when the
    memory names no tokenizer."""
    name = mem.get("tokenizer_path") if isinstance(mem, dict) else None
    if name is None:
        return None
    assert isinstance(mem, dict)
    plain_name(name, where, f"field {field}.tokenizer_path")
    folder = Path(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None
    if folder is not None and folder.is_dir():
        from tngram.safefs import check_regular

        path = folder / name
        try:
            check_regular(path, folder)
        except (OSError, ValueError) as e:
            raise BadRecordError(
                f"{where}: field {field}.tokenizer_path {name!r} is not a regular file "
                f"inside the folder ({str(e).splitlines()[0][:100]})"
            ) from None
        mem["tokenizer_path"] = str(path)
        return name
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        got = cached_file(source, name, **hub)
    except (OSError, ValueError) as e:
        raise BadRecordError(
            f"{where}: field {field}.tokenizer_path {name!r}: cannot fetch it from {source} "
            f"({str(e).splitlines()[0][:100]})"
        ) from None
    if got is None:
        raise BadRecordError(f"{where}: field {field}.tokenizer_path {name!r} is not there")
    mem["tokenizer_path"] = got
    return name


def check_loaded_weights(info: dict, where: str) -> None:
    """transformers' loading info: every weight present, none unexpected, none of another shape
    (from_pretrained would otherwise leave the missing ones uninitialised)."""
    bad = [
        (k, list(info.get(k) or []))
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if info.get(k)
    ]
    if bad:
        what = "; ".join(f"{k.replace('_', ' ')} {v[:4]}" for k, v in bad)
        raise BadRecordError(
            f"{where}: the weights do not match config.json ({what}); the config was edited "
            f"(e.g. gpt.memory_layers, cp_ranks) or the weights come from another model"
        )


WEIGHTS_DIGEST = "weights_sha256"  # config.json: {weights file: sha256 of its payload}


def record_weights_digest(folder: str | os.PathLike) -> None:
    """After save_pretrained wrote `folder`: config.json records the payload sha256 of every
    safetensors file in it (what `verify_weights_digest` checks before loading)."""
    from tngram.common import atomic_write_json
    from tngram.readback import load_json
    from tngram.readback.tensors import payload_digest

    folder = Path(folder)
    digests = {f.name: payload_digest(f, folder)[1] for f in sorted(folder.glob("*.safetensors"))}
    config = load_json(folder / "config.json", folder)
    config[WEIGHTS_DIGEST] = digests
    atomic_write_json(folder / "config.json", config)


def verify_weights_digest(config: Any, source: Any, where: str, kwargs: dict) -> None:
    """Before transformers reads the weights: each safetensors file is the one export wrote (the
    payload sha256 config.json records: a random payload under a valid header, or another
    model's weights of the same shapes, is refused), read without links, its header checked
    against its size; a local folder holds no weights file the digest does not list."""
    from tngram.readback.tensors import payload_digest

    digests = getattr(config, WEIGHTS_DIGEST, None)
    if digests is None:  # saved by an older tngram: shapes and finiteness are still checked
        warnings.warn(
            f"{where}: no {WEIGHTS_DIGEST} in config.json (saved by an older tngram): its "
            "weights are checked for shape and finiteness only; save_pretrained it again to "
            "record their digest",
            stacklevel=3,
        )
        return
    if not isinstance(digests, dict) or not digests:
        raise BadRecordError(f"{where}: field {WEIGHTS_DIGEST} must map weights files to sha256")
    folder = Path(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else Path()
    local = isinstance(source, (str, os.PathLike)) and folder.is_dir()
    if local:
        extra = sorted({f.name for f in folder.glob("*.safetensors")} - set(digests))
        if extra:
            raise BadRecordError(f"{where}: field {WEIGHTS_DIGEST} does not list {extra[:3]}")
    for name, want in digests.items():
        plain_name(name, where, f"field {WEIGHTS_DIGEST} key")
        if local:
            path = folder / name
        else:
            from transformers.utils import cached_file

            got = cached_file(source, name, **{k: kwargs[k] for k in HUB_KWARGS if k in kwargs})
            if got is None:
                raise BadRecordError(f"{where}: field {WEIGHTS_DIGEST} lists {name}, not there")
            path = Path(got)
        if payload_digest(path, path.parent)[1] != want:
            raise BadRecordError(
                f"{path}: the payload does not match its sha256 in config.json "
                f"{WEIGHTS_DIGEST} (corrupt, or replaced after export)"
            )


MEMORY_TOKENIZER = "memory_tokenizer.model"  # an exported folder's copy of Engram's tokenizer


def memory_tokenizer_for_export(hf: Any) -> Path | None:
    """Before saving `hf` (a TngramGPTForCausalLM) as a folder: a memory that reads a tokenizer
    (Engram's compression) gets it as MEMORY_TOKENIZER inside the folder; config.gpt names that
    file (its digest updated). Returns the file to copy in, or None."""
    mem = (hf.config.gpt or {}).get("memory")
    if not isinstance(mem, dict) or mem.get("tokenizer_path") is None:
        return None
    src = mem["tokenizer_path"]
    mem["tokenizer_path"] = MEMORY_TOKENIZER
    hf.config.gpt_digest = gpt_digest(hf.config.gpt, hf.config.cp_ranks)
    return Path(src)
