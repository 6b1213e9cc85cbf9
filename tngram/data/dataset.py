"""A built dataset folder: its manifest, opening it with every file checked, the shard
validation cache, and the summary `tngram data info` prints. Building one is data/build.py."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError, atomic_write_json
from tngram.data.shards import read_shard_header

FORMAT = "tngram-dataset"
FORMAT_VERSION = 1
MAX_TOKENIZER_BYTES = 64 << 20  # a SentencePiece model of a 256k vocabulary is ~5 MB

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DatasetInfo",
    "open_dataset",
    "validate_dataset",
    "dataset_summary",
    "write_manifest",
]


@dataclass(frozen=True)
class DatasetInfo:
    dir: Path
    tokenizer_path: Path
    vocab_size: int
    train_files: list[Path]
    val_files: list[Path]
    manifest: dict[str, Any]


def write_manifest(dir: Path, manifest: dict[str, Any]) -> None:
    """Write dir/manifest.json atomically (temp file + rename)."""
    atomic_write_json(dir / "manifest.json", manifest)


def open_dataset(dir: str | os.PathLike) -> DatasetInfo:
    """Open a dataset folder (ours or a FineWeb download). TngramError naming what is missing."""
    d = Path(dir).expanduser()
    if not d.is_dir():
        raise MissingFileError(f"dataset {d} does not exist (build one with `tngram data build`)")
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise TngramError(
            f"{d} is not a tngram dataset: manifest.json is missing (build one with `tngram data "
            "build --from-text ... --out DIR` or download FineWeb with `tngram data fineweb`)"
        )
    from tngram.readback import get, load_json, plain_name
    from tngram.safefs import check_regular

    m = load_json(mpath, d)
    if m.get("format") != FORMAT:
        raise TngramError(f'{mpath}: not a tngram dataset manifest (no "format": "{FORMAT}")')
    where = str(mpath)
    vocab = get(m, "vocab_size", "int", where, lo=2, hi=65536)
    get(m, "bos_id", "int", where, lo=0, hi=vocab - 1, default=None)
    for part, rec in [("", m)] + [
        (f"sources[{i}].", s) for i, s in enumerate(get(m, "sources", "list", where, default=[]))
    ]:  # the counts `data info` prints, each a dict of ints per split
        for key in ("docs", "bytes", "tokens"):
            counts = get(rec, key, "dict", f"{where}: {part[:-1] or 'top level'}", default={})
            for split in ("train", "val"):
                get(counts, split, "int", f"{where}: {part}{key}", lo=0, default=0)
    tokinfo = get(m, "tokenizer", "dict", where)
    plain_name(get(tokinfo, "model", "str", f"{where}: tokenizer"), where, "tokenizer.model")
    file_lists = get(m, "files", "dict", where)
    for split in ("train", "val"):
        names = get(file_lists, split, "list", f"{where}: files", default=[])
        for name in names:
            plain_name(name, where, f"files.{split}[]")
    tok = d / tokinfo["model"]
    if not os.path.lexists(tok):
        raise MissingFileError(f"dataset {d}: tokenizer file {tok.name} is missing")
    want = get(tokinfo, "sha256", "str", f"{where}: tokenizer", default=None)
    if want is not None:  # the tokenizer the shards were made with, not another one
        from tngram.safefs import read_bytes

        got = hashlib.sha256(read_bytes(tok, d, limit=MAX_TOKENIZER_BYTES)).hexdigest()
        if got != want:
            raise TngramError(
                f"{where}: field tokenizer.sha256 is {want[:12]}..., but {tok} has sha256 "
                f"{got[:12]}...: the tokenizer was replaced after the shards were made; restore "
                f"it or rebuild the dataset"
            )
    check_regular(tok, d)
    split_files: dict[str, list[Path]] = {}
    for split in ("train", "val"):
        paths = [d / f for f in file_lists.get(split, [])]
        missing = [p.name for p in paths if not os.path.lexists(p)]
        if missing:
            raise MissingFileError(
                f"dataset {d}: {split} shard(s) missing: {', '.join(missing[:5])}"
            )
        if len(set(paths)) < len(paths):
            raise TngramError(f"{where}: field files.{split} lists a shard more than once")
        for p in paths:
            check_regular(p, d)
        count = sum(read_shard_header(p) for p in paths)
        if count != m.get("tokens", {}).get(split, count):
            raise TngramError(
                f"{where}: field tokens.{split} is {m['tokens'][split]:,}, but the {split} shards "
                f"hold {count:,} tokens (a shard was added, replaced or removed)"
            )
        split_files[split] = paths
    if not split_files["val"]:
        raise TngramError(f"dataset {d}: the manifest lists no val shards")
    return DatasetInfo(
        dir=d,
        tokenizer_path=tok,
        vocab_size=int(m["vocab_size"]),
        train_files=split_files["train"],
        val_files=split_files["val"],
        manifest=m,
    )


def validate_dataset(info: DatasetInfo, vocab_size: int) -> None:
    """Every train and val shard's header and id range, before training (see
    shards.validate_shards). Verdicts are cached in manifest.json under "validated", keyed by
    each file's size and mtime, so a large dataset is read once; a read-only dataset is simply
    checked every time."""
    from tngram.data.shards import VALIDATED_KEY, validate_shards
    from tngram.readback import load_json

    cache = info.manifest.get(VALIDATED_KEY) or {}
    records = validate_shards(info.train_files + info.val_files, vocab_size, cache)
    if records != cache:
        mpath = info.dir / "manifest.json"
        try:
            m = load_json(mpath, info.dir)
            if m.get("files") == info.manifest.get("files"):  # not rebuilt meanwhile
                m[VALIDATED_KEY] = records
                write_manifest(info.dir, m)
                info.manifest[VALIDATED_KEY] = records
        except (OSError, ValueError):  # TngramError included
            pass  # read-only or changed underneath: the check itself has passed


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def dataset_summary(info: DatasetInfo) -> str:
    """Human-readable summary of a dataset's manifest (for `tngram data info`)."""
    m = info.manifest
    lines = [
        f"dataset   {info.dir}",
        f"kind      {m.get('kind', '?')}   created {m.get('created', '?')}   build "
        f"{m.get('build_seconds', '?')} s",
        f"tokenizer {info.tokenizer_path.name}  vocab {info.vocab_size}  sha256 "
        f"{m['tokenizer'].get('sha256', '?')}",
    ]
    if "split" in m:
        lines.append(
            f"split     by {m['split'].get('by', 'document')}, seed {m['split'].get('seed')}"
        )
    for s in m.get("sources", []):
        ver = f"=={s['version']}" if s.get("version") else ""
        docs, nb, tk = s.get("docs", {}), s.get("bytes", {}), s.get("tokens", {})
        lines.append(
            f"source    {s.get('name')} ({s.get('package', s.get('repo_id', ''))}{ver}; "
            f"{s.get('text_licence', '')})"
        )
        if docs:
            lines.append(
                f"            docs {docs.get('train', 0):,} train / {docs.get('val', 0):,} val; "
                f"text {_mb(nb.get('train', 0))} / {_mb(nb.get('val', 0))}; "
                f"tokens {tk.get('train', 0):,} / {tk.get('val', 0):,}"
            )
    tokens = m.get("tokens", {})
    for split, files in (("train", info.train_files), ("val", info.val_files)):
        size = sum(p.stat().st_size for p in files)
        n = tokens.get(split)
        ntxt = f"{n:,} tokens, " if isinstance(n, int) else ""
        lines.append(f"{split:<9} {ntxt}{len(files)} shard(s), {_mb(size)}")
    if "fingerprint" in m:
        lines.append(f"fingerprint {m['fingerprint']}")
    return "\n".join(lines)
