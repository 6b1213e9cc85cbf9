"""Config checked once (tngram.train.config, config_checks): every config object is checked when
it is made and never again (validate_config adds only the machine's state); each error still
names the field; an unknown key gets a "did you mean" in --set and in config files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tngram.common import TngramError
from tngram.memory.base import MemoryConfig
from tngram.train import config as config_mod
from tngram.train.config import DataConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig
from tngram.train.config import validate_config
from tngram.train.recipes import get_recipe, resolve_config


@pytest.fixture
def checked(monkeypatch):
    """Every (config object, what checked it) while the fixture is active; the objects are kept
    alive so that an id() is never reused."""
    seen: list[tuple[object, str]] = []
    orig_mem, orig_train = MemoryConfig.check, config_mod.check_train

    def mem_check(self):
        seen.append((self, "memory"))
        orig_mem(self)

    def train_check(cfg):
        seen.append((cfg, "train"))
        orig_train(cfg)

    monkeypatch.setattr(MemoryConfig, "check", mem_check)
    monkeypatch.setattr(config_mod, "check_train", train_check)
    return seen


def _once_each(seen) -> None:
    ids = [(id(o), what) for o, what in seen]
    assert len(ids) == len(set(ids)), "a config object was checked twice"


def test_cp_rank_is_checked_once_per_config_object(checked):
    cfg = resolve_config("mini-tngram", ["model.memory.cp_rank=8", "optim.matrix_lr=0.02"])
    _once_each(checked)
    mems = [o for o, what in checked if what == "memory"]
    # the overridden memory (cp_rank 8) was checked once, when it was made; the others are the
    # recipe's, built by get_recipe
    assert [m.cp_rank for m in mems if m is cfg.model.memory] == [8]
    assert {m.cp_rank for m in mems if m is not cfg.model.memory} == {352}
    n = len(checked)
    validate_config(cfg)  # what train() and the CLI call: nothing re-checked
    assert len(checked) == n


def test_each_section_checks_itself_when_made_naming_the_field():
    cases = [
        (lambda: OptimConfig(beta1=1.0), r"optim.beta1 must be in \[0, 1\), got 1.0"),
        (lambda: OptimConfig(matrix_lr=float("nan")), "optim.matrix_lr must be finite"),
        (lambda: ScheduleConfig(steps=0), "schedule.steps must be >= 1"),
        (lambda: DataConfig(micro_batch_seqs=0), "data.micro_batch_seqs must be >= 1"),
        (lambda: RunConfig(threads=-1), r"run.threads must be in \[0, 4096\]"),
        (lambda: RunConfig(dtype="fp8"), "run.dtype must be one of"),
    ]
    for make, msg in cases:
        with pytest.raises(TngramError, match=msg):
            make()


def test_cross_section_rules_are_checked_when_the_train_config_is_made():
    raw = get_recipe("mini-raw")
    with pytest.raises(TngramError, match="data.val_tokens must be none or >= model.sequence_len"):
        replace(raw, data=replace(raw.data, val_tokens=3))
    with pytest.raises(TngramError, match="optim.trainable=memory needs a model with memory"):
        TrainConfig(name="x", optim=OptimConfig(trainable="memory"))


def test_settings_apply_in_any_order_before_the_cross_checks():
    # catchup needs sparse/rowwise: the pair is accepted whichever comes first
    for order in (
        ["optim.memory_catchup=true", "optim.memory_update=sparse"],
        ["optim.memory_update=sparse", "optim.memory_catchup=true"],
    ):
        assert resolve_config("mini-tngram", order).optim.memory_catchup is True
    # a memory added after a memory-only setting
    cfg = resolve_config("mini-raw", ["optim.memory_update=rowwise", "model.memory.kind=tngram"])
    assert cfg.optim.memory_update == "rowwise"


@pytest.mark.parametrize(
    "key,want",
    [
        ("optim.matrx_lr", "optim.matrix_lr"),
        ("optm.matrix_lr", "optim.matrix_lr"),
        ("run.thread", "run.threads"),
        ("model.memory.cp_rnk", "model.memory.cp_rank"),
        ("matrix_lr", "optim.matrix_lr"),
    ],
)
def test_unknown_key_did_you_mean_in_set(key, want):
    with pytest.raises(TngramError, match=rf"'{key}' \(did you mean {want}\?\)"):
        resolve_config("mini-tngram", [f"{key}=1"])


def test_far_keys_get_no_guess():
    with pytest.raises(TngramError) as e:
        resolve_config("mini-tngram", ["optim.zzzzqqq=1"])
    assert "did you mean" not in str(e.value) and "valid keys in optim" in str(e.value)


def test_unknown_key_did_you_mean_in_a_config_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('recipe = "mini-tngram"\n[optim]\nmatrx_lr = 0.02\n')
    with pytest.raises(TngramError, match=r"run.toml: .*did you mean optim.matrix_lr\?"):
        resolve_config(None, [], config_file=str(f))


def test_unknown_recipe_did_you_mean():
    with pytest.raises(TngramError, match=r"unknown recipe 'mini-tngam' \(did you mean mini-tngram\?\)"):
        get_recipe("mini-tngam")
