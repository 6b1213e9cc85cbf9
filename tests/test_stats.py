"""Paired significance (tngram.report.stats) against hand-derived values, and the report table."""

from __future__ import annotations

import json
import math

import pytest

from tngram.report.stats import paired_stats, sign_flip_p, sign_test_p


def test_paired_t_against_closed_form_df2():
    # d = 1, 2, 3: mean 2, sd 1, t = 2 / (1/sqrt 3) = 2 sqrt 3 with 2 degrees of freedom.
    # Student t with 2 df has CDF F(t) = 1/2 + t / (2 sqrt(t^2 + 2)), so the two-sided
    # p = 1 - t / sqrt(t^2 + 2) and the 0.975 quantile is q = 0.95 sqrt(2 / (1 - 0.95^2)).
    s = paired_stats([1.0, 2.0, 3.0])
    t = 2 * math.sqrt(3)
    assert s.n == 3 and s.mean == pytest.approx(2.0) and s.sd == pytest.approx(1.0)
    assert s.t_p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    q = 0.95 * math.sqrt(2 / (1 - 0.95 ** 2))                                   # 4.3027
    assert s.ci_low == pytest.approx(2 - q / math.sqrt(3), rel=1e-9)
    assert s.ci_high == pytest.approx(2 + q / math.sqrt(3), rel=1e-9)
    assert (s.wins, s.losses) == (0, 3)


def test_sign_test_exact_binomial():
    assert sign_test_p([0.1, 0.2, 0.3]) == pytest.approx(2 / 8)                 # 2 * (1/2)^3
    assert sign_test_p([-1, -2, -3, -4, -5]) == pytest.approx(2 / 32)
    # 4 positive of 5: two-sided P = P(X<=1) + P(X>=4) = 2 * (1 + 5) / 32
    assert sign_test_p([1, 2, 3, 4, -5]) == pytest.approx(12 / 32)
    assert sign_test_p([0.0, 0.0, 1.0]) == pytest.approx(1.0)                  # zeros dropped: n = 1


def test_sign_flip_permutation_enumerated_by_hand():
    # |1+2+3| = 6 is reached only by all-plus and all-minus of the 8 patterns
    assert sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    # d = 1, -2, 3, 4 (|sum| 6): a pattern negating a subset of |d| with sum S has |10 - 2S|,
    # >= 6 iff S <= 2 or S >= 8: {}, {1}, {2}, {2,3,4}, {1,3,4}, {1,2,3,4} -> 6 of 16
    assert sign_flip_p([1.0, -2.0, 3.0, 4.0]) == pytest.approx(6 / 16)
    # above exact_max it samples; a large consistent effect still gets a tiny p
    assert sign_flip_p([1.0] * 20, exact_max=16) < 1e-3


def test_significance_table_per_corpus_and_pooled():
    from tngram.report.compare import significance_table

    def rows(diffs):
        out = []
        for i, d in enumerate(diffs):
            out += [{"method": "engram", "seed": i, "val_loss": 3.0}, {"method": "tngram", "seed": i, "val_loss": 3.0 + d}]
        return out

    md = significance_table({"a": rows([-0.01, -0.02, -0.03]), "b": rows([0.01, 0.02])})
    lines = [ln for ln in md.splitlines() if ln.startswith("| TN-gram − Engram")]
    assert [ln.split(" | ")[1] for ln in lines] == ["a", "b", "**pooled**"]
    a, b, pooled = (ln.split(" | ") for ln in lines)
    assert a[2] == "3" and a[3] == "-0.0200" and a[-1].strip(" |") == "3 / 0"
    assert b[2] == "2" and b[3] == "+0.0150"
    assert pooled[2] == "5" and pooled[3] == "-0.0060"                          # (-0.06 + 0.03) / 5


def test_report_compare_several_folders(tmp_path, capsys):
    from research.cli import main

    for corpus, d in (("c1", 0.01), ("c2", -0.02)):
        for seed in (0, 1):
            for m, loss in (("engram", 3.0), ("tngram", 3.0 + d * (seed + 1))):
                run = tmp_path / corpus / "runs" / f"{m}-s{seed}"
                run.mkdir(parents=True)
                (run / "summary.json").write_text(json.dumps({"val_loss": loss, "val_bpb": 1.0, "train_loss": 3.1, "tokens_per_s": 1000.0}))
                (run / "config.json").write_text(json.dumps({"run": {"seed": 1337 + seed}}))
    assert main(["report", "compare", str(tmp_path / "c1"), str(tmp_path / "c2")]) == 0
    out = capsys.readouterr().out
    assert "| TN-gram − Engram | c1 | 2 | +0.0150 |" in out
    assert "| TN-gram − Engram | **pooled** | 4 | -0.0075 |" in out                # (0.03 - 0.06) / 4
