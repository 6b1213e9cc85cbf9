"""Reading back the files tngram wrote (docs/RELIABILITY.md, "Files read back").

A run or dataset folder may have been edited, damaged or made by someone else, so every JSON
record the program reads back (config.json, manifest.json, summary.json, results.json,
tuning.json, eval JSON, ...) goes through `load_json` — a regular file reached without links
(tngram.safefs), at most `limit` bytes, UTF-8, strict JSON (no NaN / Infinity tokens, no number
that overflows to one), nested at most MAX_DEPTH levels — and its fields through `get` (type,
range, finiteness). Tensor files go through `tngram.readback.tensors.read_safetensors`. Every
failure is one TngramError naming the file and the field, raised before anything is built from
the values.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from tngram.common import TngramError

MAX_DEPTH = 64  # far deeper than any record tngram writes
MAX_JSON_BYTES = 256 << 20  # a results file of a large sweep is a few MB

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


class _NonFinite(float):
    """A NaN / Infinity token (or a number that overflows to one) while parsing: its text."""

    token: str


def _nonfinite(token: str) -> _NonFinite:
    v = _NonFinite("nan")
    v.token = token[:40]
    return v


def _first_nonfinite(obj: Any) -> tuple[str, str] | None:
    """(dotted field, token) of the first _NonFinite in a parsed value (iterative)."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        o, at = stack.pop()
        if isinstance(o, _NonFinite):
            return at or "(top level)", o.token
        if isinstance(o, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in reversed(o.items()))
        elif isinstance(o, list):
            stack.extend((v, f"{at}[{i}]") for i, v in reversed(list(enumerate(o))))
    return None


def parse_json(text: str | bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads with the failures of hostile input as one BadRecordError naming `where`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRecordError(f"{where}: not UTF-8 text (byte offset {e.start})") from None
    seen: list[str] = []

    def constant(token: str) -> float:
        seen.append(token)
        return _nonfinite(token)

    def number(token: str) -> float:
        v = float(token)
        return v if math.isfinite(v) else constant(token)

    try:
        obj = json.loads(text, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise BadRecordError(f"{where}: nested more than {max_depth} levels deep") from None
    except ValueError as e:
        raise BadRecordError(
            f"{where}: corrupt or truncated JSON ({str(e).splitlines()[0][:120]})"
        ) from None
    if depth(obj) > max_depth:
        raise BadRecordError(f"{where}: nested more than {max_depth} levels deep")
    bad = _first_nonfinite(obj) if seen else None
    if bad is not None:
        raise BadRecordError(
            f"{where}: field {bad[0]} holds {bad[1]}, which is not a JSON number (tngram writes "
            "null where a number is missing)"
        )
    return obj


def load_json(
    path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    *,
    limit: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
    want_dict: bool = True,
) -> Any:
    """A JSON record read back: a regular file without links (below `root` if given), at most
    `limit` bytes, UTF-8, at most `max_depth` levels; an object when `want_dict`."""
    from tngram.safefs import read_bytes

    data = read_bytes(path, root, limit)
    obj = parse_json(data, str(path), max_depth)
    if want_dict and not isinstance(obj, dict):
        raise BadRecordError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _describe(kind: str, lo: float | None, hi: float | None) -> str:
    parts = [f">= {lo:g}" if lo is not None else "", f"<= {hi:g}" if hi is not None else ""]
    rng = " and ".join(r for r in parts if r)
    return f"{kind}{' ' + rng if rng else ''}"


def get(
    d: dict[str, Any],
    key: str,
    kind: str,
    where: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    default: Any = _MISSING,
) -> Any:
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
        ok = v is None or (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        )
    elif kind == "any-number?":  # NaN and infinities allowed (a diverged run's record)
        ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
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
        want = {
            "int": "an int",
            "float": "a finite number",
            "number?": "a finite number or null",
            "any-number?": "a number or null",
            "str": "a string",
            "bool": "true or false",
            "dict": "an object",
            "list": "a list",
        }[kind]
        raise BadRecordError(
            f"{where}: field {key!r} must be {_describe(want, lo, hi)}, got {_short(v)}"
        )
    return v


def plain_name(name: Any, where: str, key: str) -> str:
    """A file name inside a folder: a string with no folder part, not '.', '..' or hidden tricks."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
    ):
        raise BadRecordError(
            f"{where}: {key} must be a file name inside the folder, got {_short(name)}"
        )
    return name


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# numbers a summary.json holds (tngram.train.loop); each must be a number or null when present
SUMMARY_NUMBERS = (
    "steps",
    "schedule_steps",
    "train_loss",
    "val_loss",
    "val_bpb",
    "val_tokens",
    "val_bytes",
    "tokens",
    "tokens_per_s",
    "train_time_s",
    "wall_s",
    "total_params",
    "memory_params",
    "delta_params",
    "world_size",
    "grad_accum_steps",
)


def check_numbers(d: dict[str, Any], keys: tuple[str, ...], where: str) -> dict[str, Any]:
    """Every key of `keys` present in `d` holds a number (NaN allowed: a diverged run) or null."""
    for k in keys:
        if k in d:
            get(d, k, "any-number?", where)
    return d


def read_summary_file(
    path: str | os.PathLike, root: str | os.PathLike | None = None
) -> dict[str, Any]:
    """A run's summary.json read back: an object whose numbers are numbers (see SUMMARY_NUMBERS)."""
    return check_numbers(load_json(path, root), SUMMARY_NUMBERS, str(path))


def read_results_file(
    path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    require: tuple[str, ...] = (),
) -> dict[str, Any]:
    """An experiment's results.json read back: {"rows": [row objects]}, each row's numbers numbers,
    its run_dir and method strings, its seed an int; every key of `require` present in each."""
    where = str(path)
    d = load_json(path, root)
    rows = get(d, "rows", "list", where)
    for i, r in enumerate(rows):
        rw = f"{where}: rows[{i}]"
        if not isinstance(r, dict):
            raise BadRecordError(f"{rw} must be an object, got {_short(r)}")
        for k in require:
            if k not in r:
                raise BadRecordError(f"{rw}: field {k!r} is missing")
        check_numbers(r, SUMMARY_NUMBERS, rw)
        for k in ("run_dir", "method", "label", "recipe"):
            if k in r:
                get(r, k, "str", rw)
        if "seed" in r:
            get(r, "seed", "int", rw, lo=0)
    return d


def read_core_file(
    path: str | os.PathLike, root: str | os.PathLike | None = None
) -> dict[str, Any]:
    """An eval/core*.json read back: its "core" a number, its per-task results an object."""
    where = str(path)
    d = load_json(path, root)
    get(d, "core", "float", where)
    tasks = get(d, "tasks", "dict", where, default={})
    for label, t in tasks.items():
        tw = f"{where}: tasks.{label}"
        if not isinstance(t, dict):
            raise BadRecordError(f"{tw} must be an object, got {_short(t)}")
        for k in ("accuracy", "centered"):
            get(t, k, "float", tw)
        get(t, "n", "int", tw, lo=0)
        check_numbers(t, ("random_baseline",), tw)
    return d
