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

`--resume` continues only on the dataset the run was trained on: when the run has checkpoints
and RUN/dataset.json records another fingerprint than the dataset found now (a rebuilt dataset,
even with the same token counts), `record_dataset` refuses with one line before step 1. The
explicit override (`tngram train --resume --accept-changed-data`, which sets
$TNGRAM_ACCEPT_CHANGED_DATA=1) continues and keeps every earlier fingerprint in dataset.json
("previous"). The run's tokenizer.model is checked against the sha256 recorded there before use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError, print0
from tngram.readback import BadRecordError, load_json
from tngram.safefs import check_regular, is_link, read_bytes, write_bytes, write_json

RUN_TOKENIZER = "tokenizer.model"
RUN_DATASET = "dataset.json"


ACCEPT_CHANGED_DATA_ENV = "TNGRAM_ACCEPT_CHANGED_DATA"


def record_dataset(
    run_dir: str | os.PathLike, info: Any, accept_changed: bool | None = None
) -> None:
    """Copy `info`'s tokenizer into RUN and write RUN/dataset.json (info: data.build.DatasetInfo).
    A run with checkpoints whose recorded fingerprint differs is refused (see the module doc)
    unless `accept_changed` (default: $TNGRAM_ACCEPT_CHANGED_DATA=1)."""
    from tngram.train.checkpoint import list_checkpoints

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if accept_changed is None:
        accept_changed = os.environ.get(ACCEPT_CHANGED_DATA_ENV, "") not in ("", "0")
    old = read_dataset_record(run_dir) if os.path.lexists(run_dir / RUN_DATASET) else None
    new_fp = info.manifest.get("fingerprint")
    previous: list[Any] = []
    if old is not None and list_checkpoints(run_dir):
        old_fp = old.get("fingerprint")
        prev = old.get("previous")
        previous = prev if isinstance(prev, list) else []
        if old_fp != new_fp:
            if not accept_changed:
                raise TngramError(
                    f"cannot resume {run_dir}: the dataset {info.dir} is not the one it was "
                    f"trained on "
                    f"(fingerprint {str(new_fp)[:12]}, {RUN_DATASET} records {str(old_fp)[:12]}); "
                    f"use the "
                    f"same dataset, or pass --accept-changed-data to continue on this one"
                )
            previous = previous + [{"fingerprint": old_fp, "absolute_dir": old.get("absolute_dir")}]
            print0(
                f"tngram: note: continuing {run_dir} on a changed dataset {info.dir} (fingerprint "
                f"{str(new_fp)[:12]}, was {str(old_fp)[:12]}; both kept in {RUN_DATASET})"
            )
    tok = run_dir / RUN_TOKENIZER
    src = read_bytes(info.tokenizer_path)
    if not os.path.lexists(tok) or is_link(tok) or read_bytes(tok, run_dir) != src:
        write_bytes(tok, src, run_dir)  # a new file renamed into place: never a link's target
    data_dir = Path(info.dir).resolve()
    record = {
        "relative_dir": os.path.relpath(data_dir, run_dir.resolve()),
        "absolute_dir": str(data_dir),
        "fingerprint": new_fp,
        "manifest": info.manifest,
    }
    if previous:
        record["previous"] = previous
    write_json(run_dir / RUN_DATASET, record, run_dir)


def read_dataset_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(run_dir) / RUN_DATASET
    if not os.path.lexists(path):
        return None
    rec = load_json(path, run_dir)
    for key in ("fingerprint", "relative_dir", "absolute_dir"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise BadRecordError(f"{path}: field {key!r} must be a string, got {rec[key]!r}")
    return rec


def check_run_tokenizer(run_dir: str | os.PathLike, path: Path) -> Path:
    """RUN/tokenizer.model must be a regular file with the sha256 RUN/dataset.json recorded for
    the dataset's tokenizer (when it records one): a swapped tokenizer is refused, naming it."""
    import hashlib

    check_regular(path, run_dir)
    rec = read_dataset_record(run_dir) or {}
    manifest = m if isinstance(m := rec.get("manifest"), dict) else {}
    tokinfo = t if isinstance(t := manifest.get("tokenizer"), dict) else {}
    want = tokinfo.get("sha256")
    if isinstance(want, str):
        got = hashlib.sha256(read_bytes(path, run_dir)).hexdigest()
        if got != want:
            raise TngramError(
                f"{path}: sha256 {got[:12]} is not the tokenizer this run was trained with "
                f"({want[:12]} in {Path(run_dir) / RUN_DATASET}); restore it, or pass "
                f"--tokenizer MODEL to use another one deliberately"
            )
    return path


def run_tokenizer_path(
    run_dir: str | os.PathLike, cfg: dict[str, Any], override: str | os.PathLike | None = None
) -> Path:
    """The tokenizer of a run: `override`, else RUN/tokenizer.model, else its dataset's (older
    runs)."""
    if override is not None:
        p = Path(override).expanduser()
        if not p.is_file():
            raise MissingFileError(f"--tokenizer {p}: file not found")
        return p
    own = Path(run_dir) / RUN_TOKENIZER
    if os.path.lexists(own):
        return check_run_tokenizer(run_dir, own)
    return check_regular(run_dataset(run_dir, cfg).tokenizer_path)


def run_dataset(
    run_dir: str | os.PathLike, cfg: dict[str, Any], override: str | os.PathLike | None = None
) -> Any:
    """The run's dataset (data.build.DatasetInfo): `override`, else the first of config data.dir,
    RUN/dataset.json's relative then absolute path, the default corpus, that exists and has the
    recorded fingerprint. TngramError listing what was tried when none does."""
    from tngram.data.build import default_data_dir, open_dataset

    run_dir = Path(run_dir)
    record = read_dataset_record(run_dir) or {}
    want = record.get("fingerprint")
    if override is not None:
        info = open_dataset(override)
        vocab = (cfg.get("model") or {}).get("vocab_size")
        if isinstance(vocab, int) and info.vocab_size != vocab:
            raise TngramError(
                f"--data {info.dir} has vocab {info.vocab_size}, but run {run_dir} was trained "
                f"with vocab {vocab}: its token ids mean other pieces there; choose a dataset "
                f"built with the run's tokenizer (tngram data build --tokenizer "
                f"{Path(run_dir) / RUN_TOKENIZER})"
            )
        rec_tok: dict[str, Any] = (
            ((record.get("manifest") or {}).get("tokenizer") or {})
            if isinstance(record.get("manifest"), dict)
            else {}
        )
        got = info.manifest.get("tokenizer")
        got_tok: dict[str, Any] = got if isinstance(got, dict) else {}
        if (
            isinstance(rec_tok, dict)
            and rec_tok.get("sha256")
            and got_tok.get("sha256") not in (None, rec_tok["sha256"])
        ):
            raise TngramError(
                f"--data {info.dir} uses another tokenizer (sha256 "
                f"{str(got_tok.get('sha256'))[:12]}) "
                f"than run {run_dir} ({str(rec_tok['sha256'])[:12]}): its token ids mean other "
                f"pieces; choose a dataset built with the run's tokenizer (tngram data build "
                f"--tokenizer {Path(run_dir) / RUN_TOKENIZER})"
            )
        if want and info.manifest.get("fingerprint") != want:
            print0(
                f"tngram: note: {info.dir} is not the dataset {run_dir} was trained on "
                f"(fingerprint {str(info.manifest.get('fingerprint'))[:12]} vs {want[:12]})"
            )
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
    raise TngramError(
        f"cannot find the dataset of run {run_dir}; tried " + ", ".join(tried) + "; pass --data DIR"
    )
