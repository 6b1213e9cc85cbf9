"""Table-1-style report of a `tngram compare` folder (reads results.json + run folders only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import TngramError, atomic_write_text
from tngram.report.plots import loss_curves
from tngram.report.runs import fmt_mean_std, fmt_params, mean_std

# Paper Table 1 (L9: N=5, R=1024; L18: N=5, R=1800): delta params, train loss, val BPB, CORE.
PAPER_TABLE1 = {
    "paper-l9": {
        "raw": (None, 2.209, 1.251, 0.06),
        "engram": (26e6, 2.142, 1.209, 0.072),
        "tngram": (19e6, 2.141, 1.208, 0.083),
    },
    "paper-l18": {
        "raw": (None, 1.792, 1.086, 0.107),
        "engram": (60e6, 1.771, 1.070, 0.115),
        "tngram": (48e6, 1.770, 1.071, 0.120),
    },
}
NAMES = {"raw": "Raw GPT", "engram": "Engram", "tngram": "TN-gram", "oe": "Over-Encoding"}


def run_conditions(rows: list[dict[str, Any]]) -> dict[str, str]:
    """{run_dir: "1 thread, load 2.10"}: the torch threads and the 1-minute load average each
    run started with (its env.json), for report.md's tokens/s; "" where the run does not say."""
    from tngram.readback import load_json

    out = {}
    for r in rows:
        run = Path(str(r.get("run_dir", "")))
        try:
            env = load_json(run / "env.json", run) if (run / "env.json").is_file() else {}
        except TngramError:  # a report never fails on a run's provenance file
            env = {}
        t, load = env.get("torch_threads"), env.get("loadavg_1min")
        parts = [f"{t} thread{'s' if t != 1 else ''}"] if isinstance(t, int) else []
        parts += [f"load {load:.2f}"] if isinstance(load, (int, float)) else []
        out[str(r.get("run_dir", ""))] = ", ".join(parts)
    return out


def compare_table(results: dict[str, Any], conditions: dict[str, str] | None = None) -> str:
    """The Table-1-style markdown table. `conditions` (run_conditions): each method's threads and
    load at start beside its tokens/s (report.md)."""
    rows = results["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    paper = PAPER_TABLE1.get(results.get("preset", ""), {})
    has_core = any(r.get("core") is not None for r in rows)
    head = (
        ["Method", "ΔParams", "Train loss", "Val loss", "Val BPB"]
        + (["CORE"] if has_core else [])
        + ["tokens/s"]
    )
    if paper:
        head += ["paper ΔParams", "paper train loss", "paper val BPB", "paper CORE"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    raw_bpb = mean_std([r["val_bpb"] for r in rows if r["method"] == "raw"])[0]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        cells = [
            NAMES.get(m, m),
            fmt_params(rs[0].get("delta_params")),
            fmt_mean_std([r["train_loss"] for r in rs]),
            fmt_mean_std([r["val_loss"] for r in rs]),
            fmt_mean_std([r["val_bpb"] for r in rs]),
        ]
        if has_core:
            cells.append(fmt_mean_std([r.get("core") for r in rs]))
        tps = f"{mean_std([r['tokens_per_s'] for r in rs])[0]:,.0f}"
        if conditions:
            seen = list(dict.fromkeys(conditions.get(str(r.get("run_dir", "")), "") for r in rs))
            tps += f" ({'; '.join(c or '?' for c in seen)})" if any(seen) else ""
        cells.append(tps)
        if paper:
            p = paper.get(m, (None, None, None, None))
            cells += [fmt_params(p[0])] + ["–" if v is None else f"{v}" for v in p[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    n = len({r["seed"] for r in rows})
    lines.append("")
    lines.append(
        (
            "Mean ± std over {n} seeds" if n > 1 else "One seed (no spread: run --seeds 3 for one)"
        ).format(n=n)
        + ". Loss in nats/token; BPB = bits per UTF-8 byte of the "
        "validation text. ΔParams against the raw GPT of the same backbone."
    )
    if raw_bpb == raw_bpb:  # not NaN
        for m in methods:
            if m != "raw":
                d = mean_std([r["val_bpb"] for r in rows if r["method"] == m])[0] - raw_bpb
                lines.append(f"- {NAMES.get(m, m)}: val BPB {d:+.4f} vs raw GPT")
    paired = paired_metric(rows, "tngram", "engram")
    if paired:
        m, s = mean_std(paired)
        spread = f"mean {m:+.4f} ± {s:.4f}; " if len(paired) > 1 else ""
        lines.append(
            "- TN-gram − Engram val loss, paired by seed (same init and data order): "
            + ", ".join(f"{d:+.4f}" for d in paired)
            + f" ({spread}negative = TN-gram better)"
        )
        if results.get("preset") == "cpu":  # the mini recipes at their own settings
            seeds = "One untuned seed" if n == 1 else f"{n} untuned seeds"
            lines.append(
                f"- {seeds} can show how far each memory lowers the raw GPT's loss, not which "
                "memory is better: with each memory's table lr tuned, Engram is ahead of TN-gram "
                'on all three corpora (research/RESULTS.md, "Was each memory given its best '
                'settings?")'
            )
    return "\n".join(lines)


def paired_metric(
    rows: list[dict[str, Any]], a: str, b: str, metric: str = "val_loss"
) -> list[float]:
    """metric(a) − metric(b) for every seed that has both methods, in seed order."""
    by_seed: dict[Any, dict[str, float]] = {}
    for r in rows:
        if r.get(metric) is not None:
            by_seed.setdefault(r["seed"], {})[r["method"]] = r[metric]
    return [d[a] - d[b] for _, d in sorted(by_seed.items()) if a in d and b in d]


def method_pairs(methods: list[str]) -> list[tuple[str, str]]:
    """(later, earlier) for every pair, in the order given: raw, engram, tngram ->
    (engram, raw), (tngram, raw), (tngram, engram)."""
    return [
        (methods[j], methods[i]) for i in range(len(methods)) for j in range(i + 1, len(methods))
    ]


def _fmt_p(p: float) -> str:
    return "–" if p != p else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def significance_table(by_corpus: dict[str, list[dict[str, Any]]], metric: str = "val_loss") -> str:
    """Per pair of methods: paired mean difference with 95% CI, paired t-test p, sign-test p and
    sign-flip permutation p, per corpus and pooled over corpora (every (corpus, seed) pair one
    observation). Negative = the first-named method has the lower `metric`."""
    from tngram.report.stats import paired_stats

    methods = list(dict.fromkeys(r["method"] for rows in by_corpus.values() for r in rows))
    order = [m for m in ("raw", "engram", "tngram", "oe") if m in methods] + [
        m for m in methods if m not in ("raw", "engram", "tngram", "oe")
    ]
    lines = [
        f"Paired differences of {metric} (same seed = same backbone init and data order; "
        "negative = the first method is better). 95% CI from the t distribution; p two-sided.",
        "",
        "| pair | corpus | n | mean diff | 95% CI | t-test p | sign p | permutation p "
        "| first better / worse |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in method_pairs(order):
        pooled: list[float] = []
        groups = list(by_corpus.items())
        for corpus, rows in groups:
            d = paired_metric(rows, a, b, metric)
            pooled += d
            if d:
                lines.append(
                    _stats_row(f"{NAMES.get(a, a)} − {NAMES.get(b, b)}", corpus, paired_stats(d))
                )
        if len(groups) > 1 and pooled:
            lines.append(
                _stats_row(
                    f"{NAMES.get(a, a)} − {NAMES.get(b, b)}", "**pooled**", paired_stats(pooled)
                )
            )
    return "\n".join(lines)


def _stats_row(pair: str, corpus: str, s: Any) -> str:
    ci = "–" if s.ci_low != s.ci_low else f"[{s.ci_low:+.4f}, {s.ci_high:+.4f}]"
    return (
        f"| {pair} | {corpus} | {s.n} | {s.mean:+.4f} | {ci} | {_fmt_p(s.t_p)} | "
        f"{_fmt_p(s.sign_p)} | {_fmt_p(s.perm_p)} | {s.wins} / {s.losses} |"
    )


def write_compare_report(out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """report.md (and loss_curves.png) in `out`. Without the `report` extra (scipy, matplotlib)
    the table is still written; the significance table and the figure are replaced by a line
    saying what to install."""
    from tngram.common import MissingExtraError

    table = compare_table(results, run_conditions(results["rows"]))
    if len({r["seed"] for r in results["rows"]}) > 1:
        try:
            table += "\n\n" + significance_table(
                {Path(str(results.get("data") or out)).name: results["rows"]}
            )
        except MissingExtraError as e:
            table += f"\n\nNo significance table: {e}."
    runs: dict[str, list[str | Path]] = {}
    for r in results["rows"]:
        runs.setdefault(NAMES.get(r["method"], r["method"]), []).append(r["run_dir"])
    try:
        png = loss_curves(
            runs, out / "loss_curves.png", title=f"tngram compare --preset {results['preset']}"
        )
        figure = f"![loss curves]({png.name})"
    except MissingExtraError as e:
        png, figure = None, f"No figure: {e}."
    text = (
        f"# tngram compare — preset {results['preset']}\n\n"
        f"Data: `{results['data']}`\n\n{table}\n\n{figure}\n"
    )
    atomic_write_text(out / "report.md", text)
    return {"table": table, "png": png}
