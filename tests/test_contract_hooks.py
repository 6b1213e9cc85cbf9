"""The memory contract's optional hooks are declared (tngram.memory.base) and used as declared:
a memory without row-sparse tables, or a model without memory, is refused in one line (exit 2,
nothing written) when optim.memory_update asks for sparse/rowwise, through the CLI and the API."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tngram.memory
from test_architecture import ToyBigram, ToyBigramConfig
from test_memory_contract import SMALL
from tngram.cli.main import main
from tngram.common import TngramError
from tngram.memory import memory_config_to_dict, register_memory
from tngram.memory.base import MemoryConfig, MemoryModule, RowSparse
from tngram.model.gpt import GPT
from tngram.optim.memory_update import set_sparse_grads
from tngram.train.recipes import get_recipe, resolve_config

PKG = Path(__file__).resolve().parents[1] / "tngram"
HOOKS = ("link_layers", "sparse_grad", "fused", "moved_fields", "row_sparse", "injection")


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(tngram.memory, "_registered", {})
    register_memory(ToyBigramConfig)


def test_every_hook_is_declared_with_its_default():
    assert MemoryConfig.moved_fields == {} and MemoryConfig.row_sparse is False
    assert MemoryConfig.link_layers.__doc__ and MemoryConfig.row_sparse_problem.__doc__
    assert RowSparse.sparse_grad is False and RowSparse.__doc__
    toy = ToyBigramConfig()  # a memory that declares none of them gets every default
    assert toy.link_layers([]) is None and toy.moved_fields == {}
    assert "model.memory.kind=toy" in toy.row_sparse_problem()
    assert memory_config_to_dict(toy) == {"kind": "toy", "width": 8, "pad_id": 0}


def test_no_caller_probes_a_hook_with_getattr_or_hasattr():
    # getattr(x, "hook"...), hasattr(type(m), "hook"): one level of nested parentheses
    probe = re.compile(r"(getattr|hasattr)\((?:[^()]|\([^()]*\))*?[\"'](%s)[\"']" % "|".join(HOOKS))
    assert probe.search('if hasattr(type(m), "sparse_grad"):')  # the form it replaced
    assert probe.search('getattr(getattr(m, "config", None), "fused", True)')
    found = [
        f"{p.relative_to(PKG)}:{i}"
        for p in PKG.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_row_sparse_on_the_config_matches_the_module(kind):
    cfg = SMALL[kind]
    m = cfg.build(d_model=16, vocab_size=40)
    assert cfg.row_sparse is isinstance(m, RowSparse) is True and cfg.row_sparse_problem() == ""
    assert not isinstance(ToyBigramConfig().build(d_model=4, vocab_size=9), RowSparse)


def test_tngram_unfused_says_what_to_set():
    cfg = replace(SMALL["tngram"], fused=False)
    assert "model.memory.fused=true" in cfg.row_sparse_problem()
    with pytest.raises(TngramError, match="model.memory.fused=true"):
        resolve_config("mini-tngram", ["model.memory.fused=false", "optim.memory_update=rowwise"])


def _cli(args: list[str], capsys) -> tuple[int, str]:
    rc = main(args)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("mode", ["sparse", "rowwise"])
def test_cli_refuses_row_sparse_on_a_model_without_memory(mode, tmp_path, capsys):
    out = tmp_path / "run"
    rc, err = _cli(
        ["train", "mini-raw", "--set", f"optim.memory_update={mode}", "--out", str(out)], capsys
    )
    assert rc == 2 and not out.exists()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"optim.memory_update={mode} needs a model with memory" in lines[0]
    assert "'mini-raw'" in lines[0]


def test_cli_refuses_catchup_on_a_model_without_memory(tmp_path, capsys):
    rc, err = _cli(
        [
            "train",
            "mini-raw",
            "--set",
            "optim.memory_update=sparse",
            "--set",
            "optim.memory_catchup=true",
            "--out",
            str(tmp_path / "r"),
        ],
        capsys,
    )
    assert rc == 2 and "needs a model with memory" in err


def test_cli_refuses_row_sparse_on_a_memory_without_it(toy, tmp_path, capsys):
    out = tmp_path / "run"
    rc, err = _cli(
        [
            "train",
            "mini-raw",
            "--set",
            "model.memory.kind=toy",
            "--set",
            "model.memory_layers=1",
            "--set",
            "optim.memory_update=sparse",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 2 and not out.exists()
    assert "model.memory.kind=toy does not provide" in err and "optim.memory_update=dense" in err
    # dense is fine, and the toy memory still resolves
    cfg = resolve_config("mini-raw", ["model.memory.kind=toy", "model.memory_layers=1"])
    assert isinstance(cfg.model.memory, ToyBigramConfig)


def test_the_tngram_command_refuses_it_as_users_run_it(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tngram",
            "train",
            "mini-raw",
            "--set",
            "optim.memory_update=rowwise",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and not out.exists()
    assert "optim.memory_update=rowwise needs a model with memory" in p.stderr


def test_python_api_refuses_at_construction_and_on_the_module(toy):
    raw = get_recipe("mini-raw")
    with pytest.raises(TngramError, match="optim.memory_update=sparse needs a model with memory"):
        replace(raw, optim=replace(raw.optim, memory_update="sparse"))
    with_toy = resolve_config("mini-raw", ["model.memory.kind=toy", "model.memory_layers=1"])
    with pytest.raises(TngramError, match="kind=toy does not provide"):
        replace(with_toy, optim=replace(with_toy.optim, memory_update="rowwise"))
    # a model built by hand: set_sparse_grads names the module that cannot
    torch.manual_seed(0)
    model = GPT(replace(with_toy.model, n_layer=2, n_embd=16, n_head=2, n_kv_head=1))
    assert isinstance(model.blocks[1].memory, ToyBigram)
    assert isinstance(model.blocks[1].memory, MemoryModule)
    with pytest.raises(TngramError, match="ToyBigram does not provide"):
        set_sparse_grads(model, True)
    assert set_sparse_grads(model, False) == []


def test_memory_table_lr_on_a_model_without_memory_is_refused(tmp_path, capsys):
    rc, err = _cli(["train", "mini-raw", "--set", "optim.memory_table_lr=0.2", "--out",
                    str(tmp_path / "r")], capsys)
    assert rc == 2 and "optim.memory_table_lr=0.2 needs a model with memory" in err
    # the recipe's own value round-trips (--print-config of a raw recipe)
    assert resolve_config("mini-raw", ["optim.memory_table_lr=none"]).optim.memory_table_lr is None


def test_compare_leaves_memory_only_settings_out_of_its_raw_run():
    from tngram.experiments.runner import RunSpec, _overridden

    items = ("optim.memory_update=rowwise", "optim.memory_table_lr=0.2", "optim.matrix_lr=0.02")
    raw = _overridden(RunSpec("raw-s0", get_recipe("mini-raw"), {"method": "raw"}), items)
    tn = _overridden(RunSpec("tngram-s0", get_recipe("mini-tngram"), {"method": "tngram"}), items)
    assert raw.config.optim.memory_update == "dense" and raw.config.optim.memory_table_lr is None
    assert raw.config.optim.matrix_lr == 0.02
    assert tn.config.optim.memory_update == "rowwise" and tn.config.optim.memory_table_lr == 0.2
    # a --set that gives the raw run a memory keeps the memory's settings
    both = _overridden(RunSpec("raw-s0", get_recipe("mini-raw"), {"method": "raw"}),
                       ("model.memory.kind=tngram", "model.memory.cp_rank=8") + items)
    assert both.config.model.memory.cp_rank == 8 and both.config.optim.memory_update == "rowwise"


def test_a_saved_raw_run_with_a_memory_only_setting_still_loads():
    """Runs saved before the refusal recorded optim.memory_update on a model without tables,
    where it did nothing: their config.json reads back as the dense run it was."""
    from tngram.train.config import TrainConfig

    d = get_recipe("mini-raw").to_dict()
    d["optim"].update(memory_update="rowwise", memory_catchup=True)
    cfg = TrainConfig.from_dict(d)
    assert cfg.optim.memory_update == "dense" and cfg.optim.memory_catchup is False
    assert cfg.to_dict() == get_recipe("mini-raw").to_dict()
