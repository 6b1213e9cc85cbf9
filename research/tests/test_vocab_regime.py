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
