"""Named recipes: functions returning a full TrainConfig (model + optimiser + schedule + data +
run).

Paper recipes (`paper-l9-*`, `paper-l18-*`) use the paper's hyperparameters (App. E, Tables 4-5):
seq 1024, global batch 524,288 tokens, Muon lr 0.04 (momentum 0.85 -> 0.95 over 500 steps, 5 NS
steps), Adam (0.9, 0.95, 1e-8), tied-embedding lr 0.05, scalar lr 0.04, 1200 warmdown steps,
seed 1337, memory in blocks 1 and 7. L9 trains 6000 steps. L18 follows App. C: 18 layers, d 1024,
10,000 steps; we choose 16 query / 8 KV heads (head dim 64 as at L9), memory blocks (1, 14)
(the paper does not state them), R = 1800 for TN-gram, and 8 heads per order for Engram.

Engram in the paper recipes: orders 2..5, 8 heads per order, per-head table budget 5*V,
n_embed_per_ngram = d_model, kernel 3 with dilation N (the paper's conv). TN-gram: N = 5,
R = 1024 (L9) / 1800 (L18). Padding id 0 (SentencePiece <pad>, never in the data).
Over-Encoding (a third baseline, not in the paper's tables): orders 2..5, 2 slices per order, the
slice-table modulus chosen so its Δparams equals TN-gram's (36,380 rows at L9, 33,697 at mini).
`*-oe-longcat`: Over-Encoding at LongCat-Flash's published n-gram embedding settings (orders 2..4,
4 slices per order, averaged fusion), rows chosen the same way (36,954 at L9: Δ 18,888,912 vs
TN-gram's 18,888,712; 36,000 at mini: Δ 4,336,800 vs 4,329,544, the pareto map's LongCat point).

`paper-l9-tngram-sum / -hsum / -lean / -sum-lean`: TN-gram variants that cut work from the GPU
step (sum, hsum and sum-lean of kind tngram-variant; lean the paper's own ablations), each within
Engram's Δparams (26,428,288 at L9): orders summed before K/V (R 1520, the largest multiple of 16
within TN-gram's Δparams: 18,695,080; an R off 16 lets Triton use only 4-byte loads and atomics,
and misaligns bf16 K/V rows); R 256 summed + hashed orders 2..5 at 416 wide (mini-tngram-hsum
with widths scaled by d, 128 -> 512; budget 5839, the largest within Engram's Δ: 26,421,720); no
RMSNorm and no absorption at R 1024 (18,882,568); sum and lean together at R 1520. They keep
the paper recipes' table lr.

`mini-*` recipes are sized for a 2-core CPU (docs/TRAINING.md has their measured speed;
research/RESULTS.md the comparison).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tngram.common import TngramError
from tngram.memory import memory_config_classes
from tngram.model.gpt import GPT, GPTConfig, param_counts
from tngram.train.config import (
    DataConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    apply_overrides,
    apply_settings,
    check_memory_layers_used,
    with_schedule_steps,
)
from tngram.train.config_file import load_config_file


# ---- memory configurations


def _engram(d_model: int, vocab: int, heads: int, max_ngram: int = 5, **kw: Any):
    from tngram.memory.engram import EngramConfig

    return EngramConfig(
        max_ngram=max_ngram,
        n_head_per_ngram=heads,
        n_embed_per_ngram=kw.pop("n_embed", d_model),
        table_budget=None,
        pad_id=0,
        kernel_size=3,
        dilation=None,
        **kw,
    )


def _tngram(cp_rank: int, max_ngram: int = 5, **kw: Any):
    """The paper's TN-gram (kind tngram); a variant field in `kw` (order_combine, hash_orders,
    ...) makes it kind tngram-variant."""
    from tngram.memory import with_memory_fields
    from tngram.memory.tngram import TNGramConfig

    paper = TNGramConfig(max_ngram=max_ngram, cp_rank=cp_rank, pad_id=0, kernel_size=3)
    return with_memory_fields(paper, **kw)


def _oe(table_rows: int, max_ngram: int = 5, n_slices: int = 2, **kw: Any):
    from tngram.memory.overencoding import OverEncodingConfig

    return OverEncodingConfig(
        max_ngram=max_ngram, n_slices=n_slices, table_rows=table_rows, pad_id=0, **kw
    )


LONGCAT = {
    "max_ngram": 4,
    "n_slices": 4,
    "average": True,
}  # LongCat-Flash's n-gram embedding settings


def _longcat(table_rows: int):
    return _oe(table_rows, **LONGCAT)


# ---- backbones


def _paper_l9(memory: Any, name: str) -> TrainConfig:
    return TrainConfig(
        name=name,
        model=GPTConfig(memory=memory, memory_layers=(1, 7)),
        schedule=ScheduleConfig(steps=6000, warmdown_steps=1200),
        data=DataConfig(global_batch_tokens=524_288, micro_batch_seqs=64),
    )


def _paper_l18(memory: Any, name: str) -> TrainConfig:
    model = GPTConfig(
        n_layer=18, n_embd=1024, n_head=16, n_kv_head=8, memory=memory, memory_layers=(1, 14)
    )
    return TrainConfig(
        name=name,
        model=model,
        schedule=ScheduleConfig(steps=10_000, warmdown_steps=1200),
        data=DataConfig(global_batch_tokens=524_288, micro_batch_seqs=32),
    )


MINI_D, MINI_VOCAB = 128, 1024


def _mini(memory: Any, name: str) -> TrainConfig:
    model = GPTConfig(
        n_layer=4,
        n_embd=MINI_D,
        n_head=4,
        n_kv_head=2,
        mlp_mult=2,
        sequence_len=256,
        memory=memory,
        memory_layers=(1, 3),
    )
    return TrainConfig(
        name=name,
        model=model,
        optim=OptimConfig(muon_momentum_warmup_steps=50),
        schedule=ScheduleConfig(steps=256, warmdown_steps=80),
        data=DataConfig(global_batch_tokens=16 * 256, micro_batch_seqs=8, val_tokens=131_072),
        run=RunConfig(dtype="bf16", log_every=10, val_every=0, checkpoint_every=100),
    )


def _memory(kind: str, **kw: Any) -> Any:
    """A registered memory's config by kind (product keys, STEM, per-layer embeddings)."""
    return memory_config_classes()[kind](**kw)


def _every_layer(cfg: TrainConfig) -> TrainConfig:
    """The memory in every block (per-layer embeddings are per layer)."""
    layers = tuple(range(cfg.model.n_layer))
    return replace(cfg, model=replace(cfg.model, memory_layers=layers))


def _table_lr(cfg: TrainConfig, lr: float) -> TrainConfig:
    return replace(cfg, optim=replace(cfg.optim, memory_table_lr=lr))


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "paper-l9-raw": lambda: _paper_l9(None, "paper-l9-raw"),
    "paper-l9-engram": lambda: _paper_l9(_engram(512, 1024, heads=8), "paper-l9-engram"),
    "paper-l9-tngram": lambda: _paper_l9(_tngram(1024), "paper-l9-tngram"),
    "paper-l9-oe": lambda: _paper_l9(_oe(36_380), "paper-l9-oe"),
    "paper-l9-oe-longcat": lambda: _paper_l9(_longcat(36_954), "paper-l9-oe-longcat"),
    # TN-gram variants that cut the K/V input (a shorter GPU step), each within Engram's
    # Δparams (tests/test_paper_l9_variants.py), at the paper recipes' table lr:
    # orders summed: K/V read R = 1520 features, not 4 x 1024; the largest multiple of 16 within
    # TN-gram's Δ (16-byte rows: vector loads and atomics in the Triton lookup, aligned bf16 K/V)
    "paper-l9-tngram-sum": lambda: _paper_l9(
        _tngram(1520, order_combine="sum"), "paper-l9-tngram-sum"
    ),
    # mini-tngram-hsum scaled with d (128 -> 512): R 256 summed + hashed orders 2..5 at 416 wide,
    # K/V read 256 + 4 x 416 = 1920 (Engram 4 x 512 = 2048); the largest budget within Engram's Δ
    "paper-l9-tngram-hsum": lambda: _paper_l9(
        _tngram(
            256, order_combine="sum", hash_orders=(2, 3, 4, 5), hash_embed=416, hash_budget=5839
        ),
        "paper-l9-tngram-hsum",
    ),
    # the ablation winners at the paper's R: no RMSNorm or scale pass, no absorption products
    "paper-l9-tngram-lean": lambda: _paper_l9(
        _tngram(1024, use_norm=False, use_absorption=False), "paper-l9-tngram-lean"
    ),
    # sum and lean together: the K/V input of sum (R 1520) without lean's norm and absorption
    # passes; the one variant whose matmul FLOPs (tngram.model.flops.train_flops) are below
    # Engram's with none of hsum's extra hashed-table reads
    "paper-l9-tngram-sum-lean": lambda: _paper_l9(
        _tngram(1520, order_combine="sum", use_norm=False, use_absorption=False),
        "paper-l9-tngram-sum-lean",
    ),
    "paper-l18-raw": lambda: _paper_l18(None, "paper-l18-raw"),
    "paper-l18-engram": lambda: _paper_l18(_engram(1024, 1024, heads=8), "paper-l18-engram"),
    "paper-l18-tngram": lambda: _paper_l18(_tngram(1800), "paper-l18-tngram"),
    "mini-raw": lambda: _mini(None, "mini-raw"),
    "mini-engram": lambda: _mini(_engram(MINI_D, MINI_VOCAB, heads=4), "mini-engram"),
    "mini-tngram": lambda: _mini(_tngram(352), "mini-tngram"),
    # the ablation winners (research/RESULTS.md Fig. 4 right): no RMSNorm, no absorption
    "mini-tngram-lean": lambda: _mini(
        _tngram(352, use_norm=False, use_absorption=False), "mini-tngram-lean"
    ),
    # TN-gram R 64, orders summed, + Engram-style hashed orders 2..5 (104 wide), Δparams <=
    # mini-engram's, at Engram's tuned table lr (x4): the pareto family tngram-hsum at its 4.3 M
    # point
    "mini-tngram-hsum": lambda: _table_lr(
        _mini(
            _tngram(
                64, order_combine="sum", hash_orders=(2, 3, 4, 5), hash_embed=104, hash_budget=3929
            ),
            "mini-tngram-hsum",
        ),
        0.2,
    ),  # 4 x the recipes' table lr 0.05
    "mini-oe": lambda: _mini(_oe(33_697), "mini-oe"),
    "mini-oe-longcat": lambda: _mini(_longcat(36_000), "mini-oe-longcat"),
    # the other token-indexed families, each table lr set once from the literature relative to
    # the backbone's Adam lr (the tied embedding's, 0.05; research/PARETO.md, "The token-indexed
    # families' table lr"):
    # product-key values at 4x (Lample et al. 2019: values Adam 1e-3, the model 2.5e-4), STEM's
    # token-indexed up-projection at 1x (one AdamW lr for every parameter), per-layer embeddings
    # (Gemma 3n-style; no training recipe published) at 1x, the embedding's own
    "mini-pkm": lambda: _table_lr(
        _mini(_memory("pkm", n_keys=128, key_dim=64, topk=8, n_heads=2), "mini-pkm"), 0.2
    ),
    "mini-stem": lambda: _table_lr(_mini(_memory("stem"), "mini-stem"), 0.05),
    "mini-ple": lambda: _table_lr(
        _every_layer(_mini(_memory("ple", ple_dim=64), "mini-ple")), 0.05
    ),
}


# what each recipe is, in one line (`tngram recipes`; tests/test_recipes_listing.py checks each
# claim against the config: ranks, orders, heads, "no memory", Over-Encoding at TN-gram's Δparams)
DESCRIPTIONS: dict[str, str] = {
    "paper-l9-raw": "the paper's L9 GPT (parameter-golf's), no memory",
    "paper-l9-engram": "L9 + Engram N 5, 8 heads per order (the paper's Table 1)",
    "paper-l9-tngram": "L9 + TN-gram N 5, R 1024 (the paper's Table 1)",
    "paper-l9-oe": "L9 + Over-Encoding N 5, 2 slices, at TN-gram's Δparams",
    "paper-l9-oe-longcat": "L9 + Over-Encoding at LongCat-Flash's settings, at TN-gram's Δparams",
    "paper-l9-tngram-sum": "L9 + TN-gram variant N 5, R 1520, orders summed (K/V read R, not 4R)",
    "paper-l9-tngram-hsum": (
        "L9 + TN-gram variant R 256, orders summed, + hashed orders 2-5 (416 wide)"
    ),
    "paper-l9-tngram-lean": "L9 + TN-gram N 5, R 1024, no RMSNorm, no absorption",
    "paper-l9-tngram-sum-lean": (
        "L9 + TN-gram variant N 5, R 1520, order_combine sum, no RMSNorm, no absorption"
    ),
    "paper-l18-raw": "the paper's L18 GPT, no memory",
    "paper-l18-engram": "L18 + Engram N 5, 8 heads per order",
    "paper-l18-tngram": "L18 + TN-gram N 5, R 1800",
    "mini-raw": "CPU-sized GPT (4 layers, d 128), no memory: the baseline",
    "mini-engram": "mini + Engram N 5, 4 heads per order",
    "mini-tngram": "mini + TN-gram N 5, R 352 (the paper's module)",
    "mini-tngram-lean": "mini + TN-gram N 5, R 352, no RMSNorm, no absorption (ablation winners)",
    "mini-tngram-hsum": (
        "mini + TN-gram variant R 64, orders summed, + hashed orders 2-5, table lr x4"
    ),
    "mini-oe": "mini + Over-Encoding N 5, 2 slices, at TN-gram's Δparams",
    "mini-oe-longcat": "mini + Over-Encoding at LongCat-Flash's settings, at TN-gram's Δparams",
    "mini-pkm": "mini + product-key memory, 128^2 slots, top 8, 2 heads, value lr x4 (Lample)",
    "mini-stem": "mini + STEM token-indexed up-projection (FFN width 256) in layers 1 and 3, lr x1",
    "mini-ple": "mini + per-layer token embeddings (64 wide, gated) in every layer, table lr x1",
}


def recipe_names() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str) -> TrainConfig:
    if name not in RECIPES:
        from tngram.train.config import did_you_mean

        raise TngramError(
            f"unknown recipe {name!r}{did_you_mean(str(name), list(RECIPES))}; "
            f"valid recipes: {', '.join(RECIPES)}"
        )
    return RECIPES[name]()


def build_model(recipe_name: str, **model_overrides: Any) -> GPT:
    cfg = get_recipe(recipe_name).model
    return GPT(replace(cfg, **model_overrides) if model_overrides else cfg)


def param_summary(cfg: TrainConfig) -> dict[str, Any]:
    """{"recipe", "total_params", "delta_params", "memory_params"}: model.gpt.param_counts (meta
    device, nothing allocated), the same count the trainer prints and writes to summary.json."""
    n = param_counts(cfg.model)
    return {
        "recipe": cfg.name,
        "total_params": n["total_params"],
        "delta_params": n["delta_params"],
        "memory_params": n["memory_params"],
    }


# ---- a run's config: recipe + config file + --data + --steps + --set


def resolve_config(
    recipe: str | None,
    overrides: list[str],
    data: str | None = None,
    config_file: str | None = None,
    steps: int | None = None,
) -> TrainConfig:
    """The TrainConfig of recipe + config file + --data + --steps + --set, validated (no work
    done)."""
    settings: list[tuple[str, Any]] = []
    if config_file is not None:
        file_recipe, settings = load_config_file(config_file)
        recipe = recipe or file_recipe
    if recipe is None:
        raise TngramError(
            'name a RECIPE (see `tngram recipes`) or give a --config file with recipe = "..."'
        )
    cfg = get_recipe(recipe)
    if settings:
        cfg = apply_settings(cfg, settings, origin=str(config_file))
    if data is not None:
        cfg = replace(cfg, data=replace(cfg.data, dir=str(data)))
    cfg = with_schedule_steps(cfg, steps)
    cfg = apply_overrides(cfg, overrides)
    check_memory_layers_used(cfg, get_recipe(recipe))
    return named_for_memory(cfg, get_recipe(recipe))


def memory_kind(cfg: TrainConfig) -> str:
    """The memory family of a config: tngram, engram, oe, ... or none."""
    return "none" if cfg.model.memory is None else str(cfg.model.memory.kind)


def named_for_memory(cfg: TrainConfig, base: TrainConfig) -> TrainConfig:
    """A config whose settings changed its recipe's memory family is named RECIPE+memory=KIND
    (mini-raw with model.memory.kind=tngram is "mini-raw+memory=tngram", not "mini-raw"), so its
    log lines, summary.json and reports say what was trained. A name set explicitly is kept."""
    if cfg.name != base.name or memory_kind(cfg) == memory_kind(base):
        return cfg
    return replace(cfg, name=f"{base.name}+memory={memory_kind(cfg)}")
