"""Self-contained run folders: the tokenizer and the dataset's manifest live inside the run.

At the start of training the main process writes

    RUN/tokenizer.model     a copy of the dataset's SentencePiece model (sampling and CORE need
                            nothing else)
    RUN/dataset.json        where the dataset was, relative to RUN and absolute, and a copy of
                            its manifest.json (fingerprint, shards, tokenizer hash)

so `tngram sample RUN` works after RUN is moved or copied to another machine, and `tngram eval
bpb RUN` finds the dataset again by its relative path, its absolute path, or `--data DIR`. A
dataset found by a fallback path must have the recorded fingerprint (a different dataset would
give a different val_bpb without saying so); `--data` is taken as given, with a note if the
fingerprint differs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError, atomic_write_json, print0

RUN_TOKENIZER = "tokenizer.model"
RUN_DATASET = "dataset.json"


def record_dataset(run_dir: str | os.PathLike, info: Any) -> None:
    """Copy `info`'s tokenizer into RUN and write RUN/dataset.json (info: data.build.DatasetInfo)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = run_dir / RUN_TOKENIZER
    if not tok.is_file() or tok.read_bytes() != Path(info.tokenizer_path).read_bytes():
        tmp = run_dir / f".{RUN_TOKENIZER}.tmp"
        shutil.copyfile(info.tokenizer_path, tmp)
        os.replace(tmp, tok)
    data_dir = Path(info.dir).resolve()
    atomic_write_json(run_dir / RUN_DATASET, {
        "relative_dir": os.path.relpath(data_dir, run_dir.resolve()),
        "absolute_dir": str(data_dir),
        "fingerprint": info.manifest.get("fingerprint"),
        "manifest": info.manifest,
    })


def read_dataset_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(run_dir) / RUN_DATASET
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TngramError(f"{path}: not valid JSON ({e})") from None


def run_tokenizer_path(run_dir: str | os.PathLike, cfg: dict[str, Any],
                       override: str | os.PathLike | None = None) -> Path:
    """The tokenizer of a run: `override`, else RUN/tokenizer.model, else its dataset's (older runs)."""
    if override is not None:
        p = Path(override).expanduser()
        if not p.is_file():
            raise MissingFileError(f"--tokenizer {p}: file not found")
        return p
    own = Path(run_dir) / RUN_TOKENIZER
    if own.is_file():
        return own
    return run_dataset(run_dir, cfg).tokenizer_path


def run_dataset(run_dir: str | os.PathLike, cfg: dict[str, Any],
                override: str | os.PathLike | None = None) -> Any:
    """The run's dataset (data.build.DatasetInfo): `override`, else the first of config data.dir,
    RUN/dataset.json's relative then absolute path, the default corpus, that exists and has the
    recorded fingerprint. TngramError listing what was tried when none does."""
    from tngram.data.build import default_data_dir, open_dataset

    run_dir = Path(run_dir)
    record = read_dataset_record(run_dir) or {}
    want = record.get("fingerprint")
    if override is not None:
        info = open_dataset(override)
        if want and info.manifest.get("fingerprint") != want:
            print0(f"tngram: note: {info.dir} is not the dataset {run_dir} was trained on "
                   f"(fingerprint {str(info.manifest.get('fingerprint'))[:12]} vs {want[:12]})")
        return info
    tried: list[str] = []
    candidates: list[Path] = []
    cfg_dir = (cfg.get("data") or {}).get("dir")
    if cfg_dir:
        candidates.append(Path(cfg_dir).expanduser())
    if record.get("relative_dir"):
        candidates.append(Path(os.path.normpath(run_dir / record["relative_dir"])))
    if record.get("absolute_dir"):
        candidates.append(Path(record["absolute_dir"]))
    if not cfg_dir:
        candidates.append(default_data_dir(int(cfg["model"]["vocab_size"])))
    for d in candidates:
        if not (d / "manifest.json").is_file():
            tried.append(f"{d} (missing)")
            continue
        info = open_dataset(d)
        if want and info.manifest.get("fingerprint") != want:
            tried.append(f"{d} (a different dataset: fingerprint differs)")
            continue
        return info
    raise TngramError(f"cannot find the dataset of run {run_dir}; tried " + ", ".join(tried)
                      + "; pass --data DIR")
