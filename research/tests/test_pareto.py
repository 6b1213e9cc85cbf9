"""`python -m research experiment pareto`: the front and budget tables against brute force, the optimiser-state
count against real optimisers, and the sweep's sizes against the common Δparams range."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from research.experiments import pareto as P
from research.experiments.pareto_report import best_under, optimizer_state_bytes, pareto_front


def _dominated(points, i):
    ci, li = points[i]
    return any((c <= ci and l <= li and (c < ci or l < li)) for j, (c, l) in enumerate(points) if j != i)


@pytest.mark.parametrize("seed", range(20))
def test_front_is_exactly_the_non_dominated_points(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    # small integer grid: ties in cost and in loss are common
    pts = [(float(rng.randint(0, 5)), float(rng.randint(0, 5))) for _ in range(n)]
    front = pareto_front(pts)
    brute = {i for i in range(n) if not _dominated(pts, i)}
    # exact duplicates: the front keeps one of them (the first), brute force keeps all copies
    dedup = {i for i in brute if all(pts[j] != pts[i] for j in range(i))}
    assert set(front) == dedup
    assert [pts[i][0] for i in front] == sorted(pts[i][0] for i in front)


@pytest.mark.parametrize("seed", range(10))
def test_best_under_is_the_lowest_loss_that_fits(seed):
    rng = random.Random(100 + seed)
    pts = [(rng.uniform(0, 10), rng.uniform(3, 4)) for _ in range(rng.randint(1, 9))]
    for cap in (-1.0, 2.5, 5.0, 11.0):
        fit = [(l, i) for i, (c, l) in enumerate(pts) if c <= cap]
        got = best_under(pts, cap)
        assert got == (min(fit)[1] if fit else None)


def _tiny(cfg):
    m = cfg.model
    return replace(cfg, model=replace(m, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, vocab_size=64,
                                      sequence_len=16, memory_layers=(0, 1) if m.memory else m.memory_layers,
                                      memory=m.memory))


@pytest.mark.parametrize("recipe,mem", [("mini-raw", {}), ("mini-engram", {"table_budget": (7, 7, 7, 7),
                                                                               "n_embed_per_ngram": 32}),
                                        ("mini-tngram", {"cp_rank": 8}), ("mini-oe", {"table_rows": 11})])
def test_optimizer_state_bytes_equal_what_the_trainer_optimisers_hold(recipe, mem):
    """Count by the rule (Adam 8 B, Muon 4 B per parameter) = bytes of the state tensors the
    trainer's own optimisers allocate after one step."""
    from research.experiments.common import base_recipe
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.optim.muon import Muon
    cfg = _tiny(base_recipe("mini", recipe.split("-")[1]))
    if mem:
        cfg = replace(cfg, model=replace(cfg.model, memory=replace(cfg.model.memory, **mem)))
    torch.manual_seed(0)
    model = GPT(cfg.model)
    groups = build_param_groups(model, cfg.optim)
    o = cfg.optim
    opts = [torch.optim.Adam([g for g in groups if g["optimizer"] == "adam"], betas=(o.beta1, o.beta2), eps=o.adam_eps)]
    muon = [g for g in groups if g["optimizer"] == "muon"]
    if muon:
        opts.append(Muon(muon, lr=o.matrix_lr, momentum=o.muon_momentum, nesterov=True, ns_steps=o.muon_ns_steps))
    # non-zero gradients everywhere (the zero-init value projections would leave tables gradient-free)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in opts:
        opt.step()
    held = sum(t.numel() * t.element_size() for opt in opts for st in opt.state.values()
               for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    got = optimizer_state_bytes(cfg)
    assert got["total"] == held
    # the memory's share = what the same backbone without the memory holds less
    bare = replace(cfg, model=replace(cfg.model, memory=None))
    assert got["memory"] == held - optimizer_state_bytes(bare)["total"]
    assert (got["memory"] > 0) == (cfg.model.memory is not None)


def test_sizes_span_one_common_delta_params_range():
    """At `mini`, every family's sizes land within 12% of the common targets 1.1, 2.2, 4.3, 8.7, 12 M
    (Δparams from the meta-device count; dense Δ = its total − the raw GPT's total)."""
    from research.experiments.common import base_recipe
    from tngram.train.recipes import param_summary
    bases = {m: base_recipe("mini", m) for m in ("raw", "engram", "tngram", "oe")}
    raw_total = param_summary(bases["raw"])["total_params"]
    targets = (1.1e6, 2.2e6, 4.3e6, 8.7e6, 12.0e6)
    for fam, (_, _, sizes) in P.SIZES.items():
        assert len(sizes) >= 4
        for size, target in zip(sizes, targets):
            cfg = P.family_config(fam, size, bases)
            delta = param_summary(cfg)["total_params"] - raw_total
            # dense: widths come in steps of 8; the hybrid's smallest sizes carry its fixed R 88 TN-gram part
            tol = {"dense": 0.24, "tngram-hybrid": 0.4}.get(fam, 0.12)
            assert abs(delta - target) / target < tol, (fam, size, delta)


def test_hsum_sizes_are_the_largest_budgets_within_engrams_delta():
    """Each `tngram-hsum` size pairs with the Engram size at the same index: its Δparams is <= Engram's,
    and one more hash row per head (budget + 1) would exceed it, so no size leaves parameters unused;
    at vocabulary 1024 (SIZES) and 8192 (VOCAB_SIZES)."""
    from research.experiments.common import base_recipe, with_data, with_memory
    from tngram.train.recipes import param_summary
    for vocab, sizes in ((1024, {f: v[2] for f, v in P.SIZES.items()}), (8192, P.VOCAB_SIZES)):
        bases = {m: with_data(base_recipe("mini", m), "/nonexistent", vocab) for m in ("raw", "engram", "tngram", "oe")}
        raw_total = param_summary(bases["raw"])["total_params"]
        delta = lambda cfg: param_summary(cfg)["total_params"] - raw_total  # noqa: E731
        for e_size, h_size in zip(sizes["engram"], sizes["tngram-hsum"], strict=True):
            engram = delta(P.family_config("engram", e_size, bases))
            cfg = P.family_config("tngram-hsum", h_size, bases)
            assert delta(cfg) <= engram < delta(with_memory(cfg, hash_budget=h_size + 1)), (vocab, e_size, h_size)


def test_vocabulary_variant_sizes_are_the_largest_within_their_reference():
    """At vocabulary 8192 each variant's size, index by index: lean takes TN-gram's R; sum and shared
    the largest R whose Δparams is <= TN-gram's (R + 1 would exceed it); the hybrid the largest
    hash_budget whose Δparams is <= Engram's (budget + 1 would exceed it)."""
    from research.experiments.common import base_recipe, with_data, with_memory
    from tngram.train.recipes import param_summary
    bases = {m: with_data(base_recipe("mini", m), "/nonexistent", 8192) for m in ("raw", "engram", "tngram", "oe")}
    raw_total = param_summary(bases["raw"])["total_params"]
    delta = lambda cfg: param_summary(cfg)["total_params"] - raw_total  # noqa: E731
    sizes = P.VOCAB_SIZES
    assert sizes["tngram-lean"] == sizes["tngram"]
    for i, (t_size, e_size) in enumerate(zip(sizes["tngram"], sizes["engram"], strict=True)):
        for fam, limit, knob in (("tngram-sum", delta(P.family_config("tngram", t_size, bases)), "cp_rank"),
                                 ("tngram-shared", delta(P.family_config("tngram", t_size, bases)), "cp_rank"),
                                 ("tngram-hybrid", delta(P.family_config("engram", e_size, bases)), "hash_budget")):
            size = sizes[fam][i]
            cfg = P.family_config(fam, size, bases)
            assert delta(cfg) <= limit < delta(with_memory(cfg, **{knob: size + 1})), (fam, size)


def test_longcat_preset_and_tuned_factors_reach_the_configs(monkeypatch):
    from research.experiments.common import base_recipe
    from research.experiments.evidence import table_lr
    bases = {m: base_recipe("mini", m) for m in ("raw", "engram", "tngram", "oe")}
    lc = P.family_config("longcat", 36000, bases).model.memory
    assert (lc.kind, lc.max_ngram, lc.n_slices, lc.average, lc.table_rows) == ("oe", 4, 4, True, 36000)
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 1024))
    specs = P.specs_for(["default"], "mini", 2, None, {**P.TUNED_DEFAULT, "oe": 0.5, "longcat": 0.5})
    # the map (2 seeds) + the confirmation's seeds 2..CONFIRM_SEEDS-1 of its pairs
    n_confirm = 2 * len(P.CONFIRM["size_indices"]) * (P.CONFIRM_SEEDS - 2)
    assert len({s.label for s in specs}) == len(specs) == 2 * (1 + 5 * len(P.SIZES)) + n_confirm
    recipe_lr = table_lr(bases["engram"])
    for s in specs:
        fam = s.tags["family"]
        want = {"engram": 4.0, "tngram": 2.0, "oe": 0.5, "longcat": 0.5, "tngram-lean": 2.0, "tngram-sum": 2.0,
                "tngram-shared": 2.0, "tngram-hybrid": 4.0, "tngram-hsum": 4.0}.get(fam)
        if want is not None:
            assert table_lr(s.config) == pytest.approx(recipe_lr * want)
        else:
            assert s.config.optim.memory_table_lr is None
    # seed-major order: every family's first size comes before any family's second size
    first = [s.tags["family"] for s in specs[:6]]
    assert first == ["raw", "engram", "tngram", "oe", "longcat", "dense"]
    assert [s.config.run.seed for s in specs] == sorted(s.config.run.seed for s in specs)


def test_read_factors_parses_and_rejects(tmp_path):
    from tngram.common import TngramError
    assert P.read_factors(tmp_path, None) is None     # Over-Encoding not tuned yet
    f = P.read_factors(tmp_path, "oe-lr2,engram-lr8")
    assert f == {**P.TUNED_DEFAULT, "engram": 8.0, "oe": 2.0, "longcat": 2.0}
    for bad in ("oe-lrx", "nope-lr2"):
        with pytest.raises(TngramError):
            P.read_factors(tmp_path, bad)


def test_report_from_finished_runs_picks_the_front_and_skips_other_configs(tmp_path, monkeypatch):
    """Finished runs (summary.json + the spec's config.json) with known losses: the report's best-at-≤P
    rows are the brute-force choices; a folder holding another config is not counted."""
    import json

    from research.experiments.pareto_report import write_report
    from tngram.experiments.runner import run_dir_of
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 1024))
    factors = {"engram": 4.0, "tngram": 2.0, "oe": 1.0, "longcat": 1.0}
    specs = P.specs_for(["default"], "mini", 1, None, factors, families=("raw", "engram", "tngram"), n_sizes=2)
    loss = {"default-raw-s0": 3.70, "default-engram-table_budget700-s0": 3.48,
            "default-tngram-cp_rank88-s0": 3.47, "default-engram-table_budget1800-s0": 3.40,
            "default-tngram-cp_rank176-s0": 3.38}
    from tngram.train.recipes import param_summary
    for s in specs:
        d = run_dir_of(tmp_path, s)
        d.mkdir(parents=True)
        cfg = s.config if s.label != "default-tngram-cp_rank176-s0" else P.with_table_lr(s.config, 3.0)
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        (d / "summary.json").write_text(json.dumps({"total_params": param_summary(s.config)["total_params"],
                                                    "val_loss": loss[s.label], "val_bpb": loss[s.label] / 2,
                                                    "train_loss": loss[s.label]}))
    bench = {"points": {"raw": {"step_ms": 100.0, "decode_ms_per_token": 1.0},
                        "engram-700": {"step_ms": 140.0, "decode_ms_per_token": 1.5},
                        "tngram-88": {"step_ms": 120.0, "decode_ms_per_token": 1.4},
                        "engram-1800": {"step_ms": 160.0, "decode_ms_per_token": 1.6},
                        "tngram-176": {"step_ms": 130.0, "decode_ms_per_token": 1.5}}}
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "tuning.json").write_text(json.dumps({
        "corpus": "literature", "best": {"oe": 2.0, "longcat": 2.0},
        "rows": [{"factor": 1.0, "val_loss": 4.0}, {"factor": 2.0, "val_loss": 3.9},
                 {"factor": 1.0, "val_loss": 4.2}, {"factor": 2.0, "val_loss": 3.7}]}))
    write_report(tmp_path, specs, factors, bench=bench)
    tune = json.loads((tmp_path / "results" / "pareto-tuning-oe.json").read_text())
    assert tune["rows"] == [["× 1", 2, [4.0, 4.2]], ["× 2 (chosen)", 2, [3.9, 3.7]]]
    data = json.loads((tmp_path / "pareto.json").read_text())
    assert len(data["rows"]) == 4              # the lr x3 TN-gram folder is another config: not counted
    t = data["tables"]["default"]
    best_p = {r[0]: r[1] for r in t["best_params"]}
    # Δparams: Engram 700 ≈ 1.09M, TN-gram 88 ≈ 1.08M, Engram 1800 ≈ 2.24M
    assert best_p["≤ 1.5M"] == "TN-gram (88)" and best_p["≤ 3M"] == "Engram (1800)"
    best_s = {r[0]: r[1] for r in t["best_step"]}
    # step ratios: TN-gram 88 1.2x (3.47), Engram 700 1.4x (3.48), Engram 1800 1.6x (3.40)
    assert best_s["≤ 1.25× raw"] == "TN-gram (88)" and best_s["≤ 1.5× raw"] == "TN-gram (88)"
    assert best_s["≤ 2× raw"] == "Engram (1800)"
    fronts = {r[0] + r[1]: r[-1] for r in t["points"]}
    assert [r[2] for r in t["points"]] == [1, 1, 1, 1]     # the seeds column: one finished run each
    # Engram 700 has more Δparams, more step time and a higher loss than TN-gram 88: on no front
    assert fronts == {"raw GPT–": "params + time", "TN-gram88": "params + time", "Engram700": "",
                      "Engram1800": "params + time"}
    # the research/results files: "table" kind with provenance, rendered by the docblocks renderer
    from research.report.docblocks import render_table
    snap = json.loads((tmp_path / "results" / "pareto-default-best-params.json").read_text())
    assert snap["kind"] == "table" and {"command", "commit", "machine"} <= set(snap)
    assert "| ≤ 1.5M | TN-gram (88) | 1.08M | 3.4700 |" in render_table(snap)


@pytest.mark.parametrize("summary, bench, needle", [
    ('{"total_params": 1, "val_loss": NaN, "val_bpb": 1.0, "train_loss": 1.0}', None,
     "field val_loss holds NaN"),
    ('{"total_params": 1, "val_loss": null, "val_bpb": 1.0, "train_loss": 1.0}', None,
     "field 'val_loss' must be a finite number"),
    (None, {"points": {"raw": {"step_ms": -5.0}}}, "field points.raw.step_ms must be a time"),
    (None, {"points": {"raw": {"step_ms": "abc"}}}, "field points.raw.step_ms must be a time"),
])
def test_the_map_never_takes_a_non_finite_loss_or_a_bad_time(summary, bench, needle, tmp_path,
                                                             monkeypatch):
    """A finished run whose summary holds NaN (or null) val loss, and a bench.json with a negative
    or non-numeric step time: one line naming the file and the field, and no pareto.json."""
    import json

    from research.experiments.pareto_report import write_report
    from tngram.common import TngramError
    from tngram.experiments.runner import run_dir_of
    from tngram.train.recipes import param_summary
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 1024))
    factors = {"engram": 4.0, "tngram": 2.0, "oe": 1.0, "longcat": 1.0}
    specs = P.specs_for(["default"], "mini", 1, None, factors, families=("raw",), n_sizes=1)
    d = run_dir_of(tmp_path, specs[0])
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(specs[0].config.to_dict()))
    total = param_summary(specs[0].config)["total_params"]
    (d / "summary.json").write_text(summary.replace('"total_params": 1', f'"total_params": {total}')
                                    if summary else json.dumps({"total_params": total, "val_loss": 3.7,
                                                                "val_bpb": 1.8, "train_loss": 3.7}))
    if bench is not None:
        (tmp_path / "bench.json").write_text(json.dumps(bench))
    with pytest.raises(TngramError) as e:
        write_report(tmp_path, specs, factors)
    assert needle in str(e.value) and "\n" not in str(e.value), e.value
    assert not (tmp_path / "pareto.json").exists()


def test_large_vocabulary_setting_rides_with_the_default_corpus(monkeypatch):
    """`default@8192` trains every family at its recipe size and one larger, at vocabulary 8192."""
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 8192 if corpus.endswith("@8192") else 1024))
    factors = {"engram": 4.0, "tngram": 2.0, "oe": 1.0, "longcat": 1.0}
    specs = P.specs_for([P.VOCAB_CORPUS], "mini", 1, None, factors)
    got = {(s.tags["family"], s.tags["size"]) for s in specs}
    want = {("raw", None)} | {(f, v) for f, vs in P.VOCAB_SIZES.items() for v in vs}
    assert got == want and len(specs) == len(want)
    assert {s.config.model.vocab_size for s in specs} == {8192}
    engram = next(s for s in specs if s.tags["family"] == "engram")
    assert engram.config.model.memory.table_budget == (5 * 8192,) * 4     # the recipe's 5 V rows per head


def test_timing_keys_tell_vocabularies_apart():
    from research.experiments.pareto_report import point_key
    assert point_key("tngram", 352, "default") == point_key("tngram", 352, "literature") == "tngram-352"
    assert point_key("tngram", 352, "default@8192") == "tngram-352@8192"
    assert point_key("raw", None, "default@8192") == "raw@8192"


def test_figure_front_is_the_non_dominated_staircase():
    from research.experiments.pareto_report import _front_xy
    # (3, 2.5) is dominated by (2, 2); (5, 1) by (4, 1) (equal loss, higher cost)
    assert _front_xy([(3, 2.5), (1, 3), (4, 1), (2, 2), (5, 1)]) == [(1, 3), (2, 2), (4, 1)]


def test_cross_corpus_table_has_a_column_per_corpus_and_a_row_per_budget():
    from research.experiments.pareto_report import cross_corpus
    tables = {"default": {"best_params": [["≤ 1.5M", "TN-gram (88)", 1.08e6, [3.44, 3.46]],
                                          ["≤ 3M", "Engram (1800)", 2.2e6, [3.37]]]},
              "code": {"best_params": [["≤ 3M", "Engram (1800)", 2.2e6, [2.10]]]},
              "literature": {"best_params": []}}
    cols, rows = cross_corpus(tables, "best_params")
    assert [c["header"] for c in cols] == ["Δparams budget", "default", "code"]   # no empty corpus
    assert rows == [["≤ 1.5M", "TN-gram (88) (3.4500)", None],
                    ["≤ 3M", "Engram (1800) (3.3700)", "Engram (1800) (2.1000)"]]
    assert cross_corpus({"default": tables["default"]}, "best_params") is None


def test_cross_corpus_files_leave_out_the_vocabulary_setting(tmp_path):
    """default@8192's points are 40 M+ Δparams: the cross-corpus budget tables (1.5-13 M) hold only
    the 1024-vocabulary corpora; the setting keeps its own per-corpus file."""
    import json
    from research.experiments.pareto_report import results_files
    t = {"points": [["Engram", "3800", 4.3e6, [3.3]]], "best_params": [["≤ 5M", "Engram (3800)", 4.3e6, [3.3]]],
         "best_step": [["≤ 1.5× raw", "Engram (3800)", 300.0, 4.3e6, [3.3]]]}
    (tmp_path / "pareto.json").write_text(json.dumps({"tables": {"default": t, "code": t, "default@8192": t}}))
    files = results_files(tmp_path, "c", "m", "cmd")
    assert "pareto-default@8192" in files
    for kind in ("pareto-best-params", "pareto-best-step"):
        assert [c["header"] for c in files[kind]["columns"]][1:] == ["default", "code"]


def test_confirmation_adds_seeds_of_its_two_points_outside_the_map(monkeypatch):
    """specs_for(seeds=3): seeds 3 and 4 of Engram and tngram-hsum at size indices 2 and 1 on every
    corpus but the vocabulary setting, tagged confirm; the map's points (aggregate) never count them."""
    from research.experiments.pareto_report import aggregate
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 8192 if "@" in corpus else 1024))
    specs = P.specs_for(["default", "code", P.VOCAB_CORPUS], "mini", 3, None, dict(P.TUNED_DEFAULT, oe=2.0))
    extra = [s for s in specs if s.tags.get("confirm")]
    assert sorted((s.tags["corpus"], s.tags["family"], s.tags["size"], s.config.run.seed) for s in extra) == sorted(
        (c, f, P.SIZES[f][2][i], 1337 + k) for c in ("default", "code") for f in ("engram", "tngram-hsum")
        for k in (3, 4) for i in (2, 1))
    twin = next(s for s in specs if s.label == "code-tngram-hsum-hash_budget3929-s0")
    e3 = next(s for s in extra if s.label == "code-tngram-hsum-hash_budget3929-s3")
    assert e3.config.to_dict() == P.with_seed(twin.config, 3).to_dict()    # same point, seed 1337 + 3
    rows = [{**s.tags, "seed": s.config.run.seed, "delta_params": 1, "opt_state_bytes": {}, "val_loss": 1.0,
             "val_bpb": 0.5} for s in specs if s.tags["family"] == "tngram-hsum" and s.tags["corpus"] == "code"]
    pts = aggregate(rows, {})
    assert [sorted(p["seeds"]) for p in pts if p["size"] == 3929] == [[1337, 1338, 1339]]


def test_paired_rows_against_a_hand_computation():
    """Three seeds of tngram-hsum and Engram at matched sizes: the mean difference, its 95% t interval
    (t_{0.975, 2} = 4.302652729911275, tabulated), wins/losses, the Δparams and step ratios, and the
    verdict, which needs the interval below 0 AND Δparams and step <= Engram's."""
    from research.experiments.pareto_report import candidate_pairs, paired_rows
    sizes = {"engram": (700, 1800), "tngram-hsum": (139, 1493)}
    e = {1337: 3.40, 1338: 3.42, 1339: 3.45}
    h = {1337: 3.38, 1338: 3.402, 1339: 3.428}          # differences -0.02, -0.018, -0.022
    rows = [{"corpus": "code", "family": "engram", "size": 1800, "seed": s, "val_loss": v, "delta_params": 2000}
            for s, v in e.items()]
    rows += [{"corpus": "code", "family": "tngram-hsum", "size": 1493, "seed": s, "val_loss": v, "delta_params": 1990}
             for s, v in h.items()]
    rows += [{"corpus": "code", "family": "tngram-hsum", "size": 139, "seed": 1337, "val_loss": 3.5, "delta_params": 999}]
    bench = {"points": {"engram-1800": {"step_ms": 200.0}, "tngram-hsum-1493": {"step_ms": 198.0}}}
    [row] = paired_rows(rows, bench, sizes)            # size 139 has no Engram 700 twin: no row
    mean, sd = -0.02, 0.002                             # of (-0.02, -0.018, -0.022)
    half = 4.302652729911275 * sd / 3 ** 0.5
    assert row[:6] == ["code", "TN-gram sum + hashed", "1493 vs 1800", pytest.approx(0.995), pytest.approx(0.99), 3]
    assert row[6] == pytest.approx(3.42333333333) and row[7] == pytest.approx(mean)
    assert row[8] == pytest.approx([mean - half, mean + half]) and row[9] == "3/0"
    # sign test 2 * (1/2)^3; the step ratio is the points' 5-rep medians only: a candidate, not a "yes"
    assert row[10] == pytest.approx(0.25) and row[11] == "candidate"
    assert candidate_pairs(rows, bench, sizes) == [["tngram-hsum-1493", "engram-1800"]]
    bench["confirm_steps"] = [{"pair": ["tngram-hsum-1493", "engram-1800"], "ratio": 0.99, "ci": [0.98, 1.0]}]
    assert paired_rows(rows, bench, sizes)[0][11] == "yes" and candidate_pairs(rows, bench, sizes) == []
    bench["confirm_steps"][0]["ratio"] = 1.01       # the pair's own timing says slower: "no"
    assert paired_rows(rows, bench, sizes)[0][11] == "no"
    # on the 5-rep medians only, a step up to STEP_NOISE (0.10) above Engram's still asks for the
    # pair's own timing (1.09 < 1.10), and one beyond it does not (1.11)
    del bench["confirm_steps"]
    bench["points"]["tngram-hsum-1493"]["step_ms"] = 218.0
    assert paired_rows(rows, bench, sizes)[0][11] == "candidate"
    assert candidate_pairs(rows, bench, sizes) == [["tngram-hsum-1493", "engram-1800"]]
    bench["points"]["tngram-hsum-1493"]["step_ms"] = 222.0
    assert paired_rows(rows, bench, sizes)[0][11] == "no" and candidate_pairs(rows, bench, sizes) == []
    bench["points"]["tngram-hsum-1493"]["step_ms"] = 198.0
    rows[-2]["val_loss"] = 3.46                         # differences -0.02, -0.018, +0.01: interval holds 0
    assert paired_rows(rows, bench, sizes)[0][9:] == ["2/1", pytest.approx(1.0), "no"]
    # another corpus's sizes (the vocabulary-8192 setting): Engram 1800 is not its twin there
    assert paired_rows(rows, bench, sizes, {"code": {"engram": (700, 9999), "tngram-hsum": (139, 1493)}}) == []
    # ... and only for that corpus: a corpus listed after it still pairs by `sizes`
    later = [dict(r, corpus="later") for r in rows]
    out = paired_rows(rows + later, bench, sizes, {"code": {"engram": (700, 9999), "tngram-hsum": (139, 1493)}})
    assert [(r[0], r[2]) for r in out] == [("later", "1493 vs 1800")]


@pytest.mark.parametrize("n", [5, 6, 17, 41, 100])
def test_median_ci_is_the_binomial_order_statistic_interval(n):
    """The interval's ranks against scipy's binomial distribution (an independent computation), and
    its coverage: the chance that the true median of a continuous distribution falls outside is
    P(B <= k - 1) + P(B >= n - k + 1) <= 5%, and one rank tighter would exceed 5%."""
    from scipy.stats import binom
    from research.experiments.pareto import median_ci
    xs = [float(i) for i in range(1, n + 1)]          # the i-th order statistic is i
    lo, hi = median_ci(list(reversed(xs)))
    k = max((j for j in range(0, n // 2 + 1) if binom.cdf(j - 1, n, 0.5) <= 0.025), default=0)
    if k == 0:
        assert math.isnan(lo) and math.isnan(hi)
        return
    assert (lo, hi) == (k, n + 1 - k)
    assert 2 * binom.cdf(k - 1, n, 0.5) <= 0.05 < 2 * binom.cdf(k, n, 0.5)


def test_paired_rows_take_the_confirmation_step_ratio_for_its_pair():
    from research.experiments.pareto_report import paired_rows
    sizes = {"engram": (1800,), "tngram-hsum": (1493,)}
    rows = [{"corpus": "code", "family": f, "size": z, "seed": s, "val_loss": v + 0.001 * s, "delta_params": 10}
            for f, z, v in (("engram", 1800, 3.4), ("tngram-hsum", 1493, 3.3)) for s in (1, 2, 4)]
    bench = {"points": {"engram-1800": {"step_ms": 200.0}, "tngram-hsum-1493": {"step_ms": 210.0}}}
    assert paired_rows(rows, bench, sizes)[0][4] == pytest.approx(1.05)
    bench["confirm_steps"] = [{"pair": ["tngram-hsum-3929", "engram-3800"], "ratio": 1.2, "ci": [1.1, 1.3]},
                              {"pair": ["tngram-hsum-1493", "engram-1800"], "ratio": 0.97, "ci": [0.95, 0.99]}]
    row = paired_rows(rows, bench, sizes)[0]
    assert row[4] == 0.97 and row[11] == "yes"


def test_paired_rows_pool_the_corpora_but_not_the_vocabulary_setting():
    """Two corpora with 2 seeds each: a pooled row over the 4 pairs (mean, t interval with 3 degrees
    of freedom, t_{0.975, 3} = 3.182446305284263 tabulated, sign test 2 * (1/2)^4); the vocabulary
    setting's pairs stay out of the pool."""
    from research.experiments.pareto_report import paired_rows
    sizes = {"engram": (1800,), "tngram-hsum": (1493,)}
    d = {("default", 1): -0.01, ("default", 2): -0.02, ("code", 1): -0.03, ("code", 2): -0.04,
         ("default@8192", 1): +0.5}
    rows = []
    for (c, s), diff in d.items():
        rows += [{"corpus": c, "family": "engram", "size": 1800, "seed": s, "val_loss": 3.0, "delta_params": 10},
                 {"corpus": c, "family": "tngram-hsum", "size": 1493, "seed": s, "val_loss": 3.0 + diff,
                  "delta_params": 9}]
    out = paired_rows(rows, {"points": {}}, sizes)
    assert [r[0] for r in out] == ["default", "code", "default@8192", "2 corpora pooled"]
    pooled = out[-1]
    diffs = [-0.01, -0.02, -0.03, -0.04]
    mean = sum(diffs) / 4
    sd = (sum((x - mean) ** 2 for x in diffs) / 3) ** 0.5
    half = 3.182446305284263 * sd / 2
    assert pooled[5] == 4 and pooled[7] == pytest.approx(mean) and pooled[8] == pytest.approx([mean - half, mean + half])
    assert pooled[9] == "4/0" and pooled[10] == pytest.approx(0.125) and pooled[11] == "no"    # no timing: not shown to beat


def test_step_ratio_of_a_config_with_itself_is_near_one():
    """Two copies of one config timed in alternating rounds: the median per-round ratio is close to 1.
    The copies run the same work, so only timing noise moves it; the band is loose because the suite
    must pass on a busy machine (with two training processes on both cores, the median of 21 rounds
    ranged 0.80-1.24 over six tries, and 7 rounds reached 1.3), yet it still fails a ratio that
    halves (a / (a + b)) or doubles (a counted twice)."""
    from research.experiments.common import base_recipe, with_memory
    from research.experiments.pareto import step_ratio
    cfg = with_memory(base_recipe("mini", "engram"), table_budget=(64,) * 4)
    cfg = replace(cfg, data=replace(cfg.data, global_batch_tokens=2 * 256, micro_batch_seqs=2))
    from test_train_support import single_thread
    with single_thread():
        r = step_ratio(cfg, cfg, reps=21, warmup=1)
    assert 0.6 < r["ratio"] < 1.6 and r["rounds"] == 21 and len(r["ci"]) == 2


def test_step_ratio_across_processes_keeps_a_over_b_whichever_is_built_first():
    """processes=2: one fresh process builds a first, the other b first; a runs 4 micro-batches per
    step against b's 1 (same model), so every process must see a ratio well above 1 (a swapped
    order would show below 1), and the reported ratio is the median of the per-process medians."""
    import statistics
    from research.experiments.common import base_recipe, with_memory
    from research.experiments.pareto import step_ratio
    cfg = with_memory(base_recipe("mini", "engram"), table_budget=(64,) * 4)
    b = replace(cfg, data=replace(cfg.data, global_batch_tokens=2 * 256, micro_batch_seqs=2))
    a = replace(cfg, data=replace(cfg.data, global_batch_tokens=4 * 2 * 256, micro_batch_seqs=2))
    from test_train_support import single_thread
    with single_thread():
        r = step_ratio(a, b, reps=3, warmup=1, processes=2)
    per = r["processes"]
    assert [p["b_first"] for p in per] == [False, True] and all(len(p["rounds"]) == 3 for p in per)
    assert all(p["ratio"] == statistics.median(p["rounds"]) > 1.5 for p in per)
    assert r["ratio"] == pytest.approx(statistics.median([p["ratio"] for p in per]))
    assert all(math.isnan(x) for x in r["ci"])          # 2 medians: too few for a 95% interval


def test_core_targets_are_the_unscored_finished_runs_of_the_core_corpora(tmp_path, monkeypatch):
    """CORE is scored on the first seed of the default corpus (and its vocabulary setting) only, once
    per finished run."""
    from tngram.experiments.runner import run_dir_of
    monkeypatch.setattr(P, "corpus_data", lambda corpus: ("/nonexistent", 8192 if corpus.endswith("@8192") else 1024))
    factors = {"engram": 4.0, "tngram": 2.0, "oe": 1.0, "longcat": 1.0}
    specs = P.specs_for(["default", "code", P.VOCAB_CORPUS], "mini", 2, None, factors, families=("raw", "engram"),
                        n_sizes=1)
    by = {s.label: s for s in specs}
    for label in ("default-raw-s0", "code-raw-s0", "default@8192-raw-s0", "default-engram-table_budget700-s0",
                  "default-raw-s1"):
        d = run_dir_of(tmp_path, by[label])
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
    scored = run_dir_of(tmp_path, by["default-engram-table_budget700-s0"]) / "eval"
    scored.mkdir()
    (scored / "core-max100.json").write_text("{}")
    got = [label for label, _ in P.core_targets(tmp_path, specs, 100)]
    # code: out of CORE_CORPORA; raw s1: second seed (CORE_SEEDS 1); Engram 700: already scored at
    # 100; unfinished runs: no summary
    assert sorted(got) == ["default-raw-s0", "default@8192-raw-s0"]
    # another N is another file: Engram 700 is scored again
    assert sorted(label for label, _ in P.core_targets(tmp_path, specs, 50)) == [
        "default-engram-table_budget700-s0", "default-raw-s0", "default@8192-raw-s0"]
