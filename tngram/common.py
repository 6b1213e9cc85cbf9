"""Small shared helpers: distributed info, printing on the main process, atomic writes, cache dir.

Nothing here does work at import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator


class TngramError(ValueError):
    """A user-facing error: one clear message, no traceback needed (the CLI prints it and exits 2).

    A ValueError (bad input), so callers can catch it as the built-in; a missing file or folder
    raises the subclass MissingFileError, which is also a FileNotFoundError."""


class MissingFileError(TngramError, FileNotFoundError):
    """A file or folder the user named (or that a command needs) does not exist."""

    def __str__(self) -> str:  # FileNotFoundError's would format (errno, strerror) pairs
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class DistInfo:
    ddp_rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.ddp_rank == 0


def get_dist_info() -> DistInfo:
    """Read torchrun's environment; a plain `python` run is rank 0 of 1."""
    return DistInfo(
        ddp_rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on the main process only."""
    if get_dist_info().is_main:
        print(*args, **kwargs, flush=True)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Open a temp file beside `path` for binary writing; fsync and rename it onto `path` on
    success. On any exception the temp file is removed and `path` is left untouched. Streams, so
    a 200 MB shard is never held twice in memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual file mode
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder and an atomic rename."""
    with atomic_output(path) as f:
        f.write(data)


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line of a JSONL file; a bad line raises one
    TngramError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TngramError(f"{path}: line {lineno}: malformed JSON ({e.msg})") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def cache_dir() -> Path:
    """Where built data lives: $TNGRAM_CACHE, else $XDG_CACHE_HOME/tngram, else ~/.cache/tngram."""
    env = os.environ.get("TNGRAM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tngram"
