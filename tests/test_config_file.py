"""`tngram train --config FILE` (TOML / YAML, the keys of --set), --print-config round trips,
a memory added to any recipe through the config, and --set on compare / experiment."""

from __future__ import annotations

import json

import pytest

from test_train_support import MEMORY_SETS, TINY_SETS, one_thread, tiny_data  # noqa: F401
from tngram.cli import main
from tngram.common import TngramError
from tngram.train.recipes import get_recipe, recipe_names
from tngram.train.recipes import resolve_config
from tngram.train.config_file import config_to_toml, load_config_file


def _toml_of(sets: list[str], recipe: str | None = None) -> str:
    """The --set items as a TOML file (nested tables), written independently of config_to_toml."""
    tables: dict[str, list[str]] = {}
    sets = [f"{k}={v}" for k, v in dict(i.split("=", 1) for i in sets).items()]   # the last value wins
    for item in sets:
        key, value = item.split("=", 1)
        sec, _, name = key.rpartition(".")
        v = value if value.replace(".", "").replace("-", "").replace("e", "").isdigit() else json.dumps(value)
        if "," in value or sec == "model" and name == "memory_layers":
            v = "[" + value + "]"
        tables.setdefault(sec, []).append(f"{name} = {v}")
    head = [f'recipe = "{recipe}"'] if recipe else []
    return "\n".join(head + [f"[{sec}]\n" + "\n".join(lines) for sec, lines in tables.items()]) + "\n"


def test_toml_file_equals_the_same_set_items(tmp_path):
    sets = TINY_SETS + MEMORY_SETS + ["model.memory.cp_rank=16", "optim.matrix_lr=0.02", "run.compile=false"]
    f = tmp_path / "c.toml"
    f.write_text(_toml_of(sets, "mini-tngram"))
    assert resolve_config(None, [], config_file=str(f)) == resolve_config("mini-tngram", sets)
    # --set wins over the file; a RECIPE argument wins over the file's recipe
    cfg = resolve_config("mini-tngram", ["optim.matrix_lr=0.03"], config_file=str(f))
    assert cfg.optim.matrix_lr == 0.03 and cfg.model.n_layer == 2


def test_yaml_file_with_nested_memory_and_null(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("recipe: mini-raw\nmodel:\n  memory:\n    kind: tngram\n    cp_rank: 32\n"
                 "  memory_layers: [1, 2]\ndata:\n  val_tokens: null\nschedule:\n  steps: 40\n")
    cfg = resolve_config(None, [], config_file=str(f))
    want = resolve_config("mini-raw", ["model.memory.kind=tngram", "model.memory.cp_rank=32",
                                       "model.memory_layers=1,2", "data.val_tokens=none", "schedule.steps=40"])
    assert cfg == want and cfg.model.memory.kind == "tngram" and cfg.data.val_tokens is None


@pytest.mark.parametrize("recipe", recipe_names())
def test_print_config_round_trips(recipe, tmp_path, capsys):
    assert main(["train", recipe, "--print-config", "--set", "data.dir=/some/where"]) == 0
    text = capsys.readouterr().out
    f = tmp_path / "p.toml"
    f.write_text(text)
    want = resolve_config(recipe, ["data.dir=/some/where"])
    assert resolve_config(None, [], config_file=str(f)) == want
    assert text == config_to_toml(want.to_dict(), recipe)


def test_memory_added_and_removed_through_the_config():
    raw = get_recipe("mini-raw")
    assert raw.model.memory is None
    for kind in ("tngram", "engram", "oe"):
        cfg = resolve_config("mini-raw", [f"model.memory.kind={kind}"])
        assert cfg.model.memory.kind == kind and cfg.model.memory == type(cfg.model.memory)()
    cfg = resolve_config("mini-tngram", ["model.memory.kind=none"])
    assert cfg.model.memory is None and cfg.model.n_embd == get_recipe("mini-tngram").model.n_embd
    # switching kind resets to that kind's defaults; the same kind keeps the recipe's values
    tn = get_recipe("mini-tngram").model.memory
    assert resolve_config("mini-tngram", ["model.memory.kind=tngram"]).model.memory == tn


@pytest.mark.parametrize("text,needles", [
    ("[optim]\nnope = 1\n", ["c.toml", "unknown config key 'optim.nope'", "optim.matrix_lr"]),
    ("[optim]\nmatrix_lr = \"fast\"\n", ["c.toml", "optim.matrix_lr expects a float"]),
    ("[run]\ncompile = 1\n", ["c.toml", "run.compile expects bool"]),
    ("[model.memory]\ncp_rank = 8\n", ["has no memory module", "model.memory.kind"]),
    ("[optim\n", ["c.toml", "not valid TOML"]),
    ("recipe = 3\n", ["recipe must be a recipe name"]),
])
def test_bad_config_files_fail_with_one_line(text, needles, tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text(text)
    rc = main(["train", "mini-raw", "--config", str(f), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err
    assert not (tmp_path / "run").exists()


def test_config_file_errors(tmp_path):
    with pytest.raises(TngramError, match="file not found"):
        load_config_file(tmp_path / "none.toml")
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(TngramError, match=r"\.toml, \.yaml"):
        load_config_file(tmp_path / "c.ini")
    with pytest.raises(TngramError, match="name a RECIPE"):
        resolve_config(None, [])
    with pytest.raises(FileNotFoundError):        # user errors are also the matching built-in
        load_config_file(tmp_path / "none.toml")


def test_steps_sets_the_schedule_and_stop_after_keeps_it():
    base = get_recipe("mini-tngram")
    cfg = resolve_config("mini-tngram", [], steps=64)
    assert cfg.schedule.steps == 64
    assert cfg.schedule.warmdown_steps == max(1, int(64 * base.schedule.warmdown_steps / base.schedule.steps))
    assert resolve_config("mini-tngram", ["schedule.steps=10"], steps=64).schedule.steps == 10  # --set last


def test_train_with_config_runs(tiny_data, tmp_path):  # noqa: F811
    f = tmp_path / "tiny.toml"
    sets = TINY_SETS + MEMORY_SETS + ["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"]
    f.write_text(_toml_of(sets, "mini-raw"))
    assert main(["train", "--config", str(f), "--data", str(tiny_data), "--out", str(tmp_path / "run"),
                 "--no-progress", "--set", "model.memory.kind=tngram", "--set", "model.memory.cp_rank=8"]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["memory"]["kind"] == "tngram" and saved["model"]["memory"]["cp_rank"] == 8
    assert saved["schedule"]["steps"] == 2 and saved["data"]["dir"] == str(tiny_data)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_set_on_compare_and_experiment_fails_before_work(tmp_path, capsys):
    from research.cli import main as lab_main
    for run, cmd in ((main, ["compare"]), (lab_main, ["experiment", "capacity"])):
        rc = run([*cmd, "--out", str(tmp_path / "o"), "--set", "optim.nope=1"])
        assert rc == 2 and "unknown config key 'optim.nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_run_all_applies_set_to_every_run():
    from tngram.experiments.runner import with_overrides
    raw, tn = get_recipe("mini-raw"), get_recipe("mini-tngram")
    items = ["optim.matrix_lr=0.01", "model.memory.cp_rank=8"]
    assert with_overrides(raw, items).optim.matrix_lr == 0.01
    assert with_overrides(raw, items).model.memory is None           # memory keys skip raw runs
    assert with_overrides(tn, items).model.memory.cp_rank == 8
