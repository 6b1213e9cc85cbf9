"""The experiment sweeps build the runs the paper's figures need (no training here)."""

from __future__ import annotations

from research.experiments.common import with_data, with_memory
from research.experiments.sweeps import _ablation, _capacity, _ngram_order, _specs
from tngram.train.recipes import get_recipe, param_summary


def test_ngram_order_covers_N_2_to_8_for_both_memories():
    v = _ngram_order("cpu")
    assert sorted(t["N"] for _, m, _, t in v if m == "tngram") == list(range(2, 9))
    assert sorted(t["N"] for _, m, _, t in v if m == "engram") == list(range(2, 9))
    specs = _specs("mini", "/data", 1024, 2, None, v)
    assert len(specs) == 2 * len(v) and len({s.label for s in specs}) == len(specs)
    n5 = [s for s in specs if s.label == "tngram-N5-s1"][0]
    assert n5.config.model.memory.max_ngram == 5 and n5.config.run.seed == 1338


def test_capacity_ranks_match_engram_delta_params():
    """Each TN-gram rank is solved so its Δparams equals Engram's at one head count (±1 rank)."""
    v = _capacity("cpu", "mini", 1024)
    heads = [t["heads"] for _, m, _, t in v if m == "engram"]
    ranks = [t["cp_rank"] for _, m, _, t in v if m == "tngram"]
    assert heads == [1, 2, 4, 8, 16] and len(ranks) == 5
    en, tn = get_recipe("mini-engram"), get_recipe("mini-tngram")
    for h, r in zip(heads, ranks):
        d_en = param_summary(with_memory(en, n_head_per_ngram=h))["delta_params"]
        d_tn = param_summary(with_memory(tn, cp_rank=r))["delta_params"]
        per_rank = param_summary(with_memory(tn, cp_rank=r + 1))["delta_params"] - d_tn
        assert abs(d_tn - d_en) <= per_rank


def test_ablation_variants_switch_exactly_one_component_each():
    v = _ablation("cpu")
    kinds = {t["variant"]: mem for _, _, mem, t in v if t["N"] == 5}
    assert kinds["full"] == {"max_ngram": 5, "dilation": None}
    assert kinds["no-rmsnorm"]["use_norm"] is False
    assert kinds["no-scales"]["learn_scales"] is False
    assert kinds["no-absorption"]["use_absorption"] is False
    cfg = with_memory(with_data(get_recipe("mini-tngram"), "/d", 1024), **kinds["no-absorption"])
    assert cfg.model.memory.use_absorption is False and cfg.model.memory.max_ngram == 5
