"""research.experiments.vocab_regime: each pair's Engram is the smallest budget at >= the other
memory's Δparams (counted on built modules), and the committed tables are what the generators
make from the results files they cite."""

from __future__ import annotations

import json
import pytest

from research.experiments import vocab_regime as VR
from tngram.model.gpt import GPT


@pytest.fixture
def no_data(monkeypatch):
    """The configs without building a dataset: (no folder, the V of "NAME@V")."""
    monkeypatch.setattr(VR, "corpus_data", lambda corpus: ("", int(corpus.split("@")[1])))


def built_delta(cfg) -> int:
    return GPT(cfg.model).memory_params()


def test_engram_is_the_smallest_budget_at_or_above_the_pair(no_data):
    tn = VR.tngram("default@4096", 27)
    target = VR.delta(tn)
    engram, budget = VR.engram_at("default@4096", target)
    assert VR.delta(engram) >= target
    smaller = VR.with_memory(engram, table_budget=(budget - 1,) * 4)
    assert VR.delta(smaller) < target
    assert built_delta(tn) == target                       # the analytic count is the module's


def test_queues_pair_each_run_with_its_engram_at_the_same_seed(no_data):
    for q in VR.QUEUES:
        specs = VR.raw_queue(q)
        for s, e in zip(specs[0::2], specs[1::2]):
            assert e.tags["family"] == "engram" and s.tags["family"] != "engram"
            same = ("corpus", "seed_index")
            assert [s.tags[k] for k in same] == [e.tags[k] for k in same]
            assert e.tags["delta"] >= s.tags["delta"]
            assert s.config.run.seed == e.config.run.seed


def test_committed_tables_are_the_generators_output():
    committed = json.loads((VR.RESULTS / "which-memory.json").read_text())
    assert VR.which_memory(VR.RESULTS / "vocab-regime.json") == committed
    table = json.loads((VR.RESULTS / "vocab-regime.json").read_text())["rows"]
    assert [r for r in table if r[0] == "map (mini)"] == sorted(
        VR.map_rows(), key=lambda r: (r[1], r[4]))
    pairs = json.loads((VR.RESULTS / "pareto-vs-engram.json").read_text())["rows"]
    default_976 = next(r for r in pairs if r[:3] == ["default", "TN-gram", "976 vs 11300"])
    row = next(r for r in table if r[0] == "map (mini)" and r[3] == 976 and r[5] == "default")
    assert row[8] == default_976[7] and row[9] == default_976[8]


def test_v32768_hsum_is_the_recipes_memory_at_its_budget(no_data):
    from tngram.train.recipes import get_recipe

    cfg = VR.hsum("default@32768", VR.HSUM_BUDGET)
    recipe = get_recipe("mini-tngram-hsum")
    assert cfg.model.memory == recipe.model.memory             # R 64, summed, hashed 2..5, 3929
    assert cfg.model.vocab_size == 32768
    assert cfg.optim.memory_table_lr == recipe.optim.memory_table_lr == 0.2
    assert (cfg.run.dtype, cfg.optim.memory_update) == ("fp32", "sparse")


def test_pairs_table_reads_v32768_pairs_by_seed(no_data, tmp_path):
    """Two finished runs of queue q3 make one row: R/V from the hsum variant's R 64 over V 32768
    (the table's 4 decimals), and the difference of the two summaries' val losses."""
    hs, eng = VR.raw_queue("q3")[:2]
    for spec, loss, dp in ((hs, 6.25, 111), (eng, 6.5, 222)):
        d = tmp_path / "runs" / spec.label
        d.mkdir(parents=True)
        summary = {"val_loss": loss, "val_bpb": loss / 2, "delta_params": dp}
        (d / "summary.json").write_text(json.dumps(summary))
    (row,) = VR.pairs_table(tmp_path)
    assert row[:6] == ["default@32768", "TN-gram sum + hashed", "3929", round(64 / 32768, 4),
                       f"Engram {eng.tags['size']}", 1]
    assert row[6:9] == [111, 222, 6.25 - 6.5]
    (new,) = VR.new_rows(tmp_path)
    assert new[1:4] == [32768, "TN-gram sum + hashed", 64]


def test_v32768_cost_rows_are_their_rates_over_a_full_run():
    """Each timed V 32768 run's full-run estimate is the recipe's schedule (256 steps of its
    global_batch_tokens, 4,096) at the timed tokens/s, plus its start-up and evaluation time."""
    from tngram.train.recipes import get_recipe

    snap = json.loads((VR.RESULTS / "vocab-32768-cost.json").read_text())
    cfg = get_recipe("mini-engram")
    step_tokens = cfg.data.global_batch_tokens
    assert (step_tokens, cfg.schedule.steps) == (4096, VR.FULL_STEPS)
    assert {r[0] for r in snap["rows"]} == {"TN-gram sum + hashed", "TN-gram hashed rows", "Engram"}
    for _, _, _, steps, rate, _, outside, hours in snap["rows"]:
        assert steps == VR.TIMED_STEPS
        assert hours == pytest.approx((256 * step_tokens / rate + outside) / 3600)
    assert snap["dataset"]["vocab_size"] == 32768


def test_a_point_on_two_corpora_gets_a_pooled_row(no_data, tmp_path):
    """q3's hsum pair on default (seed 0) and q5's on literature (seeds 0, 1): a row per corpus and
    a pooled one whose mean and seed count are those of all three differences."""
    pairs = VR.raw_queue("q3")[:2] + VR.raw_queue("q5")
    losses = [6.25, 6.5, 6.0, 5.9, 6.1, 6.05]        # diffs: -0.25, +0.1, +0.05
    for spec, loss in zip(pairs, losses):
        d = tmp_path / "runs" / spec.label
        d.mkdir(parents=True)
        summary = {"val_loss": loss, "val_bpb": loss / 2, "delta_params": 1}
        (d / "summary.json").write_text(json.dumps(summary))
    rows = {r[0]: r for r in VR.pairs_table(tmp_path)}
    assert set(rows) == {"default@32768", "literature@32768", "default+literature@32768"}
    assert rows["literature@32768"][5] == 2
    pooled = rows["default+literature@32768"]
    assert pooled[5] == 3 and pooled[8] == pytest.approx((-0.25 + 0.1 + 0.05) / 3)
    assert [r[5] for r in VR.new_rows(tmp_path) if r[5].startswith("default+")] == [
        "default+literature"]


def test_run_records_are_the_finished_runs_own_values(no_data, tmp_path):
    """Each finished run of the queues (here two of q3) is recorded with its summary's RUN_KEYS and
    nothing else; a queued run without a summary is absent."""
    hs, eng = VR.raw_queue("q3")[:2]
    for i, spec in enumerate((hs, eng)):
        d = tmp_path / "runs" / spec.label
        d.mkdir(parents=True)
        summary = {k: float(i + j) for j, k in enumerate(VR.RUN_KEYS)} | {"recipe": "x"}
        (d / "summary.json").write_text(json.dumps(summary))
    recs = VR.run_records(tmp_path)
    assert set(recs) == {hs.label, eng.label}
    assert recs[eng.label] == {k: float(1 + j) for j, k in enumerate(VR.RUN_KEYS)}
