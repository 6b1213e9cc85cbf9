"""Stopping on SIGTERM / SIGINT / SIGHUP without losing steps (what SLURM, Kubernetes, `kill`,
Ctrl-C and a closed terminal send).

During training (`StopRequest`, installed by tngram.train.loop.train around the loop):

    first signal    the current optimiser step finishes, a checkpoint of it is written, the run
                    lock is released, one line says how to resume, exit 128 + signal number
                    (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP)
    second signal   exit at once with the same code; the last checkpoint written is kept

A run stopped this way resumes with `--resume` bit-identically to an uninterrupted run (the
checkpoint is an ordinary one, written after a whole step).

A parent that trains in subprocesses (`compare`, `experiment`: tngram.experiments.runner) uses
`ForwardSignals` + `run_child`: each child runs in its own session, so a terminal's Ctrl-C reaches
only the parent, which forwards each signal once to every running child, starts no new run,
waits for the children to checkpoint, and exits with the same code.

Handlers can only be installed in the main thread; elsewhere both classes do nothing (the
default behaviour stays).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

# SIGHUP: the terminal that started the run was closed (an ssh session dropped)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _say(text: str) -> None:
    """One line on stderr; after SIGHUP a closed terminal's stdout and stderr are sent to
    /dev/null first (writing to a hung-up terminal fails), a file or pipe is kept."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def _leave_closed_terminal() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:  # a hung-up terminal is no longer a tty (isatty fails), still a device
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by signal `signum` (143 SIGTERM, 130 SIGINT)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class TrainingStopped(Exception):
    """Raised out of the training loop after the checkpoint of the last finished step is written."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped by {signal_name(signum)} after step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class _Handlers:
    """Installs `self._handle` for STOP_SIGNALS while active (main thread only); remembers the
    first signal in `signum`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Handlers":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError


class StopRequest(_Handlers):
    """Inside the training loop: the first signal only sets `signum` (the loop checks it after each
    step); the second exits the process at once."""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if signum == signal.SIGHUP:
            _leave_closed_terminal()
        if self.signum is None:
            self.signum = signum
            _say(
                f"tngram: {name}: finishing this step and writing a checkpoint "
                f"(send it again to exit at once)"
            )
            return
        _say(
            f"tngram: second {name}: exiting at once (exit {exit_code(signum)}); the last "
            f"checkpoint written is kept"
        )
        os._exit(exit_code(signum))


class ForwardSignals(_Handlers):
    """In a parent of training subprocesses started by `run_child`: every signal is forwarded to
    every running child; `signum` tells the parent to start no further child."""

    def __init__(self) -> None:
        super().__init__()
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            _leave_closed_terminal()
        if self.signum is None:
            self.signum = signum
            _say(
                f"tngram: {signal_name(signum)}: the running training run(s) finish their step and "
                f"write a checkpoint; no further run starts (send it again to stop at once)"
            )
        with self._lock:
            children = list(self._children)
        for p in children:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass

    def run_child(self, cmd: list[str], **kwargs: Any) -> int:
        """subprocess.run(cmd, **kwargs).returncode, with the child in its own session (a
        terminal's Ctrl-C reaches only the parent, which forwards it once)."""
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        with self._lock:
            self._children.add(proc)
        try:
            if self.signum is not None:  # a signal came while the child was starting
                proc.send_signal(self.signum)
            return proc.wait()
        finally:
            with self._lock:
                self._children.discard(proc)
