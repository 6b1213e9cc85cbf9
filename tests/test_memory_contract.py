"""The memory contract (tngram.memory.base): every memory config and module follows it."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from tngram.common import TngramError
from tngram.memory import memory_config_classes, memory_config_from_dict, memory_config_to_dict
from tngram.memory.base import MemoryConfig, MemoryModule
from tngram.memory.engram import EngramConfig
from tngram.memory.overencoding import OverEncodingConfig
from tngram.memory.tngram import TNGramConfig
from tngram.memory.tngram_hashed import TNGramHashedConfig
from tngram.memory.tngram_variants import TNGramVariantConfig
from tngram.model.gpt import GPTConfig
from tngram.train.config import TrainConfig, apply_overrides

SMALL = {"tngram": TNGramConfig(max_ngram=3, cp_rank=4),
         "engram": EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=8, pad_id=0),
         "oe": OverEncodingConfig(max_ngram=3, pad_id=0),
         "tngram-hashed": TNGramHashedConfig(max_ngram=3, cp_rank=4, factor_rows=5, n_hashes=2,
                                             combine="sum"),
         "tngram-variant": TNGramVariantConfig(max_ngram=3, cp_rank=4, order_combine="sum",
                                               kv_rank=3, hash_orders=(3,), hash_heads=2,
                                               hash_embed=4, hash_budget=7)}


def test_registry_kinds_and_class_attributes():
    classes = memory_config_classes()
    assert set(classes) >= {"tngram", "engram", "oe"}
    for kind, cls in classes.items():
        assert issubclass(cls, MemoryConfig) and cls.kind == kind
        assert cls.injection in ("block", "embedding")
        assert "kind" not in {f.name for f in fields(cls)}      # a class attribute, not a field


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_build_is_keyword_only_and_param_count_is_exact(kind):
    cfg = SMALL[kind]
    with pytest.raises(TypeError):
        cfg.build(16, 40)                                         # keyword-only
    kw = dict(d_model=16, vocab_size=40, layer_id=3, layer_ids=(1, 3))
    m = cfg.build(**kw)
    assert isinstance(m, MemoryModule)
    assert sum(p.numel() for p in m.parameters()) == cfg.param_count(**kw)
    # defaults: one layer, layer 0
    m0 = cfg.build(d_model=16, vocab_size=40)
    assert sum(p.numel() for p in m0.parameters()) == cfg.param_count(d_model=16, vocab_size=40)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_tables_and_controls_are_disjoint_parameters_of_the_module(kind):
    m = SMALL[kind].build(d_model=16, vocab_size=40)
    own = {id(p) for p in m.parameters()}
    tables = {id(p) for p in m.table_parameters()}
    controls = {id(p) for p in m.control_parameters()}
    assert tables and tables <= own and controls <= own and not tables & controls
    assert all(p.dim() == 2 for p in m.table_parameters()) or kind.startswith("tngram")  # (N, V, R)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_vocabulary_check(kind):
    cfg = SMALL[kind]
    with pytest.raises(TngramError, match="pad_id"):
        type(cfg)(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "pad_id": 40}).build(
            d_model=16, vocab_size=40)


@pytest.mark.parametrize("kind,field,bad,expect", [
    ("tngram", "cp_rank", 0, "[1, "), ("tngram", "max_ngram", 33, "[2, 32]"),
    ("tngram", "norm_eps", 0.0, "> 0"), ("tngram", "prune_energy_tol", float("nan"), "finite"),
    ("engram", "n_head_per_ngram", 0, "[1, 1024]"), ("engram", "seed", -1, "[0, "),
    ("engram", "table_budget", (5, 0), "ints in [1, "),
    ("oe", "n_slices", 2000, "[1, 1024]"), ("oe", "table_rows", 0, "[1, "),
    ("tngram-hashed", "factor_rows", 0, "[1, "), ("tngram-hashed", "n_hashes", 17, "[1, 16]")])
def test_generic_field_ranges_at_construction(kind, field, bad, expect):
    cls = type(SMALL[kind])
    with pytest.raises(TngramError, match=f"model.memory.{field} must be") as e:
        cls(**{field: bad})
    assert expect in str(e.value)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_serialised_dict_has_kind_first_and_round_trips(kind):
    cfg = SMALL[kind]
    d = memory_config_to_dict(cfg)
    assert list(d)[0] == "kind" and d["kind"] == kind
    assert list(d)[1:] == [f.name for f in fields(cfg) if f.name in d]   # field order
    assert memory_config_from_dict(json.loads(json.dumps(d))) == cfg


def test_memory_settings_are_applied_together():
    """cp_rank below the default min_cp_rank is valid once min_cp_rank is lowered too."""
    cfg = TrainConfig(name="t", model=GPTConfig(vocab_size=64, memory=TNGramConfig()))
    sets = ["model.memory.prune_at_step=3", "model.memory.cp_rank=4", "model.memory.min_cp_rank=2"]
    mem = apply_overrides(cfg, sets).model.memory
    assert (mem.prune_at_step, mem.cp_rank, mem.min_cp_rank) == (3, 4, 2)
    with pytest.raises(TngramError, match=r"model.memory.cp_rank=4.*min_cp_rank"):
        apply_overrides(cfg, sets[:2])
    with pytest.raises(TngramError, match=r"pad_id"):
        apply_overrides(cfg, ["model.memory.pad_id=64"])     # the vocabulary check


def test_reshape_step_is_declared_by_the_memory():
    assert TNGramConfig(prune_at_step=3).reshape_step() == 3 and TNGramConfig().reshape_step() == 0
    assert EngramConfig().reshape_step() == 0 and OverEncodingConfig().reshape_step() == 0
    cfg = TrainConfig(name="t", model=GPTConfig(vocab_size=64, memory=TNGramConfig()))
    with pytest.raises(TngramError, match=r"model.memory.prune_at_step > 0 .*memory_update=dense"):
        apply_overrides(cfg, ["model.memory.prune_at_step=3", "optim.memory_update=sparse"])


def test_register_memory_refuses_non_memories():
    from tngram.memory import register_memory
    with pytest.raises(TngramError, match="MemoryConfig"):
        register_memory(dict)
