"""add_memory says how large a memory is against the model before building it: the meta-device
count equals the built memory's parameters, a memory larger than the model gets one
MemorySizeWarning, and the TN-gram cp_rank it suggests is the largest that stays within a
tenth of the model."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, tiny_model  # noqa: E402

from tngram.hf import add_memory, memory_modules  # noqa: E402
from tngram.hf.size_check import TARGET_RATIO, MemorySizeWarning, memory_size  # noqa: E402
from tngram.memory.tngram import TNGramConfig  # noqa: E402


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_meta_count_equals_the_built_memory(kind):
    model = tiny_model("llama")
    before = n_params(model)
    cfg = MEMORIES[kind]
    ids = () if cfg.injection == "embedding" else (0, 2)
    total, tables = memory_size(cfg, 32, 61, ids)
    add_memory(model, cfg, layers=(0, 2))
    assert total == n_params(model) - before
    built_tables = {id(p): p for m in memory_modules(model).values() for p in m.table_parameters()}
    assert tables == sum(p.numel() for p in built_tables.values())


def test_shared_factors_are_counted_once():
    model = tiny_model("llama")
    before = n_params(model)
    cfg = TNGramConfig(max_ngram=3, cp_rank=8, share_factors=True)
    total, _ = memory_size(cfg, 32, 61, (0, 2))
    add_memory(model, cfg, layers=(0, 2))
    assert total == n_params(model) - before


def test_large_memory_warns_with_a_size_that_fits():
    model = tiny_model("llama")
    params = n_params(model)
    cfg = TNGramConfig(max_ngram=3, cp_rank=1024)
    with pytest.warns(MemorySizeWarning, match=r"TNGramConfig\(cp_rank=(\d+)\)") as rec:
        add_memory(model, cfg, layers=(1,))
    msg = str(rec[0].message)
    assert f"model's {params:,}" in msg and "61-token vocabulary" in msg
    k = int(msg.split("cp_rank=")[1].split(")")[0])
    fits = lambda r: memory_size(dataclasses.replace(cfg, cp_rank=r), 32, 61, (1,))[0]  # noqa: E731
    assert 1 < k < 1024
    assert fits(k) <= TARGET_RATIO * params < fits(k + 1)  # the largest cp_rank within 10%


def test_small_memory_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemorySizeWarning)
        add_memory(tiny_model("llama"), MEMORIES["tngram"], layers=(0, 2))
