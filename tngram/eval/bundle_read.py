"""Reading a CORE task bundle in the standard layout (nanochat/DCLM): core.yaml read with
PyYAML, eval_meta_data.csv's random baselines, eval_data/**.jsonl records checked per task type.
Every failure is one error naming the offending file (and line). Building one is eval/bundle.py."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError, iter_jsonl, read_text_utf8
from tngram.eval.tasks import MC, SCHEMA, TASK_TYPES


@dataclass(frozen=True)
class BundleTask:
    """One `icl_tasks` entry of a bundle's core.yaml, joined with its random baseline."""

    label: str
    uri: str
    task_type: str
    shots: int
    delimiter: str
    baseline: float  # percent
    path: Path  # the jsonl file


@dataclass(frozen=True)
class Bundle:
    root: Path
    tasks: tuple[BundleTask, ...]
    stamp: dict[str, Any] | None  # tngram_bundle.json if present

    def describe(self) -> dict[str, Any]:
        s = self.stamp or {}
        return {
            "path": str(self.root),
            "flavor": s.get("flavor", "external (no tngram stamp)"),
            "builder_version": s.get("builder_version"),
            "n_tasks": len(self.tasks),
            "labels": [t.label for t in self.tasks],
            "not_built": s.get("not_built", {}),
            "partial": s.get("partial", {}),
        }


STAMP_FILE = "tngram_bundle.json"


def parse_core_yaml(text: str, path: str | Path = "core.yaml") -> list[dict[str, Any]]:
    """The `icl_tasks:` list of a core.yaml (nanochat/DCLM layout), read with PyYAML's safe loader.
    Other top-level keys are ignored; each entry's fields are checked by the caller."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TngramError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict) or "icl_tasks" not in doc:
        raise TngramError(f"{path}: no top-level 'icl_tasks:' list")
    items = doc["icl_tasks"]
    if not items:
        raise TngramError(f"{path}: 'icl_tasks:' is empty")
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise TngramError(f"{path}: 'icl_tasks:' must be a list of task entries ('- label: ...')")
    return items


def _task_from_entry(entry: dict[str, Any], k: int, path: Path) -> tuple[str, str, str, int, str]:
    label = entry.get("label")
    name = f"{path}: task #{k + 1}" + (f" ({label!r})" if label else "")
    for key in ("label", "dataset_uri", "icl_task_type", "num_fewshot"):
        if entry.get(key) is None:
            raise TngramError(f"{name} has no '{key}'")
    ttype = entry["icl_task_type"]
    if ttype not in TASK_TYPES:
        raise TngramError(
            f"{name} has unknown icl_task_type {ttype!r} (expected one of {', '.join(TASK_TYPES)})"
        )
    shots = entry["num_fewshot"]
    if isinstance(shots, list):
        if len(shots) != 1:
            raise TngramError(f"{name}: num_fewshot must hold one value, got {shots}")
        shots = shots[0]
    if not isinstance(shots, int) or shots < 0:
        raise TngramError(f"{name}: num_fewshot must be a non-negative integer, got {shots!r}")
    delim = entry.get("continuation_delimiter")
    delim = " " if delim is None else str(delim)
    return str(label), str(entry["dataset_uri"]), ttype, shots, delim


def read_baselines(path: Path) -> dict[str, float]:
    """'Eval Task' -> 'Random baseline' (percent) from eval_meta_data.csv."""
    if not path.is_file():
        raise MissingFileError(f"{path}: missing (the bundle's random baselines)")
    reader = csv.DictReader(io.StringIO(read_text_utf8(path), newline=""))
    cols = reader.fieldnames or []
    if "Eval Task" not in cols or "Random baseline" not in cols:
        raise TngramError(f"{path}: needs columns 'Eval Task' and 'Random baseline', has {cols}")
    out: dict[str, float] = {}
    for n, row in enumerate(reader, start=2):
        label = (row.get("Eval Task") or "").strip()
        b = (row.get("Random baseline") or "").strip()
        if not label:
            continue
        try:
            out[label] = float(b)
        except ValueError:
            raise TngramError(
                f"{path}: line {n}: random baseline {b!r} of {label!r} is not a number"
            ) from None
    return out


def load_bundle(bundle_dir: str | Path) -> Bundle:
    """Parse and check a bundle's task list, baselines and file presence (one error, naming the
    file)."""
    root = Path(bundle_dir).expanduser()
    if not root.is_dir():
        raise MissingFileError(
            f"{root}: bundle folder does not exist (build one with `tngram eval build-bundle`)"
        )
    core = root / "core.yaml"
    if not core.is_file():
        raise MissingFileError(f"{core}: missing (not a CORE bundle folder?)")
    entries = parse_core_yaml(read_text_utf8(core), core)
    baselines = read_baselines(root / "eval_meta_data.csv")
    tasks: list[BundleTask] = []
    seen: set[str] = set()
    for k, entry in enumerate(entries):
        label, uri, ttype, shots, delim = _task_from_entry(entry, k, core)
        if label in seen:
            raise TngramError(f"{core}: task {label!r} is listed twice")
        seen.add(label)
        if label not in baselines:
            raise TngramError(
                f"{root / 'eval_meta_data.csv'}: no 'Random baseline' row for task {label!r}"
            )
        data = root / "eval_data" / uri
        if not data.is_file():
            raise MissingFileError(f"{data}: missing (dataset_uri of task {label!r} in {core})")
        tasks.append(BundleTask(label, uri, ttype, shots, delim, baselines[label], data))
    stamp = None
    if (root / STAMP_FILE).is_file():
        try:
            stamp = json.loads((root / STAMP_FILE).read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise TngramError(f"{root / STAMP_FILE}: not valid JSON") from None
    return Bundle(root, tuple(tasks), stamp)


def _check_record(rec: Any, ttype: str) -> str | None:
    """Why a record does not fit its task type, or None."""
    if not isinstance(rec, dict):
        return "not a JSON object"

    def strs(v: Any) -> bool:
        return isinstance(v, list) and len(v) >= 2 and all(isinstance(x, str) for x in v)

    if ttype == MC:
        if not isinstance(rec.get("query"), str):
            return "'query' missing or not a string"
        if not strs(rec.get("choices")):
            return "'choices' must be a list of >= 2 strings"
        opts = len(rec["choices"])
    elif ttype == SCHEMA:
        if not strs(rec.get("context_options")):
            return "'context_options' must be a list of >= 2 strings"
        if not isinstance(rec.get("continuation"), str):
            return "'continuation' missing or not a string"
        opts = len(rec["context_options"])
    else:
        for key in ("context", "continuation"):
            if not isinstance(rec.get(key), str):
                return f"'{key}' missing or not a string"
        if not rec["continuation"].strip():
            return "'continuation' is empty"
        return None
    gold = rec.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < opts:
        return f"'gold' must be an integer in [0, {opts}), got {gold!r}"
    return None


def load_task_data(bundle: Bundle, task: BundleTask) -> list[dict[str, Any]]:
    """All records of a task's jsonl, validated for its type."""
    out: list[dict[str, Any]] = []
    for n, rec in iter_jsonl(task.path):
        why = _check_record(rec, task.task_type)
        if why:
            raise TngramError(
                f"{task.path}: line {n}: {why} (task {task.label!r}, {task.task_type})"
            )
        out.append(rec)
    if not out:
        raise TngramError(f"{task.path}: no records (task {task.label!r})")
    return out
