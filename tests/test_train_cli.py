"""`tngram train` argument errors fail before any work, naming what is valid."""

from __future__ import annotations

import pytest

from test_train_support import one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.cli import main
from tngram.common import TngramError
from tngram.train.recipes import recipe_names
from tngram.train.recipes import resolve_config
from tngram.train.loop import train


def run_cli(args, capsys):
    rc = main(["train", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args,needles", [
    (["no-such-recipe"], ["unknown recipe 'no-such-recipe'", "mini-tngram", "paper-l9-raw"]),
    (["mini-raw", "--set", "optim.nope=1"], ["unknown config key 'optim.nope'", "optim.matrix_lr"]),
    (["mini-raw", "--set", "nope.x=1"], ["unknown config section 'nope'", "schedule.steps"]),
    (["mini-raw", "--set", "optim.matrix_lr=fast"], ["optim.matrix_lr expects a float, got 'fast'"]),
    (["mini-raw", "--set", "schedule.steps=1.5"], ["schedule.steps expects an int"]),
    (["mini-raw", "--set", "run.compile=maybe"], ["run.compile must be true, false or auto"]),
    (["mini-raw", "--set", "model.memory_layers=a,b"], ["model.memory_layers expects a comma-separated list of int"]),
    (["mini-raw", "--set", "model.memory.cp_rank=8"], ["has no memory module"]),
    (["mini-tngram", "--set", "model.memory.nope=8"], ["unknown config key 'model.memory.nope'",
                                                      "model.memory.cp_rank"]),
    (["mini-raw", "--set", "run.dtype=fp16"], ["run.dtype must be one of"]),
    (["mini-raw", "--set", "optim.beta2=1.5"], ["optim.beta2 must be in [0, 1)"]),
    (["mini-raw", "--set", "optim.matrix_lr"], ["section.field=value"]),
    (["mini-raw", "--steps", "0"], ["--steps must be >= 1"]),
])
def test_bad_arguments_fail_before_work(args, needles, tmp_path, capsys):
    out = tmp_path / "run"
    rc, err = run_cli([*args, "--out", str(out)], capsys)
    assert rc == 2
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists()  # nothing was written: no data, no model, no run folder


def test_overrides_apply_with_types():
    cfg = resolve_config("mini-tngram", ["optim.matrix_lr=0.02", "model.memory.cp_rank=64",
                                         "model.memory_layers=0,2", "data.val_tokens=none",
                                         "run.compile=true", "name=x"], data="/some/dir")
    assert cfg.optim.matrix_lr == 0.02 and cfg.model.memory.cp_rank == 64
    assert cfg.model.memory_layers == (0, 2) and cfg.data.val_tokens is None
    assert cfg.run.compile is True and cfg.name == "x" and cfg.data.dir == "/some/dir"
    assert set(recipe_names()) >= {"mini-raw", "mini-engram", "mini-tngram"}


def test_indivisible_global_batch_is_rejected(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, extra=["data.global_batch_tokens=600"])
    with pytest.raises(TngramError, match=r"data.global_batch_tokens \(600\) must be a multiple of .* = 256"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_vocab_mismatch_names_the_fix(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, extra=["model.vocab_size=1024"])
    with pytest.raises(TngramError, match="--set model.vocab_size=512"):
        train(cfg, tmp_path / "run")
