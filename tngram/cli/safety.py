"""How a command's failure reaches the terminal: always one line (docs/RELIABILITY.md).

    user or environment error (TngramError, OSError)  ->  "tngram: error: ...", exit 2
    out of memory (MemoryError, an allocator's error)   ->  one line naming what to lower, exit 2
    Ctrl-C (KeyboardInterrupt) outside training         ->  "tngram: interrupted ...", exit 130
    anything else                                       ->  one line saying it is a bug and where
                                                            the traceback was written, exit 1

Training handles SIGINT/SIGTERM itself (it checkpoints first); what reaches here is the rest.
The last case is a safety net: each such exception is still a bug to fix.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from typing import Callable

from tngram.cli.argtypes import report_error
from tngram.common import TngramError

INTERRUPTED = (
    "tngram: interrupted (Ctrl-C); nothing was left half-written (outputs are renamed into place "
    "only when complete)"
)
_OOM_MARKERS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
)


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _OOM_MARKERS)


def _write_traceback(e: BaseException) -> str:
    """The traceback in a file of its own (the cache's crash folder, else the temp folder)."""
    from tngram.common import cache_dir

    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = f"tngram {' '.join(sys.argv)}\n{when}\n\n{text}"
    for folder in (cache_dir() / "crash", tempfile.gettempdir()):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, path = tempfile.mkstemp(
                prefix=f"tngram-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt", dir=folder
            )
            # backslashreplace: argv or a message may hold undecodable bytes (surrogate escapes)
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return "(nowhere: no writable folder)"


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command handler; every failure is one line on stderr and an exit status (module
    doc)."""
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr, flush=True)
        return 130
    except (TngramError, OSError) as e:  # user/environment errors: one line, exit 2
        _say(f"tngram: error: {report_error(e)}")
        return 2
    except BaseException as e:
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if is_out_of_memory(e):
            print(
                "tngram: error: out of memory; lower the batch size "
                "(data.micro_batch_seqs for train, "
                "--batch-seqs / --batch-tokens for eval) or the model size, or free memory",
                file=sys.stderr,
                flush=True,
            )
            return 2
        path = _write_traceback(e)
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        _say(
            f"tngram: error: internal error, a bug in tngram ({type(e).__name__}: {msg}); "
            f"traceback in {path} (please report it)"
        )
        return 1


def _say(line: str) -> None:
    """One line on stderr; undecodable bytes (surrogate escapes from a path or an argument) as
    backslash escapes whatever the stream's error handler: the error line itself never fails."""
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr, flush=True)
