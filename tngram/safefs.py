"""Safe file access inside a run or dataset folder (docs/RELIABILITY.md, "Files read back").

Run and dataset folders are shared, copied and downloaded, so their content is untrusted. Every
file tngram writes or reads inside such a folder (the *root*) goes through this module:

  * no symbolic links: each folder between the root and the file is checked with lstat, and the
    file itself is opened with O_NOFOLLOW, so a link planted in a received folder can never make
    a command read, write or delete anything outside it (the root itself may be a link: the user
    named it);
  * regular files only: a file is opened with O_NONBLOCK and checked with fstat, so a FIFO or a
    device in place of a run file is one error line, never a reader blocked for ever;
  * writes make a new file (in the same folder, fsync'ed) and rename it over the old one, so a
    hard-linked copy of a run (`cp -al`) never changes its original;
  * removals: `remove_tree` never follows a link (the caller decides what is its own to remove).

Every refusal is an UnsafePathError (a TngramError: one line naming the path, exit 2).
Imports only tngram.common, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

from tngram.common import MissingFileError, TngramError, json_text, new_file_mode, read_text_utf8
from tngram.common import atomic_output as common_atomic_output

StrPath = str | os.PathLike


class UnsafePathError(TngramError):
    """A path inside a run or dataset folder that tngram refuses to follow (a symbolic link, or
    a FIFO/device/folder where a regular file belongs)."""


def _link_error(p: Path, root: StrPath | None) -> UnsafePathError:
    where = f" inside {root}" if root is not None else ""
    return UnsafePathError(
        f"{p} is a symbolic link{where}; tngram never follows links in a run or "
        f"dataset folder: replace it with a real file or folder"
    )


def _parts_below(root: StrPath, path: StrPath) -> list[str]:
    """`path`'s components below `root` (lexically; `path` must lie inside `root`)."""
    rel = os.path.relpath(
        os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(root))
    )
    if rel == ".":
        return []
    parts = Path(rel).parts
    if parts and parts[0] == "..":
        raise UnsafePathError(f"{path} is not inside {root}")
    return list(parts)


def check_chain(root: StrPath, path: StrPath, include_self: bool = False) -> None:
    """Every existing folder strictly between `root` and `path` (and `path` itself with
    include_self) is a real folder, not a symbolic link. Missing components end the check."""
    parts = _parts_below(root, path)
    cur = Path(root)
    upto = parts if include_self else parts[:-1]
    for i, part in enumerate(upto):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise _link_error(cur, root)
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{cur} is not a folder")


def is_link(path: StrPath) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def real_dir(path: StrPath) -> bool:
    """True when `path` is a folder and not a symbolic link (never follows it)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def make_dirs(root: StrPath, path: StrPath) -> Path:
    """Create `path` (a folder inside `root`) component by component; an existing component that
    is a link or a file is refused. The root is created as usual (it may be a link)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    cur = Path(root)
    for part in _parts_below(root, path):
        cur = cur / part
        try:
            os.mkdir(cur)
        except FileExistsError:
            pass
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            raise _link_error(cur, root)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{cur} is a file, expected a folder")
    return cur


def open_fd(path: StrPath, root: StrPath | None = None) -> int:
    """A read-only descriptor of the regular file `path`, never through a link (see the module
    doc). MissingFileError if it does not exist; UnsafePathError for links, FIFOs, devices."""
    path = Path(path)
    if root is not None:
        check_chain(root, path)
    try:
        st = os.lstat(path)  # before opening: opening some devices has side effects
    except FileNotFoundError:
        raise MissingFileError(f"{path}: missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise _link_error(path, root)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(
            f"{path} is {_kind(st.st_mode)}, not a regular file; refusing to read it"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path, root) from None
        raise
    try:
        st = os.fstat(fd)  # (swapped since the lstat: checked again on what was opened)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                f"{path} is {_kind(st.st_mode)}, not a regular file; refusing to read it"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    return (
        "a folder"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device or socket"
    )


def check_regular(path: StrPath, root: StrPath | None = None) -> Path:
    """`path` is a regular file reached without links (for paths handed to a library that opens
    them itself: sentencepiece, safetensors). Returns it."""
    os.close(open_fd(path, root))
    return Path(path)


def open_read(path: StrPath, root: StrPath | None = None) -> IO[bytes]:
    return os.fdopen(open_fd(path, root), "rb")


def read_bytes(path: StrPath, root: StrPath | None = None, limit: int | None = None) -> bytes:
    """The bytes of a regular file (at most `limit`: a larger file is refused, naming it, before
    any byte is read)."""
    with open_read(path, root) as f:
        if limit is not None and os.fstat(f.fileno()).st_size > limit:
            raise TngramError(f"{path}: larger than {limit:,} bytes; not a file tngram wrote")
        data = f.read() if limit is None else f.read(limit + 1)  # (+1: a file still growing)
    if limit is not None and len(data) > limit:
        raise TngramError(f"{path}: larger than {limit:,} bytes; not a file tngram wrote")
    return data


def read_text(path: StrPath, root: StrPath | None = None, limit: int | None = None) -> str:
    """A UTF-8 text file; a file that is not UTF-8 is one TngramError naming it and the line."""
    return read_text_utf8(path, read_bytes(path, root, limit))


@contextlib.contextmanager
def atomic_output(path: StrPath, root: StrPath | None = None) -> Iterator[IO[bytes]]:
    """A new temp file beside `path` for binary writing; fsync'ed and renamed onto `path` on
    success (a link at `path` is replaced, never followed; a hard link's other names keep the
    old content). With `root`, the folders from `root` down to `path` are created and checked
    for links first. On any exception the temp file is removed and `path` is untouched."""
    path = Path(path)
    if root is not None:
        make_dirs(root, path.parent)
    with common_atomic_output(path) as f:  # temp file + fsync + rename (tngram.common)
        yield f


def write_bytes(path: StrPath, data: bytes, root: StrPath | None = None) -> None:
    with atomic_output(path, root) as f:
        f.write(data)


def write_json(path: StrPath, obj: Any, root: StrPath | None = None) -> None:
    write_bytes(path, (json_text(obj, indent=2) + "\n").encode("utf-8"), root)


def replace_for_append(path: StrPath, keep: bytes, root: StrPath | None = None) -> IO[bytes]:
    """Write `keep` into a new file, rename it over `path`, and return that new file open for
    appending: later rows go to the new file only, so a hard-linked copy's original (or a link's
    target) is never cut or appended to."""
    path = Path(path)
    if root is not None:
        make_dirs(root, path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, new_file_mode())
        f = os.fdopen(fd, "ab")
        try:
            f.write(keep)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            f.close()
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return f


def remove_tree(path: StrPath, root: StrPath | None = None) -> bool:
    """Remove the folder (or file) `path` without following any link: a link at `path` is left
    alone (it is not ours), links inside are unlinked, never followed. True if removed."""
    path = Path(path)
    if root is not None:
        check_chain(root, path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows links
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return not os.path.lexists(path)
