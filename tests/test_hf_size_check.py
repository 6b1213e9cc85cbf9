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
from tngram.hf.size_check import (  # noqa: E402
    TARGET_RATIO,
    MemorySizeWarning,
    VocabularyRegimeWarning,
    memory_size,
    regime_note,
    warn_if_large,
)
from tngram.memory.tngram import TNGramConfig  # noqa: E402
from tngram.memory.tngram_variants import TNGramVariantConfig  # noqa: E402


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
    cfg = TNGramVariantConfig(max_ngram=3, cp_rank=8, share_factors=True)
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


@pytest.mark.parametrize("kind", ["engram", "oe"])
def test_large_table_memory_warns_with_a_config_that_fits(kind):
    """Engram and Over-Encoding get a config to copy (the warning read "use scale table_budget /
    n_embed_per_ngram by about 0.05"): the largest table_budget (each order) / table_rows whose
    memory stays within a tenth of the model."""
    from tngram.memory.engram import EngramConfig
    from tngram.memory.overencoding import OverEncodingConfig

    vocab = 8192
    model = large_vocab_model(vocab)
    params = n_params(model)
    if kind == "engram":
        cfg = EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=8)
        field = "table_budget"
        make = lambda b: dataclasses.replace(cfg, table_budget=(b, b))  # noqa: E731
    else:
        cfg, field = OverEncodingConfig(max_ngram=3, slice_dim=4), "table_rows"
        make = lambda b: dataclasses.replace(cfg, table_rows=b)  # noqa: E731
    ids = () if cfg.injection == "embedding" else (1,)
    with pytest.warns(MemorySizeWarning, match=rf"use {type(cfg).__name__}\({field}=") as rec:
        add_memory(model, cfg, layers=(1,))
    msg = str(rec[0].message)
    b = int(msg.split(f"{field}=")[1].lstrip("(").split(",")[0].split(")")[0])
    fits = lambda b: memory_size(make(b), 32, vocab, ids)[0]  # noqa: E731
    assert fits(b) <= TARGET_RATIO * params < fits(b + 1) and "scale" not in msg


def test_small_memory_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemorySizeWarning)
        add_memory(tiny_model("llama"), MEMORIES["tngram"], layers=(0, 2))


def large_vocab_model(vocab: int):
    from hf_tiny import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.vocab_size = vocab
    return AutoModelForCausalLM.from_config(cfg).eval()


def hashed_size(r: int, vocab: int, ids) -> int:
    from tngram.memory.tngram_hashed import TNGramHashedConfig

    return memory_size(TNGramHashedConfig(max_ngram=3, cp_rank=r, factor_rows=r), 32, vocab, ids)[0]


def test_tngram_at_32k_names_engram_and_hashed_rows_that_fit():
    """A paper TN-gram within the model's size at V 32,768 (R/V < 0.25) still gets one line saying
    what was measured at that R/V and what to use: Engram, or hashed factor rows at the largest
    cp_rank = factor_rows within a tenth of the model."""
    model = large_vocab_model(32768)
    params = n_params(model)
    with pytest.warns(VocabularyRegimeWarning, match=r"R/V = 0.00049.*EngramConfig") as rec:
        add_memory(model, TNGramConfig(max_ngram=3, cp_rank=16), layers=(1,))
    msg = str(rec[0].message)
    r = int(msg.split("TNGramHashedConfig(cp_rank=")[1].split(",")[0])
    assert f"factor_rows={r})" in msg and "vocab-regime.json" in msg
    assert hashed_size(r, 32768, (1,)) <= TARGET_RATIO * params < hashed_size(r + 1, 32768, (1,))
    assert r * r >= 32768  # k = 2 quotient-remainder rows: every token its own pair


def test_too_large_tngram_at_128k_says_both_in_one_warning():
    model = large_vocab_model(131072)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warn_if_large(model, TNGramConfig(max_ngram=3, cp_rank=1024), 32, 131072, (1,))
    assert [type(w.message) for w in rec] == [MemorySizeWarning]
    msg = str(rec[0].message)
    assert "TNGramConfig(cp_rank=" in msg and "131,072-token vocabulary" in msg
    assert "TNGramHashedConfig(cp_rank=" in msg


def test_small_vocabulary_has_no_regime_note():
    assert regime_note(TNGramConfig(max_ngram=3, cp_rank=8), 32, 4096, (1,), 10**6) == ""
