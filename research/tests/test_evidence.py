"""Evidence experiments: seen fractions, the consumed-token replay, the log-trend fit, and the
`corpora` experiment's plumbing on a tiny dataset."""

from __future__ import annotations

from research.cli import main as research_main
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from test_train_support import tiny_config, tiny_data  # noqa: F401  (session fixture)
from research.experiments.analysis import consumed_train_tokens, seen_fractions
from research.experiments.evidence import log_trend


def test_seen_fractions_against_brute_force():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 6, size=400)
    val = rng.integers(0, 6, size=120)
    got = seen_fractions(val, train, orders=(2, 3, 4))
    for n in (2, 3, 4):
        # left-padded windows with pad 0, as ngram_keys defines them
        pad = lambda a: np.concatenate([np.zeros(n - 1, a.dtype), a])  # noqa: E731
        tr = {tuple(pad(train)[i:i + n]) for i in range(len(train))}
        want = np.mean([tuple(pad(val)[i:i + n]) in tr for i in range(len(val))])
        assert got[n] == pytest.approx(want)


def test_consumed_tokens_are_the_stream_the_trainer_reads(tiny_data):  # noqa: F811
    from tngram.data.build import open_dataset
    from tngram.data.shards import read_shard

    cfg = tiny_config(tiny_data, "mini-raw")                 # 8 steps x 2 micro-steps x (4*64+1)
    got = consumed_train_tokens(cfg)
    assert got.size == 8 * 2 * (4 * 64 + 1)
    stream = np.concatenate([np.asarray(read_shard(f)) for f in open_dataset(tiny_data).train_files])
    assert cfg.data.seed == 0                                # seed 0: natural order from token 0
    assert np.array_equal(got, stream[: got.size])


def test_log_trend_exact_line_and_noise():
    # points on gap = 0.01 - 0.005 log10(tokens): slope -0.005, zero residual -> CI collapses
    toks = [1e6, 1e6, 4e6, 4e6, 1.6e7, 1.6e7]
    gaps = [0.01 - 0.005 * math.log10(t) for t in toks]
    tr = log_trend(toks, gaps, at=3e9)
    assert tr["slope"] == pytest.approx(-0.005) and tr["slope_hi"] - tr["slope_lo"] == pytest.approx(0, abs=1e-9)
    assert tr["pred"] == pytest.approx(0.01 - 0.005 * math.log10(3e9))
    # two points per x with spread ±e: residual variance = sum 6 e^2 / (6 - 2); its half-width follows
    e = 0.001
    noisy = [g + (e if i % 2 else -e) for i, g in enumerate(gaps)]
    tr2 = log_trend(toks, noisy, at=3e9)
    x = np.log10(toks)
    sxx = ((x - x.mean()) ** 2).sum()
    q = 2.7764451051977987                                  # t_{0.975, 4} from tables
    assert tr2["slope"] == pytest.approx(-0.005)
    assert tr2["slope_hi"] - tr2["slope"] == pytest.approx(q * math.sqrt(6 * e * e / 4 / sxx), rel=1e-6)
    assert math.isnan(log_trend([1e6, 1e6], [0.0, 0.1])["slope"])


@pytest.mark.slow
def test_corpora_experiment_plumbing(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """Two 'corpora' given as dataset folders, the way `--corpora DIR,DIR` passes them (the same
    tiny dataset through two links, a and b), 1 seed, 2 steps: runs and tables are named by the
    folders, every table, the significance rows and the figure are written; a second call trains
    nothing."""
    import research.experiments.evidence as ev

    for name in ("a", "b"):
        (tmp_path / name).symlink_to(tiny_data, target_is_directory=True)
    monkeypatch.setattr(ev, "base_recipe", lambda prefix, m: replace(
        tiny_config(tiny_data, f"mini-{m}", extra=["run.val_every=0", "run.checkpoint_every=0"]),
        name=f"mini-{m}"))
    out = tmp_path / "ev"
    corpora = [str(tmp_path / "a"), str(tmp_path / "b")]
    ev.corpora(out, seeds=1, steps=2, corpora=corpora)
    res = json.loads((out / "corpora.json").read_text())
    assert set(res["rows"]) == {"a", "b"} and len(res["rows"]["a"]) == 3
    assert set(res["seen"]["a"]["consumed"]) == {"2", "3", "4", "5"}
    report = (out / "report.md").read_text()
    assert "| TN-gram − Engram | **pooled** | 2 |" in report and (out / "gap-vs-unseen.png").exists()
    stamp = (out / "a" / "runs" / "tngram-s0" / "summary.json").stat().st_mtime_ns
    cfg = json.loads((out / "a" / "runs" / "tngram-s0" / "config.json").read_text())
    assert cfg["data"]["dir"] == str(tmp_path / "a")  # the folder as given: the link, not its target
    ev.corpora(out, seeds=1, steps=2, corpora=corpora)
    assert (out / "a" / "runs" / "tngram-s0" / "summary.json").stat().st_mtime_ns == stamp


def test_dense_variants_match_params_and_flops():
    from dataclasses import replace as rep

    from research.experiments.evidence import dense_variants, train_flops_per_token
    from tngram.train.recipes import get_recipe, param_summary

    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    total = lambda c: param_summary(c)["total_params"]  # noqa: E731
    dv = dense_variants(cfgs["raw"], {m: cfgs[m] for m in ("engram", "tngram")})
    assert set(dv) == {f"dense-{w}-{m}" for w in ("wide", "deep", "mlp", "flops") for m in ("engram", "tngram")}
    for key, c in dv.items():
        _, way, method = key.split("-")
        assert c.model.memory is None
        field, step = {"wide": ("n_embd", 8), "flops": ("n_embd", 8), "deep": ("n_layer", 1), "mlp": ("mlp_mult", 1)}[way]
        measure = train_flops_per_token if way == "flops" else total
        target = measure(cfgs[method])
        err = abs(measure(c) - target)
        v = getattr(c.model, field)
        for nb in (v - step, v + step):                     # no neighbouring size is closer
            assert abs(measure(rep(c, model=rep(c.model, **{field: nb}))) - target) >= err
        assert measure(c) > measure(cfgs["raw"])            # grown, not shrunk


def test_tuning_variants_change_only_their_setting():
    from research.experiments.evidence import FACTOR_INIT_STDS, TABLE_LR_FACTORS, tuning_variants
    from tngram.train.recipes import get_recipe

    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    tv = tuning_variants(cfgs)
    recipe_std = cfgs["tngram"].model.memory.factor_init_std
    assert recipe_std in FACTOR_INIT_STDS and "tngram-lr1" in tv       # the recipe's setting, trained once:
    assert len(tv) == 2 * len(TABLE_LR_FACTORS) + len(FACTOR_INIT_STDS) - 1   # no init variant repeats it
    assert f"tngram-init{recipe_std:g}" not in tv
    base = cfgs["tngram"].optim.tied_embed_lr                     # memory_table_lr unset -> tied_embed_lr
    assert tv["tngram-lr2"].optim.memory_table_lr == 2 * base
    assert tv["engram-lr0.5"].optim.memory_table_lr == 0.5 * base
    assert tv["tngram-lr2"].model == cfgs["tngram"].model
    assert tv["tngram-init0.3"].model.memory.factor_init_std == 0.3
    assert tv["tngram-init0.3"].optim == cfgs["tngram"].optim


def test_experiment_cli_seeds_default_and_budgets(monkeypatch, tmp_path):
    """`experiment` without --seeds uses each experiment's own count (5 for corpora, 3 for
    data-scaling, 2 for tuning); --budgets reaches data-scaling as step multipliers."""
    import research.experiments.evidence as ev
    from tngram.cli import main

    seen = []
    monkeypatch.setattr(ev, "corpora", lambda out, scale, seeds, *a, **k: seen.append(("corpora", seeds)))
    monkeypatch.setattr(ev, "tuning", lambda out, scale, seeds, *a, **k: seen.append(("tuning", seeds)))
    monkeypatch.setattr(ev, "data_scaling", lambda out, scale, seeds, *a, multipliers, **k:
                        seen.append(("data-scaling", seeds, multipliers)))
    for argv in (["corpora"], ["tuning"], ["data-scaling", "--budgets", "1,2,4"], ["data-scaling", "--seeds", "2"]):
        assert research_main(["experiment", *argv, "--out", str(tmp_path)]) == 0
    assert seen == [("corpora", 5), ("tuning", 2), ("data-scaling", 3, (1, 2, 4)), ("data-scaling", 2, (1, 4, 16))]


def test_widen_lr_grid_steps_past_an_edge_best_only():
    from research.experiments.evidence import MAX_LR_STEPS, TABLE_LR_FACTORS, tuning_variants, widen_lr_grid
    from tngram.train.recipes import get_recipe

    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    tv = tuning_variants(cfgs)
    hi, lo = max(TABLE_LR_FACTORS), min(TABLE_LR_FACTORS)
    # Engram best at the top edge, TN-gram best inside the grid: only Engram grows, by x2
    loss = {k: 1.0 for k in tv}
    loss[f"engram-lr{hi:g}"], loss["tngram-lr1"] = 0.5, 0.5
    new = widen_lr_grid(tv, loss, cfgs)
    assert list(new) == [f"engram-lr{2 * hi:g}"]
    base = cfgs["engram"].optim.tied_embed_lr
    assert new[f"engram-lr{2 * hi:g}"].optim.memory_table_lr == pytest.approx(2 * hi * base)
    # TN-gram best at the bottom edge: /2
    loss = {k: 1.0 for k in tv}
    loss[f"tngram-lr{lo:g}"], loss["engram-lr1"] = 0.5, 0.5
    assert list(widen_lr_grid(tv, loss, cfgs)) == [f"tngram-lr{lo / 2:g}"]
    # growth stops after MAX_LR_STEPS steps
    grown = dict(tv)
    for i in range(1, MAX_LR_STEPS + 1):
        grown[f"engram-lr{hi * 2 ** i:g}"] = None
    loss = {k: 1.0 for k in grown}
    loss[f"engram-lr{hi * 2 ** MAX_LR_STEPS:g}"], loss["tngram-lr1"] = 0.5, 0.5
    assert widen_lr_grid(grown, loss, cfgs) == {}


def test_tuning_table_shows_the_lr_each_setting_trains_with():
    """The factor-init settings leave optim.memory_table_lr unset (the tied-embedding lr applies):
    the table must print that lr (a None here crashed a finished 24-run sweep before tuning.json)."""
    from research.experiments.evidence import tuning_table, tuning_variants
    from tngram.train.recipes import get_recipe

    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    tv = tuning_variants(cfgs)
    assert tv["tngram-init0.3"].optim.memory_table_lr is None
    lines = tuning_table(tv, {k: (3.0 + i / 100, 0.001) for i, k in enumerate(tv)}).splitlines()
    assert len(lines) == 2 + len(tv)
    lr = cfgs["tngram"].optim.tied_embed_lr
    assert f"| tngram-init0.3 | {lr:g} | 0.3 |" in "\n".join(lines)
    assert f"| engram-lr4 | {4 * lr:g} | – |" in "\n".join(lines)


def test_tuned_configs_and_missing_tuning_folder(tmp_path, capsys):
    from tngram.cli import main
    from research.experiments.evidence import tuned_configs
    from tngram.train.recipes import get_recipe

    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    t = tuned_configs(cfgs, {"engram": "engram-lr4", "tngram": "tngram-init0.03"})
    assert t["raw"] is cfgs["raw"]
    assert t["engram"].optim.memory_table_lr == pytest.approx(4 * cfgs["engram"].optim.tied_embed_lr)
    assert t["engram"].model == cfgs["engram"].model
    assert t["tngram"].model.memory.factor_init_std == 0.03 and t["tngram"].optim == cfgs["tngram"].optim
    assert research_main(["experiment", "corpora", "--tuned", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tuning.json" in err[0] and not (tmp_path / "o").exists()


def test_tuned_accepts_the_printed_setting_names(tmp_path, capsys):
    from tngram.cli import main
    from research.experiments.evidence import read_best, tuned_configs
    from tngram.train.recipes import get_recipe

    # the names `python -m research experiment tuning` prints are the same as a tuning folder's "best"
    assert read_best("engram-lr4,tngram-lr2") == {"engram": "engram-lr4", "tngram": "tngram-lr2"}
    assert read_best(" tngram-init0.03 ") == {"tngram": "tngram-init0.03"}
    cfgs = {m: get_recipe(f"mini-{m}") for m in ("raw", "engram", "tngram")}
    t = tuned_configs(cfgs, read_best("engram-lr4,tngram-lr0.5"))
    base = cfgs["engram"].optim.tied_embed_lr
    assert t["engram"].optim.memory_table_lr == pytest.approx(4 * base)
    assert t["tngram"].optim.memory_table_lr == pytest.approx(0.5 * base)
    # a folder holding tuning.json wins over the name form
    folder = tmp_path / "engram-lr4"
    folder.mkdir()
    (folder / "tuning.json").write_text('{"best": {"engram": "engram-lr2"}}')
    assert read_best(folder) == {"engram": "engram-lr2"}
    # one clear line, exit 2, nothing written: two settings for one memory, or a typo
    for bad, words in (("engram-lr4,engram-lr2", "two settings for engram"),
                       ("engram-lr4,tngram-rate2", "engram-lr4,tngram-lr2")):
        for name in ("corpora", "data-scaling"):
            assert research_main(["experiment", name, "--tuned", bad, "--out", str(tmp_path / "o")]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and words in err[0] and not (tmp_path / "o").exists()
    assert research_main(["experiment", "vocab", "--tuned", "engram-lr4", "--out", str(tmp_path / "o")]) == 2
    assert "corpora, data-scaling and pareto" in capsys.readouterr().err


def test_data_scaling_trains_each_memory_at_its_tuned_setting(tmp_path, monkeypatch):
    import tngram.experiments.compare as cmp
    import research.experiments.evidence as ev
    from tngram.train.recipes import get_recipe

    class Seen(Exception):
        pass

    def record(cfgs, *a, **k):
        raise Seen(cfgs)

    monkeypatch.setattr(ev, "corpus_data", lambda name: (str(tmp_path), 1024))
    monkeypatch.setattr(ev, "check_budgets_fit", lambda *a: None)   # no dataset here (tested below)
    monkeypatch.setattr(cmp, "compare_configs", record)
    with pytest.raises(Seen) as got:
        ev.data_scaling(tmp_path / "o", multipliers=(2,), tuned="engram-lr4,tngram-lr2")
    cfgs = got.value.args[0]
    base = get_recipe("mini-engram")
    assert cfgs["engram"].optim.memory_table_lr == pytest.approx(4 * base.optim.tied_embed_lr)
    assert cfgs["tngram"].optim.memory_table_lr == pytest.approx(2 * base.optim.tied_embed_lr)
    assert cfgs["raw"].optim == get_recipe("mini-raw").optim
    assert cfgs["engram"].schedule.steps == 2 * base.schedule.steps


def test_data_scaling_refuses_a_budget_the_train_split_cannot_hold(tiny_data, tmp_path, capsys):  # noqa: F811
    """A budget past the train tokens would make the loader wrap around (tokens seen twice): one
    line naming the data, exit 2, before any run; a budget that fits passes."""
    from tngram.cli import main
    from tngram.data.build import open_dataset
    from research.experiments.evidence import check_budgets_fit

    have = int(open_dataset(tiny_data).manifest["tokens"]["train"])
    check_budgets_fit(str(tiny_data), (1, 2), have // 2)          # 2 x half = all of it: fits
    with pytest.raises(Exception, match=r"--budgets: 3x reads .* holds .* train tokens"):
        check_budgets_fit(str(tiny_data), (1, 3), have // 2)
    # the recipe's 1,048,576 tokens per 1x budget: the tiny dataset holds far fewer
    assert research_main(["experiment", "data-scaling", "--data", str(tiny_data), "--budgets", "1",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tiny_data) in err[0] and "repeat" in err[0]
    assert not (tmp_path / "o").exists()
