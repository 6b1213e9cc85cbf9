"""Parameter groups: every parameter in exactly one group, memory tables never in Muon, lrs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tngram.common import TngramError
from tngram.model.gpt import CONTROL_NAMES, GPT, GPTConfig
from tngram.optim.groups import assign_groups, build_param_groups, format_param_table
from tngram.train.recipes import get_recipe
from tngram.train.config import OptimConfig

TINY = GPTConfig(vocab_size=64, n_layer=4, n_embd=32, n_head=4, n_kv_head=2, sequence_len=32,
                 memory_layers=(1, 3))


def tiny_models() -> dict[str, GPT]:
    from dataclasses import replace

    from tngram.memory.engram import EngramConfig
    from tngram.memory.overencoding import OverEncodingConfig
    from tngram.memory.tngram import TNGramConfig
    mems = {"raw": None,
            "tngram": TNGramConfig(max_ngram=4, cp_rank=8),
            "engram": EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=16, pad_id=0),
            "oe": OverEncodingConfig(max_ngram=3, pad_id=0)}
    torch.manual_seed(0)
    return {k: GPT(replace(TINY, memory=m)) for k, m in mems.items()}


def memory_tables(model: GPT) -> set[int]:
    """Independently of the rules: the tensors that ARE lookup tables, found via module types."""
    from tngram.memory.engram import Engram
    from tngram.memory.overencoding import OverEncoding
    from tngram.memory.tngram import TNGram
    out = set()
    for m in model.modules():
        if isinstance(m, TNGram):
            out.add(id(m.factors))
        if isinstance(m, (Engram, OverEncoding)):
            out.add(id(m.table.weight))
    return out


@pytest.mark.parametrize("kind", ["raw", "tngram", "engram", "oe"])
def test_every_parameter_in_exactly_one_group(kind):
    model = tiny_models()[kind]
    groups = build_param_groups(model, OptimConfig())
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)), "a parameter is in two groups"
    assert set(ids) == {id(p) for p in model.parameters()}, "a parameter is in no group"
    muon = {id(p) for g in groups if g["optimizer"] == "muon" for p in g["params"]}
    tables = memory_tables(model)
    assert len(tables) == {"raw": 0, "tngram": 2, "engram": 2, "oe": 1}[kind]
    assert not tables & muon, "a memory table reached Muon"
    in_table_group = {id(p) for g in groups if g["group"] == "memory_table" for p in g["params"]}
    assert tables == in_table_group
    assert all(p.dim() == 2 for g in groups if g["optimizer"] == "muon" for p in g["params"])


def test_named_assignments():
    a = {}
    for m in tiny_models().values():
        a.update(assign_groups(m))
    expect = {
        "tok_emb.weight": "embed",
        "skip_weights": "scalar",
        "blocks.0.attn.c_q.weight": "muon", "blocks.0.mlp.fc.weight": "muon",
        "blocks.0.attn.proj.weight": "muon", "blocks.0.resid_mix": "scalar",
        "blocks.0.attn.q_gain": "scalar", "blocks.0.attn_scale": "scalar",
        "blocks.1.memory.factors": "memory_table", "blocks.1.memory.absorb": "scalar",
        "blocks.1.memory.log_scales": "scalar",
        "blocks.1.memory.table.weight": "memory_table",
        "blocks.1.memory.fusion.value_proj.weight": "muon",
        "blocks.1.memory.fusion.key_proj.0.weight": "muon",
        "blocks.1.memory.fusion.value_proj.bias": "scalar",
        "blocks.1.memory.fusion.norm_h": "scalar", "blocks.1.memory.fusion.norm_k": "scalar",
        "blocks.1.memory.fusion.conv.weight": "scalar",
        "blocks.1.memory.fusion.conv.norm_weight": "scalar",
        "embed_memory.table.weight": "memory_table", "embed_memory.proj.weight": "muon",
    }
    for name, group in expect.items():
        assert a[name] == group, (name, a[name])


def test_paper_l9_raw_split_matches_parameter_golf():
    """parameter-golf's optimiser split: Muon 16,515,072 / Adam embedding 524,288 / Adam scalars 20,552."""
    with torch.device("meta"):
        model = GPT(get_recipe("paper-l9-raw").model)
    counts = {g["group"]: sum(p.numel() for p in g["params"])
              for g in build_param_groups(model, OptimConfig())}
    assert counts == {"muon": 16_515_072, "embed": 524_288, "scalar": 20_552}


def test_group_learning_rates():
    model = tiny_models()["tngram"]
    lrs = {g["group"]: g["lr"] for g in build_param_groups(model, OptimConfig())}
    assert lrs == {"embed": 0.05, "memory_table": 0.05, "scalar": 0.04, "muon": 0.04}  # App. E
    lrs = {g["group"]: g["base_lr"] for g in build_param_groups(
        model, OptimConfig(memory_table_lr=0.1, matrix_lr=0.02))}
    assert lrs["memory_table"] == 0.1 and lrs["muon"] == 0.02 and lrs["embed"] == 0.05


# Which parameters are gains/scales/per-channel kernels, written out by name independently of the
# modules' control_parameters() declarations (the backbone's plus the memories' own).
CONTROL_LEAVES = CONTROL_NAMES + ("absorb", "log_scales", "norm_h", "norm_k", "norm_weight")


@pytest.mark.parametrize("kind", ["raw", "tngram", "engram", "oe"])
def test_scalar_group_is_controls_conv_kernels_and_1d(kind):
    model = tiny_models()[kind]
    groups = build_param_groups(model, OptimConfig())
    scalar = {n for g in groups if g["group"] == "scalar" for n in g["names"]}
    want = {n for n, p in model.named_parameters()
            if p.dim() < 2 or n.rsplit(".", 1)[-1] in CONTROL_LEAVES or n.endswith(".conv.weight")}
    assert scalar == want
    assert any(p.dim() == 2 for n, p in model.named_parameters() if n in scalar)  # 2-D gains too


def test_unknown_parameter_fails_loudly():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(4, 4)
            self.mystery = nn.Parameter(torch.zeros(3, 3))   # 2-D, not a Linear, no rule
    with pytest.raises(TngramError, match="mystery"):
        build_param_groups(Odd(), OptimConfig())


def test_table_printer_counts():
    model = tiny_models()["engram"]
    groups = build_param_groups(model, OptimConfig())
    text = format_param_table(groups)
    total = sum(p.numel() for p in model.parameters())
    assert f"{total:,}" in text.splitlines()[-1]
    for g in groups:
        assert g["group"] in text
