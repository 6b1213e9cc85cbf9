"""Config files for `tngram train --config FILE`: TOML (as torchtitan) or YAML, the keys of `--set`.

    recipe = "mini-raw"            # optional: the recipe to start from (a RECIPE argument wins)
    [schedule]
    steps = 200
    [model.memory]                 # add a memory to any recipe
    kind = "tngram"
    cp_rank = 64

Sections nest as tables (`[model.memory]`) or dotted keys (`model.memory.cp_rank = 64`). TOML has
no null: write "none" for an unset optional field (YAML's null works too). `--print-config` writes
this format (config_to_toml), and reading it back gives the same config.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError

MAX_DEPTH = 8  # config keys nest at most model.memory.field


def _load_toml(path: Path) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise TngramError(
                f"{path}: reading TOML on Python 3.10 needs `pip install tomli`"
            ) from None
    try:
        return tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise TngramError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        raise TngramError(f"{path}: nested too deeply (more than {MAX_DEPTH} levels)") from None


def _load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise TngramError(
            f"{path}: reading YAML needs PyYAML (`pip install pyyaml`); or use TOML"
        ) from None
    try:
        return yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        raise TngramError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise TngramError(f"{path}: nested too deeply (more than {MAX_DEPTH} levels)") from None


def _read_text(path: Path) -> str:
    """The config file as UTF-8 text: a regular file (a FIFO or device is refused, never waited
    on), at most 16 MiB; other encodings are one line naming the byte."""
    from tngram.safefs import read_text

    return read_text(path.resolve(), limit=16 << 20)


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def load_config_file(path: str | os.PathLike) -> tuple[str | None, list[tuple[str, Any]]]:
    """(recipe or None, [(dotted key, value)]) from a .toml/.yaml/.yml file. The memory kind
    comes first so the other model.memory.* keys apply to it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingFileError(f"--config {path}: file not found")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        data = _load_toml(path)
    elif suffix in (".yaml", ".yml"):
        data = _load_yaml(path)
    elif suffix == ".json":
        from tngram.readback import parse_json

        data = parse_json(_read_text(path), str(path))
    else:
        raise TngramError(f"--config {path}: expected a .toml, .yaml, .yml or .json file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TngramError(f"{path}: expected a table of config keys at the top level")
    from tngram.readback import depth

    if depth(data) > MAX_DEPTH:
        raise TngramError(
            f"{path}: nested too deeply (more than {MAX_DEPTH} levels); config keys are "
            f"at most section.field or model.memory.field"
        )
    data = dict(data)
    recipe = data.pop("recipe", None)
    if recipe is not None and not isinstance(recipe, str):
        raise TngramError(f"{path}: recipe must be a recipe name (a string), got {recipe!r}")
    items = _flatten(data)
    first = [kv for kv in items if kv[0] in ("model.memory", "model.memory.kind")]
    return recipe, first + [kv for kv in items if kv not in first]


def _toml_value(v: Any) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a TOML basic string is a JSON string


def config_to_toml(cfg_dict: dict[str, Any], recipe: str | None = None) -> str:
    """A resolved config (TrainConfig.to_dict()) as a TOML file `load_config_file` reads back.
    (Hand-written: the stdlib reads TOML but does not write it, and the format here is flat.)"""
    lines = [
        f"# tngram train --config FILE: the resolved "
        f"config{f' (from recipe {recipe})' if recipe else ''}"
    ]
    if recipe:
        lines.append(f"recipe = {_toml_value(recipe)}")
    lines.append(f"name = {_toml_value(cfg_dict['name'])}")
    tables: list[tuple[str, dict[str, Any]]] = []
    for sec in ("model", "optim", "schedule", "data", "run"):
        body = dict(cfg_dict[sec])
        if sec == "model":
            mem = body.pop("memory", None)
            if mem is None:
                body["memory"] = None
            tables.append(("model", body))
            if mem is not None:
                tables.append(("model.memory", mem))
        else:
            tables.append((sec, body))
    for name, body in tables:
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"
