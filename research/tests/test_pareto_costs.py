"""The machine-independent cost axes of a map point (pareto_report.point_costs) against hand
counts, one tiny config per family (d 32, 2 layers, V 50, T 16, GQA 2/1 heads, MLP 64)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from research.experiments.pareto_report import backbone_flops, point_costs
from tngram.memory.engram import EngramConfig
from tngram.memory.overencoding import OverEncodingConfig
from tngram.memory.per_layer_embedding import PerLayerEmbeddingConfig
from tngram.memory.product_key import ProductKeyConfig
from tngram.memory.stem import StemConfig
from tngram.memory.tngram import TNGramConfig
from tngram.model.gpt import GPTConfig, param_counts

RAW = GPTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, sequence_len=16,
                memory_layers=(0, 1))
# per block: q, o 2 x 32 x 32 = 2048 MACs; k, v (kv width 16) 2 x 32 x 16 = 1024; MLP 2 x 32 x 64
# = 4096; attention 2 x 32 x 8.5 (mean context of 16) = 544 -> 7712 MACs; 2 blocks + head 50 x 32
# = 1600 -> 17024 MACs = 34048 FLOPs
RAW_FLOPS = 34048
# GatedFusion at d 32, M 1, kernel 4: 2 x 2 x d_mem x 32 + 2 x 32 + 2 x 32 x 4 = 128 d_mem + 320


def test_backbone_by_hand():
    assert backbone_flops(RAW) == RAW_FLOPS
    assert point_costs(RAW) == {"rows_per_token": 0, "bytes_per_token": 0,
                                "flops_per_token": RAW_FLOPS, "total_params":
                                param_counts(RAW)["total_params"]}
    # MLP 48 wide: 2 blocks x 2 x 32 x 16 fewer MACs
    assert backbone_flops(replace(RAW, mlp_hidden=48)) == RAW_FLOPS - 2 * 2 * 2 * 32 * 16


@pytest.mark.parametrize("mem,rows,nbytes,flops", [
    # Engram N 3, 2 heads, E 8: (3-1) x 2 = 4 rows of 4 floats per layer; d_mem 16
    (EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=8, pad_id=0, kernel_size=4),
     2 * 4, 2 * 4 * 4 * 4, 2 * (128 * 16 + 320)),
    # TN-gram N 3, R 4, concat: 3 factor rows of 4; CP products 2 x 3 x 4 = 24; d_mem (3-1) x 4 = 8
    (TNGramConfig(max_ngram=3, cp_rank=4, kernel_size=4), 2 * 3, 2 * 3 * 4 * 4,
     2 * (24 + 128 * 8 + 320)),
    # product keys n 9, Kd 8, k 3, H 2: 6 value rows of 32; query 2*32*16 = 1024, keys
    # 2*2*9*8 = 288, candidates 2*9 = 18, weighted sum 2*2*3*32 = 384
    (ProductKeyConfig(n_keys=9, key_dim=8, topk=3, n_heads=2), 2 * 6, 2 * 6 * 32 * 4,
     2 * (1024 + 288 + 18 + 384)),
    # STEM F 24: 1 row of 24; gate and down 4 x 32 x 24 = 3072 + 24 products
    (StemConfig(hidden=24), 2, 2 * 24 * 4, 2 * (3072 + 24)),
    # PLE P 8 gated: 1 row of 8; proj 2*8*32 = 512, gate 512 + 8 products
    (PerLayerEmbeddingConfig(ple_dim=8), 2, 2 * 8 * 4, 2 * (512 + 512 + 8)),
    (PerLayerEmbeddingConfig(ple_dim=8, gated=False), 2, 2 * 8 * 4, 2 * 512),
])
def test_block_memories_by_hand(mem, rows, nbytes, flops):
    c = point_costs(replace(RAW, memory=mem))
    assert (c["rows_per_token"], c["bytes_per_token"]) == (rows, nbytes)
    assert c["flops_per_token"] == RAW_FLOPS + flops
    assert c["total_params"] == param_counts(replace(RAW, memory=mem))["total_params"]


def test_over_encoding_is_counted_once():
    """OE N 3, 2 slices: S = 4 slice tables of width 32 / 4 = 8, at the embedding (once):
    4 rows, 4 x 8 x 4 bytes, projections 2 x 4 x 8 x 32 = 2048 FLOPs."""
    c = point_costs(replace(RAW, memory=OverEncodingConfig(max_ngram=3, n_slices=2, pad_id=0)))
    assert (c["rows_per_token"], c["bytes_per_token"]) == (4, 128)
    assert c["flops_per_token"] == RAW_FLOPS + 2048


def test_a_memory_without_a_cost_model_gets_none():
    """A memory registered elsewhere (tests/test_architecture.py's kind of toy) leaves the three
    cost columns empty instead of failing the report."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(kw_only=True, frozen=True)
    class Toy(StemConfig):
        kind: ClassVar[str] = "toy-no-costs"

    c = point_costs(replace(RAW, memory=Toy(hidden=8)))
    assert (c["rows_per_token"], c["bytes_per_token"], c["flops_per_token"]) == (None,) * 3
    assert c["total_params"] == param_counts(replace(RAW, memory=Toy(hidden=8)))["total_params"]
