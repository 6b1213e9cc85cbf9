"""argparse `type=` callables that check a flag's range as it is parsed (before any work).

    p.add_argument("--max-tokens", type=int_range(1))          # an int >= 1
    p.add_argument("--temperature", type=float_range(0.0))     # a finite float >= 0

A bad value is argparse's usual one-line error ("argument --max-tokens: must be an int >= 1,
got '0'") with exit status 2. NaN and infinities are refused by every float_range.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def _describe(kind: str, lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"<= {hi:g}")
    return f"{'a finite ' if kind == 'float' else 'an '}{kind}" + (
        " " + " and ".join(parts) if parts else ""
    )


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An int in [lo, hi] (either bound optional); underscores allowed (1_000)."""
    want = _describe("int", lo, hi)

    def parse(text: str) -> int:
        try:
            v = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return v

    parse.__name__ = want
    return parse


def float_range(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> Callable[[str], float]:
    """A finite float in [lo, hi] ((lo, hi] with lo_open); NaN and +-inf are always refused."""
    want = _describe("float", lo, hi, lo_open)

    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        bad = (
            not math.isfinite(v)
            or (lo is not None and (v <= lo if lo_open else v < lo))
            or (hi is not None and v > hi)
        )
        if bad:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return v

    parse.__name__ = want
    return parse


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are ONE line on stderr and exit status 2 (argparse's
    default prints the whole usage first); `--help` still prints the full usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def report_error(e: BaseException) -> str:
    """The one line printed for an error that reaches the command line: TngramError's message,
    an OSError with its file (disk full, permission denied, ...)."""
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return str(e)
