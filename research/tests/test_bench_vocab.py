"""`python -m research bench vocab` at a tiny vocabulary: every candidate runs, the optimiser-state bytes per
table parameter are the analytic ones, and the generated-block views render from the result."""

from __future__ import annotations

import pytest

from test_train_support import single_thread  # noqa: F401
from research.bench import vocab
from research.report.docblocks import render


@pytest.fixture(scope="module")
def result():
    with single_thread():
        return vocab.run((64,), reps=1, warmup=0, peak=False, say=lambda *a: None)


def test_every_candidate_runs_with_the_analytic_state_bytes(result):
    rows = {(r["model"], r["update"]): r for r in result["rows"]}
    assert set(rows) == {("raw", "dense")} | {(m, u) for m in ("engram", "tngram")
                                              for u in ("dense", "sparse", "rowwise")}
    cfg_e, cfg_t = vocab._config("engram", 64), vocab._config("tngram", 64)
    width = {"engram": cfg_e.model.n_embd // cfg_e.model.memory.n_head_per_ngram,   # head_dim
             "tngram": cfg_t.model.memory.cp_rank}                               # CP rank R
    for m in ("engram", "tngram"):
        n = rows[(m, "dense")]["table_params"]
        assert n > 0
        # Adam: exp_avg + exp_avg_sq (8 B/param) + its fp32 step tensor (4 B per table tensor)
        n_tables = len(vocab._config(m, 64).model.memory_layers)   # one table / factor tensor per layer
        assert rows[(m, "dense")]["state_bytes_per_table_param"] == pytest.approx(8 + 4 * n_tables / n)
        assert rows[(m, "sparse")]["state_bytes_per_table_param"] == 8      # LazyAdam: int step
        assert rows[(m, "rowwise")]["state_bytes_per_table_param"] == pytest.approx(4 + 4 / width[m])
        assert rows[(m, "rowwise")]["state_bytes_per_table_param"] <= 5
    assert all(r["step"]["median_s"] > 0 for r in result["rows"])
    assert rows[("raw", "dense")]["ratio_to_raw"] == 1.0


def test_vocab_block_views_render(result):
    snap = dict(result, kind="bench-vocab", command="python -m research bench vocab --vocabs 64", commit="abc1234")
    table = render(snap, "bench-vocab:table")
    assert table.count("\n| 64 |") == 7 and "Generated from `research/results/bench-vocab.json`" in table
    goals = render(snap, "bench-vocab:goals")
    assert "not run" in goals and "4.01 B" in goals                  # 32k / 128k rows absent here
