"""The public modules and configs import from the package root, lazily (PEP 562 __getattr__).

`from tngram import TNGram` must give the very class of tngram.memory.tngram (not a copy or a
wrapper), and `import tngram` alone must not load torch (tests/test_layering.py checks that in a
fresh process; here the names are checked to load their module only when asked for).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tngram

ROOT = Path(__file__).resolve().parents[1]

WHERE = {   # name -> the module that defines it (written out here, independently of tngram._LAZY)
    "TNGram": "tngram.memory.tngram", "TNGramConfig": "tngram.memory.tngram",
    "TNGramVariantConfig": "tngram.memory.tngram_variants",
    "Engram": "tngram.memory.engram", "EngramConfig": "tngram.memory.engram",
    "OverEncoding": "tngram.memory.overencoding", "OverEncodingConfig": "tngram.memory.overencoding",
    "GatedFusion": "tngram.memory.gating", "GPT": "tngram.model.gpt", "GPTConfig": "tngram.model.gpt",
}


@pytest.mark.parametrize("name", sorted(WHERE))
def test_root_name_is_the_defining_class(name):
    assert getattr(tngram, name) is getattr(importlib.import_module(WHERE[name]), name)
    assert name in tngram.__all__ and name in dir(tngram)


def test_from_import_and_star_import():
    from tngram import GPT, GPTConfig, TNGramConfig   # noqa: F401
    ns: dict = {}
    exec("from tngram import *", ns)
    assert set(WHERE) <= set(ns)
    assert ns["TNGramConfig"] is TNGramConfig


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        tngram.NotAThing   # noqa: B018
    assert not hasattr(tngram, "tngram_memory")


def test_names_load_their_module_only_on_first_use():
    """In a fresh process: after `import tngram` the memory module is not loaded; asking for
    tngram.TNGramConfig loads it (and only then torch)."""
    code = ("import sys, json, tngram; a = 'tngram.memory.tngram' in sys.modules; "
            "cfg = tngram.TNGramConfig; b = 'tngram.memory.tngram' in sys.modules; "
            "print(json.dumps([a, b, cfg.__module__]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [False, True, "tngram.memory.tngram"]


def test_a_root_config_builds_a_working_memory():
    """The README way: a config and a model from the root, one forward of the right shape."""
    import torch
    gpt = tngram.GPT(tngram.GPTConfig(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, vocab_size=64,
                                      sequence_len=16, memory=tngram.TNGramConfig(max_ngram=2, cp_rank=8),
                                      memory_layers=(1,)))
    ids = torch.randint(1, 64, (2, 16))
    assert gpt(ids).shape == (2, 16, 64)
    assert isinstance(gpt.blocks[1].memory, tngram.TNGram)
