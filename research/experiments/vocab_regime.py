"""TN-gram against Engram as the vocabulary grows (the rank-to-vocabulary ratio R/V).

    python -m research.experiments.vocab_regime run OUT QUEUE     (finished runs are reused)
    python -m research.experiments.vocab_regime report OUT research/results/vocab-regime.json
    python -m research.experiments.vocab_regime which-memory research/results/which-memory.json
    python -m research.experiments.vocab_regime time OUT LABEL    (a q3 run cut to 10 steps)
    python -m research.experiments.vocab_regime cost OUT research/results/vocab-32768-cost.json

Every run is `mini` (4 layers, d 128, 256 steps of 4,096 tokens) at V 4096 on a built-in corpus
(`default@4096`, `literature@4096`: SentencePiece-4096 trained on the corpus, as the default
1024 one; `tngram data build --vocab-size 4096 [--corpus literature]`), paired by seed with
Engram at the smallest per-head table budget whose Δparams is >= the other's (so TN-gram is
always at <= Engram's Δparams). Table learning rates: the literature-tuned factors of the
Pareto map (research.experiments.pareto.TUNED_DEFAULT: Engram x4, TN-gram x2; the hashed
variant at TN-gram's), not tuned again here.

Two settings differ from the mini recipes, for every family alike: fp32 instead of bf16 autocast
(this CPU's bf16 matmul runs the K/V backward of a 1,024-4,096-wide memory at 0.1-2 GFLOP/s,
14-21 in fp32: 50x the step), and optim.memory_update = "sparse" with catch-up (dense Adam's
arithmetic evaluated lazily on the rows read, tngram.optim.memory_update) so that tables of
10^7-10^8 entries fit a CPU step.

The queues (what one CPU core could finish in the time it had; research/RESULTS.md says which
cells are missing and what they would cost):

    q1   default@4096, seed 0: tngram-hashed R 256 / V' 256 / k 2 (R/V' = 1), paper TN-gram at
         <= its Δparams (R 27, R/V = 0.007), Engram at >= both (budget 788; one Engram run
         serves both pairs); paper TN-gram R 256 (R/V = 1/16) against Engram 10334
    q2   the first two pairs again at seed 1, then on literature@4096 at seed 0
    q3   default@32768, seed 0: mini-tngram-hsum's memory (R 64, R/V 0.002; hash_budget 3929)
         and tngram-hashed R 256 / V' 256 / k 2, each against Engram at >= its Δparams
    q4   q3's first pair (hsum against Engram) at seeds 1 and 2
    q5   q3's first pair on literature@32768 (the corpus settings are chosen on), seeds 0 and 1
    q6   default@4096, seed 0: paper TN-gram R 1024 (R/V = 1/4) against Engram at >= its Δparams
    q7   the same with R 2048 (R/V = 1/2)
    q8   q6's pair at seed 1
    q9   q6's pair on literature@4096, seed 0

Trained for research/results/vocab-regime.json: the first two pairs of q1 and of q2 (default,
seeds 0 and 1), q3, q4 and q5 (V 32768: hsum against Engram at seeds 0-2 on default and 0-1 on
literature, hashed rows at seed 0), q6-q9 (V 4096: R 1024 at seeds 0-1 and on literature, R 2048
at seed 0); the R 256 pair, q2's literature@4096 runs and R 4096 (stopped after 6 min of a core
short of step 10; R 1024 reached it in 126 s beside it) did not fit the CPU time and are not in
it. Queue q3 was timed (`time`, research/results/vocab-32768-cost.json).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import atomic_write_json
from research.experiments.common import base_recipe, corpus_data, with_data, with_memory, with_seed

HASHED_DELTA = 1_183_240  # Δparams of tngram-hashed R 256, V' 256, k 2 at V 4096 (mini)


def delta(cfg: Any) -> int:
    """The memory's Δparams over every memory layer of cfg's model (exact, analytic)."""
    m = cfg.model
    ids = tuple(m.memory_layers)
    return sum(
        m.memory.param_count(d_model=m.n_embd, vocab_size=m.vocab_size, layer_id=i, layer_ids=ids)
        for i in ids
    )


def _settings(cfg: Any) -> Any:
    cfg = replace(cfg, run=replace(cfg.run, dtype="fp32"))
    return replace(cfg, optim=replace(cfg.optim, memory_update="sparse", memory_catchup=True))


def _base(corpus: str, method: str) -> Any:
    return _settings(with_data(base_recipe("mini", method), *corpus_data(corpus)))


def _lr(cfg: Any, family: str) -> Any:
    from research.experiments.pareto import TUNED_DEFAULT, with_table_lr

    return with_table_lr(cfg, TUNED_DEFAULT[family])


def engram_at(corpus: str, target: int) -> tuple[Any, int]:
    """Engram with the smallest per-head budget whose Δparams is >= target, and that budget."""
    b = _base(corpus, "engram")
    n = b.model.memory.max_ngram - 1
    lo, hi = 1, 1 << 24
    while lo < hi:
        mid = (lo + hi) // 2
        if delta(with_memory(b, table_budget=(mid,) * n)) >= target:
            hi = mid
        else:
            lo = mid + 1
    return _lr(with_memory(b, table_budget=(lo,) * n), "engram"), lo


def tngram(corpus: str, cp_rank: int) -> Any:
    """The paper's TN-gram (N 5) at CP rank `cp_rank`."""
    return _lr(with_memory(_base(corpus, "tngram"), cp_rank=cp_rank), "tngram")


def hashed(corpus: str, cp_rank: int, rows: int, k: int) -> Any:
    """TN-gram with hashed factor rows (tngram.memory.tngram_hashed): R, V' rows, k hashes."""
    from tngram.memory.tngram_hashed import TNGramHashedConfig

    b = _base(corpus, "tngram")
    old = b.model.memory
    mem = TNGramHashedConfig(
        max_ngram=old.max_ngram,
        cp_rank=cp_rank,
        factor_rows=rows,
        n_hashes=k,
        pad_id=old.pad_id,
        kernel_size=old.kernel_size,
    )
    return _lr(replace(b, model=replace(b.model, memory=mem)), "tngram")


def hsum(corpus: str, hash_budget: int) -> Any:
    """mini-tngram-hsum's memory (R 64, orders summed, hashed orders 2..5 at 104 wide) at
    `hash_budget` per head, at its tuned table lr (Engram's)."""
    from research.experiments.pareto import VARIANTS

    cfg = with_memory(_base(corpus, "tngram"), **VARIANTS["tngram-hsum"], hash_budget=hash_budget)
    return _lr(cfg, "tngram-hsum")


def pair(corpus: str, fam: str, size: Any, cfg: Any, seed: int, target: int = 0) -> list[Any]:
    """[the family's run, Engram's run at >= its Δparams (and >= target)], both at `seed`."""
    from tngram.experiments.runner import RunSpec

    d = delta(cfg)
    e, budget = engram_at(corpus, max(d, target))
    cname = corpus.replace("@", "-v")
    tags = {"corpus": corpus, "seed_index": seed}
    return [
        RunSpec(
            f"{cname}-{fam}-{size}-s{seed}",
            with_seed(replace(cfg, name=f"vr-{fam}"), seed),
            {**tags, "family": fam, "size": size, "delta": d},
        ),
        RunSpec(
            f"{cname}-engram-{budget}-s{seed}",
            with_seed(replace(e, name="vr-engram"), seed),
            {
                **tags,
                "family": "engram",
                "size": budget,
                "delta": delta(e),
                "pair_of": f"{fam}-{size}",
            },
        ),
    ]


QUEUES = ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9")
HSUM_BUDGET = 3929  # mini-tngram-hsum's hash_budget (its V 1024 recipe), kept at V 32768


def raw_queue(name: str) -> list[Any]:
    """QUEUE's runs as pairs: each family run followed by its Engram run (an Engram run that
    serves two pairs appears twice)."""
    d4, l4 = "default@4096", "literature@4096"
    h = "r256-v256-k2"
    if name == "q1":
        return [
            *pair(d4, "tngram-hashed", h, hashed(d4, 256, 256, 2), 0),
            *pair(d4, "tngram", 27, tngram(d4, 27), 0, HASHED_DELTA),
            *pair(d4, "tngram", 256, tngram(d4, 256), 0),
        ]
    if name == "q2":
        return [
            *pair(d4, "tngram-hashed", h, hashed(d4, 256, 256, 2), 1),
            *pair(d4, "tngram", 27, tngram(d4, 27), 1, HASHED_DELTA),
            *pair(l4, "tngram-hashed", h, hashed(l4, 256, 256, 2), 0),
            *pair(l4, "tngram", 27, tngram(l4, 27), 0, HASHED_DELTA),
        ]
    if name == "q3":
        d32 = "default@32768"
        return [
            *pair(d32, "tngram-hsum", HSUM_BUDGET, hsum(d32, HSUM_BUDGET), 0),
            *pair(d32, "tngram-hashed", h, hashed(d32, 256, 256, 2), 0),
        ]
    if name == "q4":
        d32 = "default@32768"
        return [
            *pair(d32, "tngram-hsum", HSUM_BUDGET, hsum(d32, HSUM_BUDGET), 1),
            *pair(d32, "tngram-hsum", HSUM_BUDGET, hsum(d32, HSUM_BUDGET), 2),
        ]
    if name == "q5":
        l32 = "literature@32768"
        cfg = hsum(l32, HSUM_BUDGET)
        return [
            *pair(l32, "tngram-hsum", HSUM_BUDGET, cfg, 0),
            *pair(l32, "tngram-hsum", HSUM_BUDGET, cfg, 1),
        ]
    if name in ("q6", "q7", "q8", "q9"):
        r, c = (2048 if name == "q7" else 1024), (l4 if name == "q9" else d4)
        return pair(c, "tngram", r, tngram(c, r), int(name == "q8"))
    raise SystemExit(f"unknown queue {name!r}; valid: {', '.join(QUEUES)}")


def queue(name: str) -> list[Any]:
    """QUEUE's distinct runs, in training order."""
    return list({s.label: s for s in raw_queue(name)}.values())


def run(out: Path, name: str) -> None:
    from tngram.experiments.runner import run_all

    run_all(queue(name), out)


# ---- report ----------------------------------------------------------------------------------

# the independent reproduction (nanochat fork, d20 ~1B, 2026-09; research notes, not our runs):
# (V, R, N, CP − native bpb)
REPRODUCTION = [
    (32768, 10, 3, 0.0061),
    (32768, 80, 3, 0.0058),
    (32768, 400, 3, 0.0022),
    (1024, 256, 5, 0.0010),
    (1024, 1024, 5, -0.0020),
    (1024, 1024, 3, -0.0012),
    (4096, 1024, 5, 0.0009),
    (4096, 4096, 5, -0.0058),
    (4096, 4096, 3, -0.0056),
]


def _stats(diffs: list[float]) -> tuple[float, list[float] | None]:
    from tngram.report.stats import paired_stats

    s = paired_stats(diffs)
    ci = None if math.isnan(s.ci_low) else [s.ci_low, s.ci_high]
    return s.mean, ci


def _summary(out: Path, label: str) -> dict[str, Any] | None:
    p = out / "runs" / label / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else None


def pairs_table(out: Path) -> list[list[Any]]:
    """One row per (corpus, family point) with a finished pair: R/V (R/V' for hashed rows), seeds,
    Δparams and Engram's, then family − Engram (mean over seeds, 95% t interval) in val loss
    (nats) and val BPB. A point paired on several corpora also gets their pooled row (corpus
    "default+literature@V": every pair of each)."""
    groups: dict[tuple[str, str, str], list[tuple[dict, dict, dict]]] = {}
    for q in QUEUES:
        specs = raw_queue(q)
        for s, e in zip(specs[0::2], specs[1::2]):
            a, b = _summary(out, s.label), _summary(out, e.label)
            if a is None or b is None:
                continue
            key = (s.tags["corpus"], s.tags["family"], str(s.tags["size"]))
            groups.setdefault(key, []).append((a, b, e.tags))
    points: dict[tuple[int, str, str], list[str]] = {}  # one point on several corpora: pooled
    for corpus, fam, size in list(groups):
        points.setdefault((vocab_of(corpus), fam, size), []).append(corpus)
    for (vocab, fam, size), corpora in points.items():
        if len(corpora) > 1:
            pooled = "+".join(c.split("@")[0] for c in corpora) + f"@{vocab}"
            groups[(pooled, fam, size)] = [p for c in corpora for p in groups[(c, fam, size)]]
    rows = []
    for (corpus, fam, size), runs in groups.items():
        ml, cil = _stats([a["val_loss"] - b["val_loss"] for a, b, _ in runs])
        mb, cib = _stats([a["val_bpb"] - b["val_bpb"] for a, b, _ in runs])
        a0, b0, et = runs[0]
        rows.append(
            [
                corpus,
                _family_name(fam),
                size,
                round(_rank_over_vocab(fam, size, vocab_of(corpus)), 4),
                f"Engram {et['size']}",
                len(runs),
                a0["delta_params"],
                b0["delta_params"],
                ml,
                cil,
                mb,
                cib,
            ]
        )
    return rows


def vocab_of(corpus: str) -> int:
    """V of a "NAME@V" corpus."""
    return int(corpus.split("@")[1])


FAMILY_NAMES = {
    "tngram": "TN-gram (paper)",
    "tngram-hashed": "TN-gram hashed rows",
    "tngram-hsum": "TN-gram sum + hashed",
    "engram": "Engram",
}


def _family_name(fam: str) -> str:
    return FAMILY_NAMES.get(fam, fam)


def cp_rank_of(fam: str, size: str) -> int:
    """The CP rank of a pair's family point: its size (paper), the r of "rR-vV'-kK" (hashed rows),
    or the hsum variant's fixed R."""
    if fam == "tngram-hashed":
        return int(size.split("-")[0][1:])
    if fam == "tngram-hsum":
        from research.experiments.pareto import VARIANTS

        return int(VARIANTS["tngram-hsum"]["cp_rank"])
    return int(size)


def _rank_over_vocab(fam: str, size: str, vocab: int) -> float:
    """R/V (paper TN-gram, hsum) or R/V' (hashed rows: R over the pool rows)."""
    if fam == "tngram-hashed":
        r, v, _ = (int(x[1:]) for x in size.split("-"))
        return r / v
    return cp_rank_of(fam, size) / vocab


RESULTS = Path(__file__).resolve().parents[1] / "results"
MAP_POINTS = {  # the Pareto map's plain TN-gram points and their Engram pairs, by vocabulary
    "default": 1024,
    "literature": 1024,
    "code": 1024,
    "default@8192": 8192,
}
COLUMNS = [
    {"header": "source"},
    {"header": "V"},
    {"header": "memory"},
    {"header": "R"},
    {"header": "R/V (hashed: R/V')", "fmt": ".3f"},
    {"header": "corpus"},
    {"header": "seeds"},
    {"header": "Δparams", "fmt": "params"},
    {"header": "− Engram val loss (nats)", "fmt": "+.4f"},
    {"header": "95% CI", "fmt": "list:+.4f"},
    {"header": "− Engram val BPB", "fmt": "+.4f"},
    {"header": "95% CI (BPB)", "fmt": "list:+.4f"},
]


def _bpb_per_nat(corpus: str) -> float:
    """val BPB / val loss of the corpus's validation set (one constant per corpus and
    tokenizer: BPB = loss x tokens / (bytes ln 2)), from its Pareto table's Engram rows."""
    t = json.loads((RESULTS / f"pareto-{corpus}.json").read_text())
    engram = [r for r in t["rows"] if r[0] == "Engram"]
    return sum(b / x for r in engram for x, b in zip(r[4], r[5])) / sum(len(r[4]) for r in engram)


def map_rows() -> list[list[Any]]:
    """The Pareto map's paper TN-gram against Engram at the same size index (Δparams within
    1-4%), from research/results/pareto-vs-engram.json; BPB by the corpus's constant ratio."""
    pairs = json.loads((RESULTS / "pareto-vs-engram.json").read_text())["rows"]
    rows = []
    for r in pairs:
        corpus, memory, sizes, seeds, diff, ci = r[0], r[1], r[2], r[5], r[7], r[8]
        if memory != "TN-gram" or corpus not in MAP_POINTS:
            continue
        vocab, cp_rank = MAP_POINTS[corpus], int(sizes.split(" vs ")[0])
        table = json.loads((RESULTS / f"pareto-{corpus}.json").read_text())["rows"]
        dp = next(x[3] for x in table if x[0] == "TN-gram" and x[1] == str(cp_rank))
        k = _bpb_per_nat(corpus)
        rows.append(
            [
                "map (mini)",
                vocab,
                "TN-gram (paper)",
                cp_rank,
                cp_rank / vocab,
                corpus.split("@")[0],
                seeds,
                dp,
                diff,
                ci,
                diff * k,
                None if ci is None else [c * k for c in ci],
            ]
        )
    return rows


def new_rows(out: Path) -> list[list[Any]]:
    """The pairs of this experiment (pairs_table), in the table's columns."""
    rows = []
    fams = {v: k for k, v in FAMILY_NAMES.items()}
    for corpus, memory, size, rv, _, n, dp, _, ml, cil, mb, cib in pairs_table(out):
        rows.append(
            [
                "this run (mini, fp32)",
                vocab_of(corpus),
                memory,
                cp_rank_of(fams.get(memory, memory), size),
                rv,
                corpus.split("@")[0],
                n,
                dp,
                ml,
                cil,
                mb,
                cib,
            ]
        )
    return rows


def reproduction_rows() -> list[list[Any]]:
    return [
        [
            "reproduction (d20, N %d)" % n,
            v,
            "TN-gram (paper)",
            r,
            r / v,
            "its own",
            None,
            None,
            None,
            None,
            d,
            None,
        ]
        for v, r, n, d in REPRODUCTION
    ]


RUN_KEYS = ("delta_params", "steps", "train_loss", "val_loss", "val_bpb", "tokens_per_s", "wall_s")


def run_records(out: Path) -> dict[str, dict[str, Any]]:
    """{label: its summary's RUN_KEYS} of every finished run of the queues: the per-seed values
    behind each pair row."""
    found = {s.label: _summary(out, s.label) for q in QUEUES for s in raw_queue(q)}
    return {k: {f: v[f] for f in RUN_KEYS} for k, v in sorted(found.items()) if v is not None}


def report(out: Path, path: Path) -> None:
    """research/results/vocab-regime.json: every TN-gram − Engram pair by R/V, and the runs'
    own values (`runs`)."""
    rows = sorted(map_rows() + new_rows(out) + reproduction_rows(), key=lambda r: (r[1], r[4]))
    atomic_write_json(
        path,
        {
            "kind": "table",
            "command": (
                "python -m research.experiments.vocab_regime run runs/vocab-regime q1 (and q2-q9; "
                "runs side by side); python -m research.experiments.vocab_regime report "
                "runs/vocab-regime research/results/vocab-regime.json"
            ),
            "commit": (
                "V 4096 runs: a snapshot of 3afa763 with tngram/memory/tngram_hashed.py as in "
                "584b4cf, trained by a script listing this module's specs (same labels and "
                "configs); V 32768 runs: worktrees of b007945 (seed 0) and 5111bc4 (seeds 1, 2), "
                "each run as run_all([spec], OUT); literature@32768 (q5): worktrees of 39ebc63 "
                "(seed 0) and 9fe3f74 (seed 1); V 4096 R 1024 / 2048 (q6-q9): worktrees of "
                "56ac341 (q6), 335f64c (q7), 7efedf1 (q8), cfe76a4 (q9), each run as "
                "run_all([spec], OUT); map rows: pareto-vs-engram.json's"
            ),
            "machine": (
                "2-core AMD EPYC shared with other jobs (load 3-11); two to four training "
                "runs side by side, one torch thread each (the V 32768 and q6-q9 runs at nice "
                "19), fp32"
            ),
            "source": (
                "V 4096/32768 rows: runs/vocab-regime/runs/*/summary.json (pairs by seed); "
                "map rows: research/results/pareto-vs-engram.json (BPB = nats x the corpus's "
                "val BPB/loss ratio, pareto-CORPUS.json); reproduction rows: its reported bpb, "
                "not our runs"
            ),
            "columns": COLUMNS,
            "rows": rows,
            "runs": run_records(out),
        },
    )


def _cell(name: str, first: str, *keys: str) -> list[Any]:
    """The row of research/results/NAME.json whose first cells are (first, *keys)."""
    rows = json.loads((RESULTS / f"{name}.json").read_text())["rows"]
    return next(r for r in rows if r[0] == first and list(r[1 : 1 + len(keys)]) == list(keys))


README_COMMANDS = {  # the README's "Which memory" commands, by their --out
    "runs/hsum": "tngram train mini-tngram-hsum",
    "runs/engram-tuned": 'tngram train mini-engram --set "model.memory.table_budget=[3800,3800,'
    '3800,3800]" --set optim.memory_table_lr=0.2',
    "runs/engram-iso": "tngram train mini-engram --set model.mlp_hidden=64 --set "
    'model.memory.n_embed_per_ngram=32 --set "model.memory.table_budget=[400,400,400,400]" '
    "--set optim.memory_table_lr=0.2",
    "runs/hsum-8192": "tngram train mini-tngram-hsum --set model.vocab_size=8192 --set "
    "model.memory.hash_budget=94547",
    "runs/hsum-32768": "tngram train mini-tngram-hsum --set model.vocab_size=32768 --set "
    "run.dtype=fp32 --set optim.memory_update=sparse --set optim.memory_catchup=true",
    "runs/engram-32768": "tngram train mini-engram --set model.vocab_size=32768 --set "
    '"model.memory.table_budget=[23624,23624,23624,23624]" --set optim.memory_table_lr=0.2 '
    "--set run.dtype=fp32 --set optim.memory_update=sparse --set optim.memory_catchup=true",
}


def which_memory(vocab_table: Path) -> dict[str, Any]:
    """research/results/which-memory.json: the README's recipe per vocabulary and binding
    constraint, each with its command (README_COMMANDS, by --out) and the paired difference that
    command's config produced (cells of the results files each row names)."""
    pooled = _cell("pareto-vs-engram", "3 corpora pooled", "TN-gram sum + hashed", "3929 vs 3800")
    v8k = _cell("pareto-vs-engram", "default@8192", "TN-gram sum + hashed", "94547 vs 81920")
    iso = _cell("pareto-default-total", "Engram (E 32), iso (400)")
    big = json.loads(vocab_table.read_text())["rows"]
    rows = [
        [
            "≤ 4k",
            "extra parameters",
            "TN-gram sum + hashed",
            "`runs/hsum`",
            pooled[7],
            pooled[8],
            pooled[5],
            "tuned Engram 3,800, three corpora",
        ],
        [
            "≤ 4k",
            "step time",
            "tuned Engram",
            "`runs/engram-tuned`",
            -pooled[7],
            [-pooled[8][1], -pooled[8][0]],
            pooled[5],
            "the row above (0.97× its step)",
        ],
        [
            "≤ 4k",
            "total parameters",
            "Engram 32 wide, MLP 64",
            "`runs/engram-iso`",
            iso[4],
            iso[5],
            len(iso[3]),
            "raw GPT, default corpus",
        ],
        [
            "8k",
            "extra parameters",
            "TN-gram sum + hashed",
            "`runs/hsum-8192`",
            v8k[7],
            v8k[8],
            v8k[5],
            "tuned Engram 81,920, default corpus",
        ],
    ]
    v32k = ["this run (mini, fp32)", 32768, FAMILY_NAMES["tngram-hsum"]]
    # the 32k row: the pooled pairs of every corpus trained there, else the default corpus's
    at32k = {r[5]: r for r in big if r[:3] == v32k}
    r = at32k.get("default+literature", at32k["default"])
    on = "default and literature corpora" if r[5] == "default+literature" else "default corpus"
    ahead = r[8] < 0
    rows.append(
        [
            "32k (measured at 32,768)",
            "extra parameters",
            "TN-gram sum + hashed" if ahead else "Engram",
            "`runs/hsum-32768`" if ahead else "`runs/engram-32768`",
            r[8] if ahead else -r[8],
            r[9] if ahead or r[9] is None else [-r[9][1], -r[9][0]],
            r[6],
            f"Engram 23,624, {on}"
            if ahead
            else f"TN-gram sum + hashed (R 64) at <= its Δparams, {on}",
        ]
    )
    return {
        "kind": "table",
        "command": "python -m research.experiments.vocab_regime which-memory "
        "research/results/which-memory.json",
        "commit": "those of the files it cites (pareto-vs-engram.json, "
        "pareto-default-total.json, vocab-regime.json)",
        "machine": "those files' (2-core AMD EPYC)",
        "source": "the rows' results files; commands: README_COMMANDS",
        "commands": {r[3].strip("`"): README_COMMANDS[r[3].strip("`")] for r in rows},
        "columns": [
            {"header": "vocabulary"},
            {"header": "binding constraint"},
            {"header": "use"},
            {"header": "command (below)"},
            {"header": "− reference (val loss)", "fmt": "+.4f"},
            {"header": "95% CI", "fmt": "list:+.4f"},
            {"header": "seeds"},
            {"header": "paired with"},
        ],
        "rows": rows,
    }


# ---- what a V 32768 run costs ------------------------------------------------------------------

FULL_STEPS = 256  # the mini recipes' schedule
TIMED_STEPS = 10


def time_run(out: Path, label: str) -> None:
    """Queue q3's run `label`, its schedule cut to TIMED_STEPS steps, into OUT/runs/LABEL."""
    from tngram.experiments.common import with_steps
    from tngram.experiments.runner import run_all

    specs = {s.label: s for s in queue("q3")}
    if label not in specs:
        raise SystemExit(f"unknown label {label!r}; queue q3's: {', '.join(specs)}")
    spec = specs[label]
    run_all([replace(spec, config=with_steps(spec.config, TIMED_STEPS))], out)


def cost(out: Path) -> dict[str, Any]:
    """research/results/vocab-32768-cost.json: the V 32768 dataset's size, and per timed run of
    queue q3 its rate and what a full run would take at that rate (FULL_STEPS steps at its
    tokens/s, plus its wall time outside training: start-up and the final evaluation)."""
    import numpy as np

    from tngram.data.build import open_dataset
    from tngram.data.shards import read_shard

    info = open_dataset(corpus_data("default@32768")[0])
    train = np.concatenate([read_shard(f) for f in info.train_files])
    val_tokens = sum(len(read_shard(f)) for f in info.val_files)
    rows = []
    for s in queue("q3"):
        m = _summary(out, s.label)
        if m is None:
            continue
        outside = m["wall_s"] - m["train_time_s"]
        step_tokens = m["tokens"] / m["steps"]
        full_h = (FULL_STEPS * step_tokens / m["tokens_per_s"] + outside) / 3600
        fam = _family_name(s.tags["family"])
        rows.append(
            [
                fam,
                str(s.tags["size"]),
                m["delta_params"],
                m["steps"],
                m["tokens_per_s"],
                m["train_time_s"],
                outside,
                full_h,
            ]
        )
    return {
        "kind": "table",
        "command": "python -m research.experiments.vocab_regime time runs/v32768-cost LABEL (each "
        "of queue q3's four labels, two at a time); python -m research.experiments.vocab_regime "
        "cost runs/v32768-cost research/results/vocab-32768-cost.json",
        "commit": "ec7485e (a detached worktree) with this module's q3 specs as in 58f422e, timed "
        "by a script doing what `time` does",
        "machine": "2-core AMD EPYC shared with other sessions' jobs (1-minute load average 10-17 "
        "while timing); one torch thread per run, two runs side by side, fp32",
        "source": "OUT/runs/*/summary.json; the dataset: tngram data build --vocab-size 32768",
        "dataset": {
            "vocab_size": info.vocab_size,
            "train_tokens": int(train.size),
            "val_tokens": int(val_tokens),
            "pieces_in_train": int(np.count_nonzero(np.bincount(train, minlength=info.vocab_size))),
        },
        "columns": [
            {"header": "memory"},
            {"header": "size"},
            {"header": "Δparams", "fmt": "params"},
            {"header": "steps timed"},
            {"header": "tokens/s", "fmt": ".0f"},
            {"header": "train s", "fmt": ".0f"},
            {"header": "start-up + eval s", "fmt": ".0f"},
            {"header": f"{FULL_STEPS} steps at this rate (h)", "fmt": ".1f"},
        ],
        "rows": rows,
    }


if __name__ == "__main__":
    cmd, out = sys.argv[1], Path(sys.argv[2])
    if cmd == "run":
        run(out, sys.argv[3])
    elif cmd == "report":
        report(out, Path(sys.argv[3]))
    elif cmd == "time":
        time_run(out, sys.argv[3])
    elif cmd == "cost":
        atomic_write_json(Path(sys.argv[3]), cost(out))
    elif cmd == "which-memory":
        atomic_write_json(out, which_memory(RESULTS / "vocab-regime.json"))
    else:
        raise SystemExit(__doc__)
