"""One writer per run folder: an exclusive, advisory lock on DIR/.tngram.lock.

Every command that writes into a run folder (`train`, `train --resume`, `eval bpb/core` writing
their JSON into the run) holds this lock for as long as it writes. A second writer fails at once
with one line naming the holder (pid, host, command, start time).

The lock is `fcntl.flock` on the lock file, so the kernel releases it when the holder dies,
however it dies (`kill -9` included): a lock file left behind by a dead process is *stale* and
is simply taken over. The holder's pid/host/command are recorded in the file for the error
message only; they are never what decides who holds the lock. Network filesystems without
flock support get an OSError from fcntl, which we report as such.
(Hand-written on fcntl rather than the `filelock` package so the holder's record is written
through the locked descriptor itself; see docs/LOG.md.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tngram.common import TngramError

LOCK_FILE = ".tngram.lock"


def _holder_text(info: dict | None) -> str:
    if not info:
        return "another process (no holder info recorded yet)"
    cmd = " ".join(str(a) for a in info.get("argv", []))[:120]
    return (
        f"pid {info.get('pid')} on host {info.get('host')} since {info.get('since')} "
        f"({info.get('what', '?')}: {cmd})"
    )


def read_holder(run_dir: str | os.PathLike) -> dict | None:
    """The recorded holder of DIR's lock file (whether or not it still holds it), or None."""
    from tngram.safefs import read_text

    try:
        info = json.loads(read_text(Path(run_dir) / LOCK_FILE, limit=1 << 16) or "null")
    except (OSError, ValueError):  # missing, a link, a FIFO, not JSON: no holder info
        return None
    return info if isinstance(info, dict) else None


class RunLock:
    """Context manager: `with RunLock(dir, "train"):` holds DIR's exclusive lock.

    Raises TngramError if another live process holds it. Re-entrant within one process is NOT
    supported (flock locks are per open file description: a second RunLock in the same process
    on the same folder also fails, which is what we want for two writers in one process).
    """

    def __init__(self, run_dir: str | os.PathLike, what: str) -> None:
        self.run_dir = Path(run_dir)
        self.what = what
        self._fd: int | None = None
        self.created_file = False  # the lock file did not exist before acquire()
        self.created = False  # the run folder did not exist before (set by tngram.train.rundir)
        self.stale: dict | None = None  # holder info of a dead process whose lock we took over

    def acquire(self) -> "RunLock":
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.created_file = not os.path.lexists(path)
        except OSError as e:
            raise TngramError(f"cannot create the run lock {path}: {e.strerror or e}") from None
        fd = self._open_locked(path)
        prev = read_holder(self.run_dir)
        if prev and (prev.get("pid"), prev.get("host")) != (os.getpid(), socket.gethostname()):
            self.stale = prev  # it was recorded but not locked: its process is gone
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "what": self.what,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _open_locked(self, path: Path) -> int:
        """Open and flock the lock file, never through a link (O_NOFOLLOW) and only a regular
        file; a lock file with other hard links (a `cp -al` copy of the run) is first replaced by
        a file of its own, so the other copy's lock file is never written."""
        for _ in range(20):
            try:
                pre = os.lstat(path)  # before opening: a device or FIFO is never opened
            except FileNotFoundError:
                pre = None
            if pre is not None and not stat.S_ISREG(pre.st_mode) and not stat.S_ISLNK(pre.st_mode):
                raise TngramError(
                    f"{path} is not a regular file; remove it (it was not written by tngram)"
                )
            fd = self._open_one(
                path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
            try:
                self._flock(fd, path)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise TngramError(
                        f"{path} is not a regular file; remove it (it was not written by tngram)"
                    )
                try:
                    now = os.lstat(path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                    os.close(fd)  # replaced while we waited: lock the current file
                    continue
                if st.st_nlink > 1:  # shared with another copy: lock a new file of our own
                    fd2 = self._fresh_lock_file(path)
                    os.close(fd)
                    fd = fd2
                return fd
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        raise TngramError(f"cannot lock {path}: it keeps being replaced by another process")

    def _open_one(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TngramError(
                    f"{path} is a symbolic link; tngram never follows links in a run "
                    f"folder: remove it (the run lock is recreated)"
                ) from None
            raise TngramError(f"cannot create the run lock {path}: {e.strerror or e}") from None

    def _flock(self, fd: int, path: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TngramError(
                    f"run folder {self.run_dir} is in use by "
                    f"{_holder_text(read_holder(self.run_dir))}; "
                    f"wait for it to finish or choose another folder"
                ) from None
            raise TngramError(
                f"cannot lock {path}: {e.strerror or e} (does this filesystem support flock?)"
            ) from None

    def _fresh_lock_file(self, path: Path) -> int:
        """A new lock file, locked, renamed over `path` (we hold the old one's lock meanwhile)."""
        fd, tmp = tempfile.mkstemp(prefix=f"{LOCK_FILE}.", suffix=".tmp", dir=self.run_dir)
        try:
            os.fchmod(fd, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # an empty file = not held (kept: removing races a new holder)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self if self.held else self.acquire()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
