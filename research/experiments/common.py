"""The experiments' shared pieces beyond those of `tngram compare` (tngram.experiments.common,
re-exported here): the scales, corpora named by --corpora, and memory edits of a recipe."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import TngramError
from tngram.experiments.common import (
    PRESETS,
    base_recipe,
    default_nproc,
    resolve_data,
    with_data,
    with_seed,
    with_steps,
)
from tngram.memory import with_memory_fields
from tngram.train.config import TrainConfig

__all__ = [
    "EVIDENCE_CORPORA",
    "PRESETS",
    "SCALES",
    "base_recipe",
    "check_corpora",
    "corpus_data",
    "corpus_name",
    "default_nproc",
    "is_builtin_corpus",
    "read_tuning_file",
    "resolve_data",
    "with_data",
    "with_memory",
    "with_seed",
    "with_steps",
]

SCALES = {"cpu": "mini", "paper": "paper-l9"}
# one corpus of each kind: what `python -m research experiment corpora` runs by default
# (code-large is code again, larger)
EVIDENCE_CORPORA: tuple[str, ...] = ("default", "literature", "code")


def read_tuning_file(path: str | os.PathLike) -> dict[str, Any]:
    """A tuning.json read back: {"best": {family: setting name or number}, "rows": [...]}; a bad
    field is one BadRecordError naming the file and the field."""
    from tngram.readback import BadRecordError, get, load_json

    where = str(path)
    d = load_json(path)
    for k, v in get(d, "best", "dict", where).items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (isinstance(v, str) or number):
            raise BadRecordError(
                f"{where}: field best.{k} must be a setting name or a finite number, got {v!r:.60}"
            )
    if "rows" in d:
        get(d, "rows", "list", where)
    return d


# a dataset folder's name becomes part of run labels, folder names and results files
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def is_builtin_corpus(corpus: str) -> bool:
    """True for a built-in corpus: "NAME" or "NAME@V" (NAME tokenised with vocabulary V), NAME a
    key of tngram.data.corpus.CORPORA."""
    from tngram.data.corpus import CORPORA

    return corpus.partition("@")[0] in CORPORA


def corpus_name(corpus: str) -> str:
    """A corpus's name in run labels, tags and results files: a built-in corpus is its own name, a
    dataset folder its folder's name."""
    return corpus if is_builtin_corpus(corpus) else _folder(corpus).name


def _folder(corpus: str) -> Path:
    # absolute, ".." resolved by name, links kept: a link names its corpus
    return Path(os.path.abspath(os.path.expanduser(corpus)))


def corpus_data(corpus: str) -> tuple[str, int]:
    """(dataset dir, vocab size) of a built-in corpus (built on first use) or of a dataset folder
    (`tngram data build --from-text TEXT --out DIR`; its absolute path, so run configs do not
    depend on the working directory)."""
    from tngram.data.build import ensure_default_data, open_dataset

    if is_builtin_corpus(corpus):
        name, _, vocab = corpus.partition("@")
        path = ensure_default_data(vocab_size=int(vocab) if vocab else 1024, corpus=name)
    else:
        path = _folder(corpus)
    info = open_dataset(path)
    return str(info.dir), int(info.vocab_size)


def check_corpora(corpora: list[str]) -> list[str]:
    """--corpora's entries, checked before any data or training work: each a built-in corpus name
    or a dataset folder (its manifest is read, nothing is built), their names distinct and made of
    letters, digits, ".", "_" and "-". TngramError naming the entry otherwise."""
    from tngram.data.corpus import CORPORA
    from tngram.data.dataset import open_dataset

    if not corpora:
        raise TngramError(
            f"--corpora: no corpus given; valid: {', '.join(CORPORA)} or a dataset folder"
        )
    seen: dict[str, str] = {}
    for c in corpora:
        if c not in CORPORA:
            if not Path(c).expanduser().is_dir():
                raise TngramError(
                    f"--corpora: {c!r} is neither a built-in corpus ({', '.join(CORPORA)}) nor a "
                    "dataset folder (`tngram data build --from-text TEXT --out DIR`)"
                )
            try:
                open_dataset(c)
            except TngramError as e:
                raise TngramError(f"--corpora: {e}") from None
        name = corpus_name(c)
        if not set(name) <= _NAME_CHARS or name.startswith((".", "-")):
            raise TngramError(
                f"--corpora: the dataset folder {c!r} needs a name of letters, digits, '.', '_' "
                "and '-' (it names the runs and results files); rename or link it"
            )
        if name in seen or (name in CORPORA and c != name):
            raise TngramError(
                f"--corpora: two corpora would be named {name!r} ({seen.get(name, name)!r} and "
                f"{c!r}); rename or link the dataset folder"
            )
        seen[name] = c
    return list(corpora)


def with_memory(cfg: TrainConfig, **fields: Any) -> TrainConfig:
    if cfg.model.memory is None:
        raise TngramError(f"recipe {cfg.name} has no memory to change")
    memory = with_memory_fields(cfg.model.memory, **fields)  # tngram's variant fields: its kind
    return replace(cfg, model=replace(cfg.model, memory=memory))
