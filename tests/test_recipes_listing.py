"""`tngram recipes` says in one line what each recipe is, and every claim of that line holds for
the recipe's config: the memory kind (or none), N, the CP rank, the heads per order, the variants'
switches and table lr, and "at TN-gram's Δparams" within 1% of the same backbone's TN-gram."""

from __future__ import annotations

import re

import pytest

from tngram.cli.main import main
from tngram.train.recipes import DESCRIPTIONS, RECIPES, get_recipe, param_summary


def test_every_recipe_has_one_distinct_line(capsys):
    assert set(DESCRIPTIONS) == set(RECIPES)
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(RECIPES)
    assert len(set(ln.split("  [")[0].split(None, 1)[1] for ln in lines)) == len(lines)
    for name, ln in zip(RECIPES, lines):
        assert DESCRIPTIONS[name] in ln


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_description_matches_its_config(name):
    cfg, text = get_recipe(name), DESCRIPTIONS[name]
    mem = cfg.model.memory
    if "no memory" in text:
        assert mem is None
        return
    kind = {"TN-gram variant": "tngram-variant", "TN-gram": "tngram", "Engram": "engram", "Over-Encoding": "oe", "product-key": "pkm",
            "STEM": "stem", "per-layer token embeddings": "ple"}
    named = [k for w, k in kind.items() if re.search(rf"(^|\W){w}(?! variant)\W", text)]
    assert mem is not None and mem.kind in named, (name, text)
    if m := re.search(r"N (\d+)", text):
        assert mem.max_ngram == int(m.group(1))
    if m := re.search(r"\bR (\d+)", text):
        assert mem.cp_rank == int(m.group(1))
    if m := re.search(r"(\d+) heads per order", text):
        assert mem.n_head_per_ngram == int(m.group(1))
    if m := re.search(r"(\d+) slices", text):
        assert mem.n_slices == int(m.group(1))
    if m := re.search(r"(\d+)\^2 slots, top (\d+), (\d+) heads", text):
        assert (mem.n_keys, mem.topk, mem.n_heads) == tuple(int(g) for g in m.groups())
    if m := re.search(r"FFN width (\d+)", text):
        assert mem.width(cfg.model.n_embd) == int(m.group(1))
    if m := re.search(r"(\d+) wide, gated", text):
        assert mem.ple_dim == int(m.group(1)) and mem.gated
    if m := re.search(r"in layers (\d+) and (\d+)", text):
        assert tuple(cfg.model.memory_layers) == tuple(int(g) for g in m.groups())
    if "in every layer" in text:
        assert tuple(cfg.model.memory_layers) == tuple(range(cfg.model.n_layer))
    if "no RMSNorm, no absorption" in text:
        assert not mem.use_norm and not mem.use_absorption
    if "orders summed" in text or "order_combine sum" in text:
        assert mem.order_combine == "sum"
    if "hashed orders 2-5" in text:
        assert tuple(mem.hash_orders) == (2, 3, 4, 5)
    prefix = "-".join(name.split("-")[:2]) if name.startswith("paper") else "mini"
    if "table lr x4" in text:
        base = get_recipe(f"{prefix}-tngram").optim
        assert cfg.optim.memory_table_lr == pytest.approx(4 * base.tied_embed_lr)
    if "at TN-gram's Δparams" in text:
        twin = get_recipe(f"{prefix}-tngram")
        mine, ref = param_summary(cfg)["delta_params"], param_summary(twin)["delta_params"]
        assert abs(mine - ref) / ref < 0.01, (name, mine, ref)


def test_recipes_help_describes_the_listing_and_the_paper_recipes_data(capsys):
    """`tngram recipes --help` has a description; its token counts are the paper recipes' own and
    its FineWeb command the one the repetition guard names for paper-l9."""
    from tngram.train.health import fineweb_command

    with pytest.raises(SystemExit):
        main(["recipes", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    tokens = {n: get_recipe(n).schedule.steps * get_recipe(n).data.global_batch_tokens
              for n in ("paper-l9-tngram", "paper-l18-tngram")}
    assert f"{tokens['paper-l9-tngram'] / 1e9:.1f} B (L9)" in text
    assert f"{tokens['paper-l18-tngram'] / 1e9:.1f} B (L18)" in text
    assert f"`{fineweb_command(tokens['paper-l9-tngram'], 1024)}`" in text
