"""Analyses beyond the paper: n-gram keys and Engram collision statistics on a tiny dataset."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from test_train_support import tiny_config, tiny_data  # noqa: F401  (session fixture)
from research.experiments.analysis import collision_stats, ngram_keys


def test_ngram_keys_identify_ngrams_exactly():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 7, size=3000).astype(np.uint16)
    for n in (2, 3, 4):
        keys = ngram_keys(toks, n)
        # the same key <=> the same left-padded (pad 0) window, checked by brute force
        windows = [tuple(int(toks[t - k]) if t - k >= 0 else 0 for k in range(n)) for t in range(len(toks))]
        by_key = defaultdict(set)
        for k, w in zip(keys.tolist(), windows):
            by_key[k].add(w)
        assert all(len(v) == 1 for v in by_key.values())
        assert len(by_key) == len(set(windows))


def test_collision_stats_match_brute_force(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "mini-engram", extra=["model.memory.max_ngram=3",
                                                        "model.memory.n_head_per_ngram=2",
                                                        "model.memory.n_embed_per_ngram=16"])
    collision_stats(tmp_path, cfg, str(tiny_data))
    stats = json.loads((tmp_path / "collisions.json").read_text())["orders"]
    # brute force for order 2, head 0: distinct bigrams per bucket via the module's own hash
    from tngram.data.build import open_dataset
    from tngram.data.shards import read_shard
    import torch
    info = open_dataset(tiny_data)
    train = np.concatenate([np.asarray(read_shard(f)) for f in info.train_files])
    layers = tuple(cfg.model.memory_layers)
    module = cfg.model.memory.build(d_model=cfg.model.n_embd, vocab_size=cfg.model.vocab_size, layer_id=layers[0], layer_ids=layers)
    z = module.hash_ids(torch.from_numpy(train.astype(np.int64)).unsqueeze(0))[0].numpy()
    shares = []
    for head in (0, 1):                      # order 2 occupies columns 0..H-1
        buckets = defaultdict(set)
        for t in range(len(train)):
            buckets[int(z[t, head])].add((int(train[t - 1]) if t else 0, int(train[t])))
        distinct = {g for s in buckets.values() for g in s}
        shares.append(sum(len(s) for s in buckets.values() if len(s) >= 2) / len(distinct))
    assert stats["2"]["distinct"] == len(distinct)
    assert abs(stats["2"]["shared_per_head"] - sum(shares) / 2) < 1e-12


def test_paired_differences_pair_runs_by_seed():
    """TN-gram − Engram per seed, then mean ± std: seed 1 seen 3.30 - 3.40 = -0.10, unseen
    3.9 - 3.6 = +0.3; seed 2 seen -0.20, unseen +0.1 -> seen mean -0.15, std sqrt(0.005) = 0.0707;
    the raw run and an unpaired Engram seed are ignored."""
    from research.experiments.analysis import paired_differences
    rows = [{"method": "raw", "seed": 1, "label": "raw-s0"},
            {"method": "engram", "seed": 1, "label": "e1"}, {"method": "tngram", "seed": 1, "label": "t1"},
            {"method": "engram", "seed": 2, "label": "e2"}, {"method": "tngram", "seed": 2, "label": "t2"},
            {"method": "engram", "seed": 3, "label": "e3"}]
    runs = {"raw-s0": {"2": {"seen": 9.0, "unseen": 9.0}},
            "e1": {"2": {"seen": 3.40, "unseen": 3.6}}, "t1": {"2": {"seen": 3.30, "unseen": 3.9}},
            "e2": {"2": {"seen": 3.50, "unseen": 3.6}}, "t2": {"2": {"seen": 3.30, "unseen": 3.7}},
            "e3": {"2": {"seen": 0.0, "unseen": 0.0}}}
    out = paired_differences(rows, runs, [2])
    assert out["2"]["seen"][0] == pytest.approx(-0.15) and out["2"]["seen"][1] == pytest.approx(0.005 ** 0.5)
    assert out["2"]["unseen"][0] == pytest.approx(0.2) and out["2"]["unseen"][1] == pytest.approx(0.02 ** 0.5)
    assert paired_differences(rows[:2], runs, [2]) == {}
