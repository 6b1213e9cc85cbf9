"""`python -m research experiment adaptive-rank`: run list (priority order, pruning settings) and the goal check."""

from __future__ import annotations

import pytest

from tngram.common import TngramError
from research.experiments.adaptive_rank import adaptive_specs, report_body


def test_specs_priority_order_and_pruning_settings(tmp_path):
    specs = adaptive_specs("mini", str(tmp_path), 1024, seeds=2, steps=None, ranks=(128, 704, 352))
    assert [s.label for s in specs] == [
        "adaptive-R704-s0", "fixed-R704-s0", "fixed-R352-s0", "fixed-R128-s0",
        "adaptive-R704-s1", "fixed-R704-s1", "fixed-R352-s1", "fixed-R128-s1"]
    a, f = specs[0].config.model.memory, specs[2].config.model.memory
    assert (a.cp_rank, a.prune_at_step, a.prune_energy_tol, a.min_cp_rank) == (704, 100, 0.1, 8)
    assert (f.cp_rank, f.prune_at_step) == (352, 0)
    assert specs[4].config.run.seed == specs[0].config.run.seed + 1
    # a shorter schedule prunes at the same share of it: round(64 * 100 / 256) = 25
    short = adaptive_specs("mini", str(tmp_path), 1024, seeds=1, steps=64, ranks=(32,))
    assert short[0].config.model.memory.prune_at_step == 25
    with pytest.raises(TngramError, match="ranks"):
        adaptive_specs("mini", str(tmp_path), 1024, seeds=1, steps=None, ranks=(0,))


def _row(variant, R, seed, loss, dp, t, ranks=None):
    return {"variant": variant, "start_rank": R, "seed": seed, "val_loss": loss, "delta_params": dp,
            "train_time_s": t, "prune_at_step": 100, **({"cp_ranks": ranks} if ranks else {})}


def test_goal_check_against_the_best_fixed_rank():
    fixed = [_row("fixed", 352, s, 3.35, 4e6, 100) for s in (0, 1)] + \
            [_row("fixed", 704, s, 3.33, 8e6, 150) for s in (0, 1)]
    # adaptive: +0.004 nats, 4.4M = 55 % of 8M, 160 s = 1.07x -> every part met
    good = [_row("adaptive", 704, s, 3.334, 4.4e6, 160, [300, 310]) for s in (0, 1)]
    body, series = report_body(fixed + good)
    assert "best fixed R = 704" in body and "+0.0040 nats" in body and "goal met" in body
    assert "55% of 8.00M" in body and "1.07x" in body and "| 0 | 300, 310 |" in body
    assert series["fixed R"] == [(4.0, 3.35, 0.0), (8.0, 3.33, 0.0)]
    # 0.006 nats worse: the loss part fails, so does the goal
    bad = [_row("adaptive", 704, s, 3.336, 4.4e6, 160, [300, 310]) for s in (0, 1)]
    body, _ = report_body(fixed + bad)
    assert "val loss: adaptive 3.3360 vs 3.3300, difference +0.0060 nats (goal <= +0.005): NOT met" in body
    assert "goal NOT met" in body
