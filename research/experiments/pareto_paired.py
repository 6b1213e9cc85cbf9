"""The map's paired comparison of each TN-gram family with Engram at the same size index, by
seed (`paired_rows`), and the pairs that need their own step timing (`candidate_pairs`)."""

from __future__ import annotations

import statistics
from typing import Any

from research.experiments.pareto_keys import LABELS, point_key

PAIRED_FAMILIES = (
    "tngram",
    "tngram-lean",
    "tngram-sum",
    "tngram-shared",
    "tngram-hybrid",
    "tngram-hsum",
)
# how far above 1 a pair's 5-rep step ratio may be and the pair still be timed by the multi-process
# protocol before a verdict: the points' 5-rep medians moved 0.93-1.10x between two timings
# (research/RESULTS.md), so a pair at 1.01 on them may be below 1 on its own timing, and the reverse
STEP_NOISE = 0.10


def paired_rows(
    rows: list[dict[str, Any]],
    bench: dict[str, Any],
    sizes: dict[str, tuple],
    corpus_sizes: dict[str, dict[str, tuple]] | None = None,
) -> list[list[Any]]:
    """One row per (corpus, family in PAIRED_FAMILIES, size index) with a finished Engram twin: the
    family's val loss minus Engram's at the same size index (`sizes`: family -> its sizes), paired
    by seed over every seed both have (the confirmation's extra seeds included): n, Engram's mean,
    mean difference with its 95% t interval, wins/losses, and Δparams and step time as ratios to
    Engram's. "beats Engram" needs Δparams <= Engram's, step <= Engram's and the interval below 0;
    it says "yes" only when the step ratio is the pair's own multi-process timing
    (bench["confirm_steps"], `step_ratio`), "candidate" when the loss and Δparams pass and the
    points' 5-rep step ratio is within 1 + STEP_NOISE (those medians move by several percent
    between timings, so they decide nothing near 1; `candidate_pairs` lists those pairs).
    `corpus_sizes` replaces `sizes` for the corpora it names (the vocabulary-8192 setting)."""
    return [row for row, _ in _paired(rows, bench, sizes, corpus_sizes)]


def candidate_pairs(
    rows: list[dict[str, Any]],
    bench: dict[str, Any],
    sizes: dict[str, tuple],
    corpus_sizes: dict[str, dict[str, tuple]] | None = None,
) -> list[list[str]]:
    """[family point key, Engram point key] of every paired row that says "candidate": the pairs
    whose step ratio must be timed by `step_ratio`'s multi-process protocol before a "yes"."""
    pairs = [
        pair for row, pair in _paired(rows, bench, sizes, corpus_sizes) if row[-1] == "candidate"
    ]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in pairs)]


def _paired(
    rows: list[dict[str, Any]],
    bench: dict[str, Any],
    sizes: dict[str, tuple],
    corpus_sizes: dict[str, dict[str, tuple]] | None,
) -> list[tuple[list[Any], list[str]]]:
    """paired_rows' rows, each with its [family point key, Engram point key]."""
    loss = {(r["corpus"], r["family"], r["size"], r["seed"]): r for r in rows}
    seeds_of: dict[tuple, set] = {}  # (corpus, family, size) -> its seeds
    for k in loss:
        seeds_of.setdefault(k[:3], set()).add(k[3])
    steps = bench.get("points", {})
    out: list[Any] = []
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        cs = (corpus_sizes or {}).get(corpus, sizes)  # this corpus's sizes
        for fam in PAIRED_FAMILIES:
            for i, size in enumerate(cs.get(fam, ())):
                e_size = cs["engram"][i] if i < len(cs.get("engram", ())) else None
                seeds = sorted(
                    seeds_of.get((corpus, fam, size), set())
                    & seeds_of.get((corpus, "engram", e_size), set())
                )
                if not seeds:
                    continue
                a = [loss[(corpus, fam, size, s)] for s in seeds]
                b = [loss[(corpus, "engram", e_size, s)] for s in seeds]
                diffs = [x["val_loss"] - y["val_loss"] for x, y in zip(a, b)]
                ka, kb = point_key(fam, size, corpus), point_key("engram", e_size, corpus)
                ta, tb = steps.get(ka, {}).get("step_ms"), steps.get(kb, {}).get("step_ms")
                t_ratio, timed = (ta / tb if ta and tb else None), False
                for confirm in bench.get("confirm_steps", []):
                    if confirm["pair"] == [ka, kb]:
                        t_ratio, timed = confirm["ratio"], True  # the pair's own, longer timing
                p_ratio, label = a[0]["delta_params"] / b[0]["delta_params"], f"{size} vs {e_size}"
                out.append(
                    (
                        _paired_row(
                            corpus,
                            fam,
                            label,
                            p_ratio,
                            t_ratio,
                            [y["val_loss"] for y in b],
                            diffs,
                            timed,
                        ),
                        [ka, kb],
                    )
                )
                if "@" not in corpus:  # the vocabulary setting is another model
                    pool = pooled.setdefault(
                        (fam, label),
                        {
                            "p_ratio": p_ratio,
                            "t_ratio": t_ratio,
                            "engram": [],
                            "diffs": [],
                            "corpora": 0,
                            "timed": timed,
                            "pair": [ka, kb],
                        },
                    )
                    pool["engram"] += [y["val_loss"] for y in b]
                    pool["diffs"] += diffs
                    pool["corpora"] += 1
    for (fam, label), pool in pooled.items():
        if pool["corpora"] > 1:
            out.append(
                (
                    _paired_row(
                        f"{pool['corpora']} corpora pooled",
                        fam,
                        label,
                        pool["p_ratio"],
                        pool["t_ratio"],
                        pool["engram"],
                        pool["diffs"],
                        pool["timed"],
                    ),
                    pool["pair"],
                )
            )
    return out


def _paired_row(
    corpus: str,
    fam: str,
    sizes_txt: str,
    p_ratio: float,
    t_ratio: float | None,
    engram: list[float],
    diffs: list[float],
    timed: bool = False,
) -> list[Any]:
    from tngram.report.stats import paired_stats

    st = paired_stats(diffs)
    loss_and_params = p_ratio <= 1 and t_ratio is not None and st.n > 1 and st.ci_high < 0
    if timed:
        verdict = "yes" if loss_and_params and t_ratio is not None and t_ratio <= 1 else "no"
    else:
        fast = t_ratio is not None and t_ratio <= 1 + STEP_NOISE
        verdict = "candidate" if loss_and_params and fast else "no"
    return [
        corpus,
        LABELS[fam],
        sizes_txt,
        p_ratio,
        t_ratio,
        st.n,
        statistics.fmean(engram),
        st.mean,
        None if st.n < 2 else [st.ci_low, st.ci_high],
        f"{st.wins}/{st.losses}",
        st.sign_p,
        verdict,
    ]


PAIRED_COLUMNS = [
    {"header": "corpus"},
    {"header": "memory"},
    {"header": "size vs Engram's"},
    {"header": "Δparams / Engram's", "fmt": ".3f"},
    {"header": "step / Engram's", "fmt": ".3f"},
    {"header": "seeds"},
    {"header": "Engram val loss", "fmt": ".4f"},
    {"header": "− Engram (mean)", "fmt": "+.4f"},
    {"header": "95% CI", "fmt": "list:+.4f"},
    {"header": "better/worse seeds"},
    {"header": "sign test p", "fmt": ".3g"},
    {"header": "beats Engram at ≤ params and ≤ step"},
]
