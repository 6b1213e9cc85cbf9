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


class MissingExtraError(TngramError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require_extra(module: str, extra: str, what: str) -> Any:
    """`import module`, or a one-line MissingExtraError naming the extra that installs it, e.g.
    require_extra("matplotlib", "report", "figures")."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{what} need {module.split('.')[0]}, which is not installed: "
            f"pip install 'tngram[{extra}]'"
        ) from None


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
        os.chmod(tmp, new_file_mode())  # mkstemp creates 0600; give the usual file mode
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0o666 & ~umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder and an atomic rename."""
    with atomic_output(path) as f:
        f.write(data)


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line of a JSONL file; a bad line raises one
    TngramError naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TngramError(
                    f"{path}: line {lineno}: not UTF-8 text (byte {e.start}: "
                    f"{raw[e.start : e.start + 1]!r}); re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TngramError(f"{path}: line {lineno}: malformed JSON ({e.msg})") from None


def read_text_utf8(path: str | os.PathLike, data: bytes | None = None) -> str:
    """A text file's content (`data`: its bytes, already read); a file that is not UTF-8 is one
    TngramError naming it and the line."""
    data = Path(path).read_bytes() if data is None else data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TngramError(
            f"{path}: line {line}: not UTF-8 text (byte offset {e.start}); re-encode the "
            f"file as UTF-8"
        ) from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def finite_or_null(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, inf) replaced by None, so it serialises as strict
    JSON (a number that is not there is null; NaN is no JSON token)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def json_text(obj: Any, **kw: Any) -> str:
    """Strict JSON of `obj` (non-finite floats written as null, never as NaN / Infinity)."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kw)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json_text(obj, indent=2, sort_keys=False) + "\n")


def check_writable_dir(folder: Path, flag: str) -> None:
    """TngramError unless `folder` is (or can be created as) a writable folder."""
    if folder.exists() and not folder.is_dir():
        raise TngramError(f"{flag} {folder} is a file, expected a folder")
    probe_root = folder
    while not probe_root.exists():  # the nearest existing parent must accept the mkdir
        probe_root = probe_root.parent
    if not probe_root.is_dir():
        raise TngramError(f"{flag} {folder}: {probe_root} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tngram-probe.", suffix=".tmp", dir=probe_root)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise TngramError(
            f"{flag} {folder} is not writable ({e.strerror or e}); choose another folder"
        ) from None


def cache_dir() -> Path:
    """Where built data lives: $TNGRAM_CACHE, else $XDG_CACHE_HOME/tngram, else ~/.cache/tngram."""
    env = os.environ.get("TNGRAM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tngram"


def check_thread_count(n: int, key: str) -> None:
    """A thread count far above the CPU cores (more than 4x) runs for minutes without one step
    (each op's threads spin-wait for each other): one TngramError naming `key`, before any work."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    if n > 4 * cores:
        raise TngramError(
            f"{key} {n} is far above this machine's {cores} CPU core(s) (at most {4 * cores}); "
            f"use 0 (torch's default) or a count up to {cores}"
        )
