"""The Markdown side of generated blocks: the BEGIN/END markers, finding and replacing a block,
table rows and cells, and the provenance line every block ends with.

The bottom of tngram.report: research.report.docblocks (which results file renders which block),
research.report.readme and research.report.bench_blocks all build on it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from tngram.common import TngramError
from tngram.report.runs import fmt_params, mean_std

MINUS = "\u2212"


def begin_marker(name: str) -> str:
    return f"<!-- BEGIN generated: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- END generated: {name} -->"


# a block name: FILE or FILE:VIEW, FILE a plain results-file name (no folder, no leading dot)
NAME_RE = re.compile(r"[A-Za-z0-9_][\w.@-]*(?::[\w.@-]+)?")
# anything that looks like a marker, however spaced or named: each must be a well-formed one
_LOOSE = re.compile(r"<!--\s*(BEGIN|END)\s+generated\b(.*?)-->", re.IGNORECASE | re.DOTALL)


def block_names(text: str, where: str = "the document") -> list[str]:
    """Names of the generated blocks in a Markdown text, in order. Every marker-like comment
    must be a well-formed BEGIN or END marker of a valid name (NAME_RE, no '..'), each BEGIN
    followed by its END, each name once: otherwise one TngramError naming the line (a block
    that is not recognised would never be checked)."""
    names: list[str] = []
    open_name: str | None = None
    for m in _LOOSE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        kind, raw = m.group(1), m.group(0)
        name = m.group(2).strip().removeprefix(":").strip()
        good = (
            kind in ("BEGIN", "END")
            and NAME_RE.fullmatch(name) is not None
            and ".." not in name
            and raw == (begin_marker(name) if kind == "BEGIN" else end_marker(name))
        )
        if not good:
            raise TngramError(
                f"{where}: line {line}: malformed generated-block marker {raw[:80]!r}; expected "
                f"{begin_marker('NAME')!r} / {end_marker('NAME')!r} with NAME = FILE or "
                f"FILE:VIEW (letters, digits, _ . @ -; no folder)"
            )
        if kind == "BEGIN":
            if open_name is not None:
                raise TngramError(f"{where}: line {line}: block {open_name!r} is not closed")
            if name in names:
                raise TngramError(f"{where}: line {line}: block {name!r} appears twice")
            open_name = name
            names.append(name)
        elif name != open_name:
            raise TngramError(f"{where}: line {line}: END of {name!r} without its BEGIN")
        else:
            open_name = None
    if open_name is not None:
        raise TngramError(f"{where}: block {open_name!r} has no END marker")
    return names


def _indent(text: str, name: str) -> str:
    """The spaces before the BEGIN marker (a block inside a list item is indented with it)."""
    a = begin_marker(name)
    if a not in text or end_marker(name) not in text:
        raise TngramError(f"no generated block {name!r} (markers {a} ... {end_marker(name)})")
    line_start = text[: text.index(a)].rsplit("\n", 1)[-1]
    return line_start if not line_start.strip() else ""


def current_block(text: str, name: str) -> str:
    """The text of block `name`, without the indentation of its markers."""
    ind = _indent(text, name)
    body = (
        text.split(begin_marker(name), 1)[1].split(end_marker(name), 1)[0].rstrip(" ").strip("\n")
    )
    lines = body.split("\n")
    return "\n".join(ln[len(ind) :] if ln.startswith(ind) else ln for ln in lines)


def replace_block(text: str, name: str, block: str) -> str:
    ind = _indent(text, name)
    a, b = begin_marker(name), end_marker(name)
    head, rest = text.split(a, 1)
    _, tail = rest.split(b, 1)
    body = "\n".join(ind + ln if ln else ln for ln in block.split("\n"))
    return f"{head}{a}\n{body}\n{ind}{b}{tail}"


def results_name(name: str) -> str:
    """The results file's name of block NAME (FILE or FILE:VIEW)."""
    return name.split(":", 1)[0]


def snapshot_path(doc: Path, name: str) -> Path:
    """research/results/FILE.json of the repository holding `doc` (README.md, docs/*.md or
    research/*.md)."""
    root = doc.parent.parent if doc.parent.name in ("docs", "research") else doc.parent
    return root / "research" / "results" / f"{results_name(name)}.json"


def provenance(snap: dict[str, Any], source: str) -> str:
    for key in ("command", "commit", "machine"):
        if not snap.get(key):
            raise TngramError(
                f"{source}: field {key!r} is missing (every results file names its "
                "command, commit and machine)"
            )
    note = f" {snap['note']}" if snap.get("note") else ""
    return (
        f"Generated from `{source}` (`{snap['command']}` at commit {snap['commit']}; "
        f"{machine_text(snap['machine'])}).{note}"
    )


def machine_text(m: str | dict[str, Any]) -> str:
    """The machine as written in a results file, or as `python -m research bench ... --json`
    records it."""
    if isinstance(m, str):
        return m
    text = f"{m.get('logical_cpus', '?')}-core {m.get('cpu', 'CPU')}, torch {m.get('torch', '?')}"
    if m.get("loadavg_before") and m.get("loadavg"):
        text += f", load average {m['loadavg_before'][0]} -> {m['loadavg'][0]} during the run"
    return text


def md_row(cells: list[str]) -> str:
    """One Markdown table row; an empty cell is written "| |"."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


MAX_RESULTS_BYTES = 64 << 20  # the largest results file is a few MB
# keys of a results file that hold a time or a rate: a number >= 0 (or null) wherever they are;
# a difference of two (an overhead, a delta) a number
_TIME = re.compile(r"(^|_)(ms|s|seconds|time|per_s|per_token)$")
_DIFFERENCE = re.compile(r"overhead|delta|diff|gain|saved")


# keys that hold a count (an int >= 0) or the run's provenance (a string) wherever they are
_COUNT = re.compile(r"^(steps|reps|warmup|tokens_per_step)$")
_TEXT = ("commit", "card", "command")


def _time_kind(key: Any) -> str:
    if isinstance(key, str) and _COUNT.search(key):
        return "count"
    if key in _TEXT:
        return "text"
    if not isinstance(key, str) or not _TIME.search(key):
        return ""
    return "difference" if _DIFFERENCE.search(key) else "time"


def read_results(path: Path) -> Any:
    """A results file the docs are generated from: tngram.readback's checked JSON (size before
    reading, UTF-8, strict: no NaN / Infinity, depth), an object, and every time or rate field
    (a key ending in _ms, _s, per_s, ...) a finite number >= 0 or null, every count (steps, reps,
    warmup, tokens_per_step) an int >= 0 or null, commit / card / command strings; named when
    not."""
    from tngram.readback import load_json

    snap = load_json(path, limit=MAX_RESULTS_BYTES)
    stack: list[tuple[Any, str, str]] = [(snap, "", "")]  # (value, field, its time key's kind)
    while stack:
        o, at, kind = stack.pop()
        if kind == "text" and not isinstance(o, str):
            raise TngramError(f"{path}: field {at} must be a string, got {o!r:.40}")
        if isinstance(o, (dict, list)):
            for k, v in o.items() if isinstance(o, dict) else enumerate(o):
                field = f"{at}.{k}".lstrip(".") if isinstance(k, str) else f"{at}[{k}]"
                inherited = kind if kind in ("time", "difference") else ""  # not inside a count
                stack.append((v, field, _time_kind(k) or inherited))
        elif kind and kind != "text" and o is not None:
            number = isinstance(o, (int, float)) and not isinstance(o, bool)
            if kind == "count":
                number = number and isinstance(o, int)
            if not number or (kind in ("time", "count") and o < 0):
                what = {"time": "a time or rate >= 0", "count": "an int >= 0"}.get(kind, "a number")
                raise TngramError(f"{path}: field {at} must be {what}, got {o!r:.40}")
    return snap


def _num(v: Any, spec: str) -> str:
    """A finite number formatted by `spec` (a NaN, a string or a bad format code: one line)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TngramError(f"a number belongs in this cell, got {v!r:.40}")
    try:
        return format(v, spec).replace("-", MINUS)
    except ValueError as e:
        raise TngramError(f"bad format code {spec!r} for {v!r} ({e})") from None


def render_cell(value: Any, fmt: str = "") -> str:
    """One table cell. `value` is None (shown "–"), a string (shown as is; in a column with a
    format it must begin with a number), a finite number, a list of finite
    numbers (one per seed), or {"value": v, "bold": true}. `fmt` is a Python format spec
    (".4f", "+.4f", ",") or one of
      "params"          5683200 -> 5.68M
      "pct:SPEC"        0.582 -> 58.2% with SPEC ".1f"
      "mean_std:SPEC"   a list -> mean ± std (sample std; one value: the value alone)
      "list:SPEC"       a list -> the values joined by ", "
    Negative numbers use the minus sign U+2212."""
    if isinstance(value, dict):
        cell = render_cell(value.get("value"), fmt)
        return f"**{cell}**" if value.get("bold") else cell
    if value is None:
        return "–"
    if isinstance(value, str):  # a note in a number's column begins with its number
        if fmt and value and not re.match(r"[-+−]?\d", value):
            raise TngramError(
                f"a number belongs in this cell (format {fmt!r}), got {value!r:.40} (a note "
                "there must begin with the number it annotates)"
            )
        return value
    kind, _, spec = fmt.partition(":") if ":" in fmt else ("", "", fmt)
    if kind == "mean_std" or kind == "list":
        if not isinstance(value, list):
            raise TngramError(f"format {fmt!r} needs a list of numbers, got {value!r}")
        for i, v in enumerate(value):  # a seed that is not there is named, never averaged away
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TngramError(f"value {i + 1} of {len(value)} (one per seed) is {v!r:.40}")
        if kind == "list":
            return ", ".join(_num(v, spec) for v in value)
        m, s = mean_std(value)
        return (
            _num(m, spec) if len(value) == 1 else f"{_num(m, spec)} ± {_num(s, spec.lstrip('+'))}"
        )
    if isinstance(value, list):
        raise TngramError(f"a list cell needs the format mean_std:SPEC or list:SPEC, got {fmt!r}")
    if kind == "pct":
        return _num(100 * value, spec) + "%"
    if kind:
        raise TngramError(f"unknown cell format {fmt!r}")
    if fmt == "params":
        return fmt_params(value)
    return _num(value, fmt)


def render_table(snap: dict[str, Any]) -> str:
    cols = snap.get("columns")
    rows = snap.get("rows")
    if not isinstance(cols, list) or not isinstance(rows, list):
        raise TngramError("a 'table' results file needs a list 'columns' and a list 'rows'")
    heads = [c["header"] if isinstance(c, dict) else str(c) for c in cols]
    fmts = [c.get("fmt", "") if isinstance(c, dict) else "" for c in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        if len(row) != len(cols):
            raise TngramError(f"row {row!r} has {len(row)} cells for {len(cols)} columns")
        lines.append(md_row([render_cell(v, f) for v, f in zip(row, fmts)]))
    return "\n".join(lines)
