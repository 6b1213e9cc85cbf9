"""Reading back the files tngram wrote (docs/RELIABILITY.md, "Files read back").

A run or dataset folder may have been edited, damaged or made by someone else, so every JSON
record the program reads back (config.json, manifest.json, summary.json, results.json,
tuning.json, eval JSON, ...) goes through `load_json` — a regular file reached without links
(tngram.safefs), at most `limit` bytes, UTF-8, JSON, nested at most MAX_DEPTH levels — and its
fields through `get` (type, range, finiteness). Every failure is one TngramError naming the file
and the field, raised before anything is built from the values.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from tngram.common import TngramError

MAX_DEPTH = 64                 # far deeper than any record tngram writes
MAX_JSON_BYTES = 256 << 20     # a results file of a large sweep is a few MB

_MISSING = object()


class BadRecordError(TngramError):
    """A file tngram reads back does not hold what tngram writes there."""


def depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit)."""
    best, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            best = max(best, d)
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            best = max(best, d)
            stack.extend((v, d + 1) for v in o)
    return best


def parse_json(text: str | bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads with the failures of hostile input as one BadRecordError naming `where`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRecordError(f"{where}: not UTF-8 text (byte offset {e.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise BadRecordError(f"{where}: nested more than {max_depth} levels deep") from None
    except ValueError as e:
        raise BadRecordError(f"{where}: corrupt or truncated JSON ({str(e).splitlines()[0][:120]})") from None
    if depth(obj) > max_depth:
        raise BadRecordError(f"{where}: nested more than {max_depth} levels deep")
    return obj


def load_json(path: str | os.PathLike, root: str | os.PathLike | None = None, *, limit: int = MAX_JSON_BYTES,
              max_depth: int = MAX_DEPTH, want_dict: bool = True) -> Any:
    """A JSON record read back: a regular file without links (below `root` if given), at most
    `limit` bytes, UTF-8, at most `max_depth` levels; an object when `want_dict`."""
    from tngram.safefs import read_bytes
    data = read_bytes(path, root, limit)
    obj = parse_json(data, str(path), max_depth)
    if want_dict and not isinstance(obj, dict):
        raise BadRecordError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _describe(kind: str, lo: float | None, hi: float | None) -> str:
    rng = [f">= {lo:g}" if lo is not None else "", f"<= {hi:g}" if hi is not None else ""]
    rng = " and ".join(r for r in rng if r)
    return f"{kind}{' ' + rng if rng else ''}"


def get(d: dict[str, Any], key: str, kind: str, where: str, *, lo: float | None = None,
        hi: float | None = None, default: Any = _MISSING) -> Any:
    """d[key] checked against `kind` ("int", "float" (finite; an int is accepted), "number?"
    (finite or None), "str", "bool", "dict", "list"); a missing key is an error unless `default`
    is given. The error names `where` (the file) and the key."""
    if not isinstance(d, dict):
        raise BadRecordError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if key not in d:
        if default is not _MISSING:
            return default
        raise BadRecordError(f"{where}: field {key!r} is missing")
    v = d[key]
    ok: bool
    if kind == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif kind == "number?":
        ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    elif kind == "str":
        ok = isinstance(v, str)
    elif kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "dict":
        ok = isinstance(v, dict)
    elif kind == "list":
        ok = isinstance(v, list)
    else:  # pragma: no cover - programming error
        raise ValueError(kind)
    if ok and v is not None and kind in ("int", "float", "number?"):
        ok = (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        want = {"int": "an int", "float": "a finite number", "number?": "a finite number or null",
                "str": "a string", "bool": "true or false", "dict": "an object", "list": "a list"}[kind]
        raise BadRecordError(f"{where}: field {key!r} must be {_describe(want, lo, hi)}, got {_short(v)}")
    return v


def plain_name(name: Any, where: str, key: str) -> str:
    """A file name inside a folder: a string with no folder part, not '.', '..' or hidden tricks."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name):
        raise BadRecordError(f"{where}: {key} must be a file name inside the folder, got {_short(name)}")
    return name


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
