"""Token shards in parameter-golf's binary format.

A shard is a 1,024-byte header of 256 little-endian int32 values
(``[0] = SHARD_MAGIC``, ``[1] = SHARD_VERSION``, ``[2] = token count``, the rest zero)
followed by ``count`` little-endian uint16 token ids. The file size is therefore exactly
``1024 + 2 * count`` bytes. Every document is stored as ``[BOS] + tokens`` (no EOS), packed
back to back; documents may straddle shard boundaries.

Our files are named ``{split}_{index:06d}.bin``; parameter-golf's ``fineweb_{split}_*.bin``
are read the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


import numpy as np

from tngram.common import TngramError, atomic_output

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1,024
MAX_TOKEN_ID = 65535  # uint16 payload

__all__ = [
    "SHARD_MAGIC",
    "SHARD_VERSION",
    "HEADER_INTS",
    "HEADER_BYTES",
    "write_shard",
    "read_shard",
    "read_shard_header",
    "check_vocab",
    "list_shards",
    "shard_name",
]


def shard_name(split: str, index: int) -> str:
    """Our shard file name: ``{split}_{index:06d}.bin``."""
    return f"{split}_{index:06d}.bin"


def _header(count: int) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = SHARD_VERSION
    header[2] = count
    return header


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (1-D, any integer dtype, values in [0, 65535]) as one shard, atomically.

    Raises TngramError (and writes nothing) if an id does not fit in uint16 or the count does
    not fit in the int32 header.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TngramError(f"shard {path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TngramError(f"shard {path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size >= 2**31:
        raise TngramError(f"shard {path}: {arr.size} tokens do not fit the int32 header count")
    if arr.dtype != np.uint16 and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = hi if hi > MAX_TOKEN_ID else lo
            raise TngramError(
                f"shard {path}: token id {bad} does not fit in uint16 (ids must be in [0, "
                f"{MAX_TOKEN_ID}]); "
                "a vocabulary above 65,536 cannot be stored in this format"
            )
    payload = np.ascontiguousarray(arr, dtype="<u2")  # (count,)
    with atomic_output(path) as f:
        f.write(_header(payload.size).tobytes())
        f.write(payload.data.cast("B"))  # the array's own buffer, no copy


def read_shard_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count. One TngramError per problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise TngramError(f"shard {path}: file not found") from None
    except OSError as e:
        raise TngramError(f"shard {path}: cannot read ({e.strerror or e})") from None
    if size < HEADER_BYTES:
        raise TngramError(
            f"shard {path}: truncated header: the file has {size} bytes, a shard needs at least "
            f"{HEADER_BYTES} (256 int32 header)"
        )
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != SHARD_MAGIC:
        raise TngramError(
            f"shard {path}: bad magic number {magic} (expected {SHARD_MAGIC}); "
            "this is not a parameter-golf/tngram token shard"
        )
    if version != SHARD_VERSION:
        raise TngramError(
            f"shard {path}: unsupported shard version {version} (expected {SHARD_VERSION})"
        )
    if count < 0:
        raise TngramError(f"shard {path}: negative token count {count} in the header")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise TngramError(
            f"shard {path}: {what} file: the header says {count} tokens, so the file should have "
            f"{HEADER_BYTES} + 2*{count} = {expected} bytes, but it has {size}"
        )
    return count


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str | os.PathLike) -> None:
    """Raise TngramError naming `path` if any id in `tokens` is >= vocab_size."""
    if tokens.size == 0:
        return
    hi = int(tokens.max())
    if hi >= vocab_size:
        pos = int(np.argmax(np.asarray(tokens) >= vocab_size))
        raise TngramError(
            f"shard {path}: token id {hi} is out of range for vocab_size {vocab_size} "
            f"(first bad id at token {pos}); was the shard written with a different tokenizer?"
        )


def read_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a shard's payload as a read-only uint16 array of shape (count,).

    Validates magic, version and file size (== 1024 + 2*count); with `vocab_size`, also that
    every id is < vocab_size (a full scan). Any failure is one TngramError naming the file.
    """
    path = Path(path)
    count = read_shard_header(path)
    if count == 0:
        tokens: np.ndarray = np.zeros(0, dtype=np.uint16)
    else:
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, path)
    return tokens


def list_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """Sorted shard files of `split` in `data_dir`: ours (``{split}_NNNNNN.bin``) and
    parameter-golf's (``fineweb_{split}_NNNNNN.bin``)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise TngramError(f"data dir {data_dir} does not exist or is not a directory")
    pat = re.compile(rf"^(?:fineweb_)?{re.escape(split)}_\d+\.bin$")
    return sorted(p for p in data_dir.iterdir() if pat.match(p.name) and p.is_file())


# ---- whole-dataset validation (before training), cached by file size and mtime

SCAN_CHUNK = 1 << 24  # tokens per vectorised max() (32 MiB of uint16)
# manifest.json key: {file name: {"size", "mtime_ns", "count", "max_id"}}
VALIDATED_KEY = "validated"


def scan_shard(path: Path) -> dict[str, int]:
    """Header check + the largest id, chunk by chunk: {"size", "mtime_ns", "count", "max_id"}.
    A shard with 0 tokens is a TngramError naming it (an empty shard is a broken build)."""
    count = read_shard_header(path)
    st = path.stat()
    if count == 0:
        raise TngramError(
            f"shard {path}: 0 tokens (header count 0): an empty shard is a broken or "
            f"interrupted build; delete it from the dataset or rebuild"
        )
    tok = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    hi = 0
    for start in range(0, count, SCAN_CHUNK):
        hi = max(hi, int(tok[start : start + SCAN_CHUNK].max()))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "count": count, "max_id": hi}


def first_bad_token(path: Path, vocab_size: int) -> int:
    """Index of the first id >= vocab_size in a shard (which has one)."""
    count = read_shard_header(path)
    tok = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    for start in range(0, count, SCAN_CHUNK):
        bad = np.flatnonzero(tok[start : start + SCAN_CHUNK] >= vocab_size)
        if bad.size:
            return start + int(bad[0])
    return -1


def validate_shards(
    files: list[Path], vocab_size: int, cache: dict[str, dict[str, int]] | None = None
) -> dict[str, dict[str, int]]:
    """Check every shard's header, size and id range (< vocab_size) before training.

    `cache` maps file names to earlier scan records; a record whose size and mtime still match
    is trusted without reading the file. Returns the (updated) records for all `files`. The
    first problem is one TngramError naming the file and, for an id out of range, the token
    index and byte offset of the first bad id."""
    cache = dict(cache or {})
    out: dict[str, dict[str, int]] = {}
    for path in files:
        path = Path(path)
        rec = cache.get(path.name)
        try:
            st = path.stat()
        except OSError as e:
            raise TngramError(f"shard {path}: cannot read ({e.strerror or e})") from None
        if not (
            isinstance(rec, dict)
            and rec.get("size") == st.st_size
            and rec.get("mtime_ns") == st.st_mtime_ns
            and isinstance(rec.get("max_id"), int)
        ):
            rec = scan_shard(path)
        if rec["max_id"] >= vocab_size:
            i = first_bad_token(path, vocab_size)
            raise TngramError(
                f"shard {path}: token id {rec['max_id']} is out of range for vocab_size "
                f"{vocab_size}; first bad id at token {i} (byte offset {HEADER_BYTES + 2 * i}); "
                f"was the shard written with a different tokenizer?"
            )
        out[path.name] = rec
    return out
