"""Pay for the memory with the backbone: model.mlp_hidden (backwards compatible), iso_backbone
against the meta-device parameter count and a hand count, and the specs of issue 40's views
(token-indexed families on the Δparams map, every family at the raw GPT's total parameters)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import research.experiments.pareto as P
from tngram.common import TngramError
from research.experiments.pareto import iso_backbone, points_within_step
from tngram.memory.per_layer_embedding import PerLayerEmbeddingConfig
from tngram.memory.stem import StemConfig
from tngram.model.gpt import GPT, GPTConfig, param_counts

TINY = GPTConfig(
    vocab_size=50,
    n_layer=2,
    n_embd=32,
    n_head=2,
    n_kv_head=1,
    sequence_len=16,
    memory_layers=(0, 1),
)


def total(cfg: GPTConfig) -> int:
    return param_counts(cfg)["total_params"]


def test_mlp_hidden_default_is_bit_identical_and_absent_from_config_json():
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, sequence_len=16)
    explicit = replace(cfg, mlp_hidden=cfg.mlp_mult * cfg.n_embd)
    torch.manual_seed(0)
    a = GPT(cfg).state_dict()
    torch.manual_seed(0)
    b = GPT(explicit).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "mlp_hidden" not in cfg.to_dict() and explicit.to_dict()["mlp_hidden"] == 64
    narrow = replace(cfg, mlp_hidden=48)
    assert GPTConfig.from_dict(narrow.to_dict()) == narrow
    assert GPT(narrow).blocks[0].mlp.fc.weight.shape == (48, 32)
    with pytest.raises(TngramError, match="mlp_hidden"):
        replace(cfg, mlp_hidden=-1).validate()


def test_iso_backbone_by_hand():
    """PLE P 8 in 2 layers: 2 x (50*8 + 2*32*8) = 1824 memory parameters; one unit of MLP width
    is 2 (fc, proj) x 32 x 2 blocks = 128 parameters, so the width must drop by >= 1824/128 =
    14.25 from 64: the largest multiple of 16 is 48, whose total is raw - 16*128 + 1824 =
    raw - 224."""
    cfg = replace(TINY, memory=PerLayerEmbeddingConfig(ple_dim=8))
    raw = total(replace(TINY, memory=None))
    iso = iso_backbone(cfg)
    assert iso.mlp_hidden == 48 and total(iso) == raw - 224
    assert iso_backbone(cfg, multiple=1).mlp_hidden == 49  # 64 - ceil(14.25)
    assert total(iso_backbone(cfg, multiple=1)) == raw - 15 * 128 + 1824


@pytest.mark.parametrize("family", list(P.ISO_SIZES))
def test_iso_points_keep_the_raw_total_and_use_the_largest_width(family):
    """Every ISO_SIZES point (meta-device counts): total <= the raw mini GPT's, and one more step
    of width (16) would exceed it; the memory is the family's at that size."""
    from research.experiments.common import base_recipe

    bases = {m: base_recipe("mini", m) for m in P.METHODS}
    raw = total(bases["raw"].model)
    widths = []
    for size in P.ISO_SIZES[family][2]:
        cfg = P.iso_config(family, size, bases).model
        assert cfg.memory is not None and total(cfg) <= raw
        assert total(replace(cfg, mlp_hidden=cfg.mlp_hidden + 16)) > raw
        assert cfg.mlp_hidden % 16 == 0 and cfg.mlp_hidden >= 16
        widths.append(cfg.mlp_hidden)
    assert widths == sorted(widths, reverse=True) and widths[0] < 256


def test_iso_backbone_refuses_a_memory_the_mlps_cannot_pay_for():
    cfg = replace(TINY, memory=StemConfig(hidden=256))
    with pytest.raises(TngramError, match="larger than the backbone's MLPs can pay for"):
        iso_backbone(cfg)


def test_token_family_sizes_span_the_common_range():
    """At mini, the token-indexed families land within 12% of the map's Δparams targets."""
    from research.experiments.common import base_recipe

    targets = (1.1e6, 2.2e6, 4.3e6, 8.7e6, 12.0e6)
    for fam, (method, knob, sizes) in P.TOKEN_SIZES.items():
        for size, target in zip(sizes, targets, strict=True):
            cfg = P.with_memory(base_recipe("mini", method), **{knob: size})
            delta = param_counts(cfg.model)["delta_params"]
            assert abs(delta - target) / target < 0.12, (fam, size, delta)


def test_view_specs(monkeypatch):
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 1024))
    specs = P.view_specs(["default", "code", P.VOCAB_CORPUS], "mini", 2, None)
    n_points = sum(len(v[2]) for v in P.TOKEN_SIZES.values()) + sum(
        len(v[2]) for v in P.ISO_SIZES.values()
    )
    assert len(specs) == len({s.label for s in specs}) == 2 * 2 * n_points
    assert {s.tags["corpus"] for s in specs} == {"default", "code"}
    iso = [s for s in specs if s.tags["view"] == "total"]
    assert {s.tags["family"] for s in iso} == {f"{f}-iso" for f in P.ISO_SIZES}
    assert all(s.config.model.mlp_hidden > 0 for s in iso)
    assert all(s.config.model.mlp_hidden == 0 for s in specs if s.tags["view"] == "params")
    assert P.view_specs(["default"], "paper-l9", 1, None) == []
    tuned = P.view_specs(["default"], "mini", 1, None, dict(P.TUNED_DEFAULT, oe=2.0))
    lr = {(s.tags["family"], s.tags["size"]): s.config.optim.memory_table_lr for s in tuned}
    base = P.base_recipe("mini", "engram").optim.tied_embed_lr
    assert lr[("engram-iso", 50)] == pytest.approx(4 * base)  # Engram's tuned x4
    assert lr[("tngram-sum-iso", 6)] == pytest.approx(2 * base)  # TN-gram's x2
    # the token-indexed families at their recipes' literature lr (research/PARETO.md): product-key
    # values 4x the embedding's (Lample et al. 2019: 1e-3 against 2.5e-4), STEM and PLE 1x
    assert lr[("pkm-iso", 11)] == lr[("pkm", 64)] == pytest.approx(4 * base)
    assert lr[("stem-iso", 24)] == lr[("stem", 432)] == pytest.approx(base)
    assert lr[("ple-iso", 12)] == lr[("ple", 216)] == pytest.approx(base)


def test_points_within_step():
    pts = [{"step_ms": 10.0}, {"step_ms": 12.6}, {"step_ms": None}, {"step_ms": 12.5}]
    assert points_within_step(pts, 10.0, 1.25) == [pts[0], pts[3]]


def test_report_keeps_iso_points_off_the_params_map_and_in_the_total_and_step_views():
    from research.experiments.pareto_report import COST_KEYS, POINT_COLUMNS, corpus_tables

    def point(family, size, delta, loss, step, view="params", width=256, total=592_144):
        return {
            "corpus": "default",
            "family": family,
            "size": size,
            "delta_params": delta,
            "val_loss": [loss],
            "val_bpb": [loss],
            "core": [],
            "seeds": [0],
            "loss": loss,
            "step_ms": step,
            "decode_ms_per_token": 1.0,
            "view": view,
            "mlp_width": width,
            "opt_state_bytes": {"memory": 0},
            "total_params": total,
            "rows_per_token": 2,
            "bytes_per_token": 8,
            "flops_per_token": 100,
        }

    pts = [
        point("raw", None, 0, 4.0, 10.0),
        point("pkm", 64, 1_097_728, 3.9, 20.0),
        point("pkm-iso", 11, -15_360, 3.95, 11.0, view="total", width=176, total=576_784),
    ]
    t = corpus_tables(pts, "default")
    assert [r[0] for r in t["points"]] == ["raw GPT", "product keys"]
    assert len(t["points"][0]) == len(POINT_COLUMNS)
    at = [c["header"] for c in POINT_COLUMNS].index("total params")
    assert t["points"][1][at : at + len(COST_KEYS)] == [592_144, 2, 8, 100]
    assert t["total"] == [
        ["raw GPT", 256, 592_144, [4.0], 0.0, None, None, 1.0, None],
        # one seed: its paired difference 3.95 - 4.0, no interval; step 11 / 10 ms; no CORE
        [
            "product keys, iso (11)",
            176,
            576_784,
            [3.95],
            pytest.approx(-0.05),
            None,
            "1/0",
            1.1,
            None,
        ],
    ]
    best_s = {r[0]: r[1] for r in t["best_step"]}
    assert best_s["≤ 1.25× raw"] == "product keys, iso (11)"
    assert best_s["≤ 2× raw"] == "product keys (64)"


def test_aggregate_keeps_the_view_and_width_of_collected_rows():
    """collect's rows -> aggregate -> corpus_tables, the path the report takes: an iso point
    (view "total") stays off the Δparams map and enters the "= total parameters" table."""
    from research.experiments.pareto_report import aggregate, corpus_tables

    def row_of(family, size, seed, loss, view="params", width=256, total=592_144):
        return {
            "corpus": "default",
            "family": family,
            "size": size,
            "seed": seed,
            "delta_params": total - 592_144,
            "total_params": total,
            "val_loss": loss,
            "val_bpb": loss,
            "opt_state_bytes": {"memory": 0},
            "core": None,
            "view": view,
            "mlp_width": width,
            "rows_per_token": 0,
            "bytes_per_token": 0,
            "flops_per_token": 1,
        }

    rows = [
        row_of("raw", None, 0, 4.0),
        row_of("raw", None, 1, 4.2),
        row_of("ple-iso", 24, 0, 3.9, "total", 208, 590_000),
        row_of("ple-iso", 24, 1, 4.0, "total", 208, 590_000),
    ]
    rows[2]["core"], rows[3]["core"] = 0.11, 0.13  # CORE of the iso point's two seeds
    # a larger size of the same family, listed first and with the smaller Δparams: the table
    # lists each family's sizes in ascending order all the same
    rows += [row_of("ple-iso", 36, 0, 3.8, "total", 64, 560_000)]
    bench = {"points": {"raw": {"step_ms": 10.0}, "ple-iso-24": {"step_ms": 12.0}}}
    bench["points"]["ple-iso-36"] = {"step_ms": 9.0}
    pts = aggregate(rows, bench)
    t = corpus_tables(pts, "default")
    assert [r[0] for r in t["points"]] == ["raw GPT"]  # the iso point is off the Δparams map
    # its loss minus the raw GPT's: (3.9 + 4.0) / 2 - (4.0 + 4.2) / 2 = -0.15
    # paired by seed: 3.9 - 4.0 = -0.1 and 4.0 - 4.2 = -0.2, mean -0.15, sd 0.0707; the 95%
    # t interval with 1 df: -0.15 +- 12.706 * 0.0707 / sqrt(2) = -0.15 +- 0.6353
    assert [r[0] for r in t["total"]] == [
        "raw GPT",
        "per-layer embeddings, iso (24)",
        "per-layer embeddings, iso (36)",
    ]
    row = t["total"][1]
    assert row[:4] == ["per-layer embeddings, iso (24)", 208, 590_000, [3.9, 4.0]]
    assert row[4] == pytest.approx(-0.15)
    assert row[5] == pytest.approx([-0.15 - 0.6353, -0.15 + 0.6353], abs=1e-3)
    assert row[6] == "2/0"
    assert row[7] == pytest.approx(1.2)  # step 12 ms over the raw GPT's 10 ms
    assert row[8] == [0.11, 0.13] and t["total"][0][8] is None  # CORE per seed; raw not scored
    # a seed the raw GPT lacks is left out of the pairing
    rows.append(row_of("ple-iso", 24, 2, 3.0, "total", 208, 590_000))
    t = corpus_tables(aggregate(rows, bench), "default")
    assert t["total"][1][4] == pytest.approx(-0.15) and t["total"][1][6] == "2/0"
