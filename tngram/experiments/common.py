"""Shared pieces of the experiment commands: presets, data resolution, config edits."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import TngramError
from tngram.memory import with_memory_fields
from tngram.train.recipes import get_recipe
from tngram.train.config import TrainConfig

# preset -> (recipe prefix, default processes)
PRESETS = {"cpu": "mini", "paper-l9": "paper-l9", "paper-l18": "paper-l18"}
SCALES = {"cpu": "mini", "paper": "paper-l9"}


def resolve_data(data: str | None, vocab_size: int = 1024) -> tuple[str, int]:
    """(dataset dir, its vocab size): --data DIR, else the default offline corpus (built if
    missing)."""
    from tngram.data.build import ensure_default_data, open_dataset

    path = Path(data) if data else ensure_default_data(vocab_size=vocab_size)
    info = open_dataset(path)
    return str(info.dir), int(info.vocab_size)


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


def with_data(cfg: TrainConfig, data_dir: str, vocab_size: int) -> TrainConfig:
    return replace(
        cfg, data=replace(cfg.data, dir=data_dir), model=replace(cfg.model, vocab_size=vocab_size)
    )


def with_seed(cfg: TrainConfig, seed_index: int) -> TrainConfig:
    return replace(cfg, run=replace(cfg.run, seed=cfg.run.seed + seed_index))


def with_memory(cfg: TrainConfig, **fields: Any) -> TrainConfig:
    if cfg.model.memory is None:
        raise TngramError(f"recipe {cfg.name} has no memory to change")
    memory = with_memory_fields(cfg.model.memory, **fields)  # tngram's variant fields: its kind
    return replace(cfg, model=replace(cfg.model, memory=memory))


def with_steps(cfg: TrainConfig, steps: int | None) -> TrainConfig:
    from tngram.train.config import with_schedule_steps

    return with_schedule_steps(cfg, steps)


def base_recipe(prefix: str, method: str) -> TrainConfig:
    return get_recipe(f"{prefix}-{method}")


def default_nproc(preset: str) -> int:
    if preset == "cpu":
        return 1
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:  # pragma: no cover
        return 1
