"""What `python -m research experiment pareto` reads back: fronts, "best memory at ≤ budget"
tables, figures, the paired comparison with Engram, each point's cost axes, and the report and
results files (the sweep that produces the runs and the timing: research.experiments.pareto).

Pure pieces (tested against brute force in tests/test_pareto.py):
    pareto_front(points)      indices of the points no other point beats on both cost and loss
    best_under(points, cap)   the lowest-loss point whose cost is ≤ cap
    optimizer_state_bytes     what Adam (2 fp32 moments), Muon (1 fp32 momentum) and the memory
                              tables' optimiser (optim.memory_update) hold
    point_costs(model)        a point's machine-independent cost axes (below)

Labels and keys: LABELS, `point_key` (a point's timing key), `name_of`, the budget caps.

The paired comparison of each TN-gram family with Engram at the same size index, by
seed (`paired_rows`), and the pairs that need their own step timing (`candidate_pairs`).

Cost axes of a map point that do not depend on the machine: table rows read per token, bytes
of table rows read per token, forward FLOPs per token, total parameters (`point_costs`).

Counting conventions (one token, one forward, batch and sequence amortised):
- rows: lookup-table rows gathered (all memory layers); bytes: those rows x their width x 4
  (fp32 tables). Dense parameters read once per batch (the product keys, projections) are not
  counted as rows or bytes.
- FLOPs: 2 per multiply-add of every matrix product (linears, the tied head), attention
  2 x 2 x d x T_ctx per block with T_ctx = (T + 1) / 2, the mean causal context of a
  sequence_len-T window; elementwise work is counted where it is a memory's own arithmetic (the
  product keys' k^2 candidate sums, the gated products, TN-gram's CP products), never for norms,
  softmax or activations.

Per family, per memory layer (d model width, M hc branches, k conv kernel; GatedFusion's K/V
projections, its gate dots and depthwise conv: 2 (M + 1) d_mem d + 2 M d + 2 M d k):
    engram   rows (N-1) H of width E/H                         FLOPs fusion(d_mem = (N-1) E)
    tngram   rows N of width R (A_1..A_N), + H per hashed order    2 N R (CP products and
             of width hash_embed/H                                  absorption) + [2 d_in kv_rank]
                                                                    + fusion(d_mem)
    oe       rows S = k (N-1) slices of width d_s (once: the embedding)   2 S d_s d
    pkm      rows H topk of width d         2 d H Kd + 2 H n Kd + H k^2 + 2 H k d
    stem     rows 1 of width F              4 d F + F
    ple      rows 1 of width P              2 P d [+ 2 d P + P when gated]
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from tngram.common import atomic_write_json, atomic_write_text, print0

from research.report.markdown import read_results

Point = tuple[float, float]  # (cost, loss)

# "best at ≤ P" caps: Δparams (M) and step time as a multiple of the raw GPT's step
PARAM_CAPS_M = (1.5, 3.0, 5.0, 10.0, 13.0)
STEP_CAPS_X = (1.25, 1.5, 2.0, 3.0, 5.0)
LABELS = {
    "raw": "raw GPT",
    "engram": "Engram",
    "tngram": "TN-gram",
    "oe": "Over-Encoding",
    "longcat": "Over-Encoding (LongCat n4 k4)",
    "dense": "dense (wider GPT)",
    "tngram-lean": "TN-gram lean",
    "tngram-sum": "TN-gram sum-K/V",
    "tngram-shared": "TN-gram shared",
    "tngram-hybrid": "TN-gram + hashed",
    "tngram-hsum": "TN-gram sum + hashed",
    "pkm": "product keys",
    "stem": "STEM",
    "ple": "per-layer embeddings",
    "engram-iso": "Engram (E 32), iso",
    "tngram-sum-iso": "TN-gram sum-K/V, iso",
    "pkm-iso": "product keys, iso",
    "stem-iso": "STEM, iso",
    "ple-iso": "per-layer embeddings, iso",
}


def point_key(family: str, size: Any, corpus: str = "") -> str:
    """The timing key of a point: family and size, plus "@V" for a corpus tokenised with another
    vocabulary ("default@8192"): the step depends on the vocabulary, not on the text."""
    key = family if size is None else f"{family}-{size}"
    return key + ("@" + corpus.partition("@")[2] if "@" in corpus else "")


def name_of(p: dict[str, Any]) -> str:
    return LABELS.get(p["family"], p["family"]) + ("" if p["size"] is None else f" ({p['size']})")


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices (ascending cost) of points not dominated: no other point has cost ≤ and loss ≤ with
    one of them strictly lower. Ties in both keep the first."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def best_under(points: Sequence[Point], cap: float) -> int | None:
    """Index of the lowest-loss point with cost ≤ cap (first on ties); None when none fits."""
    fit = [i for i, (c, _) in enumerate(points) if c <= cap]
    return min(fit, key=lambda i: (points[i][1], i)) if fit else None


def optimizer_state_bytes(cfg: Any) -> dict[str, int]:
    """Bytes of optimiser state the trainer keeps for `cfg`'s model, by the rule of
    tngram.optim.memory_update.param_state_bytes (the one `tngram plan` counts by): Adam holds two
    fp32 moments per parameter, Muon one fp32 momentum buffer (tngram.optim.muon), and the memory
    tables follow cfg.optim.memory_update (rowwise: 4 + 4/width B per parameter). "memory" counts
    the memory's own parameters (tables/factors and its K/V, gate, conv, scales)."""
    import torch
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups, memory_table_params
    from tngram.optim.memory_update import param_state_bytes

    with torch.device("meta"):
        model = GPT(cfg.model)
    tables = {id(p) for p in memory_table_params(model)}
    mods = [b.memory for b in model.blocks if b.memory is not None] + (
        [model.embed_memory] if model.embed_memory is not None else []
    )
    mem_ids = {id(p) for m in mods for p in m.parameters()}  # shared factors count once (a set)
    total = memory = 0
    for g in build_param_groups(model, cfg.optim):
        for p in g["params"]:
            b = param_state_bytes(
                g["optimizer"],
                p.shape,
                cfg.optim.memory_update,
                id(p) in tables,
                cfg.optim.memory_catchup,
            )
            total += b
            memory += b if id(p) in mem_ids else 0
    return {"total": total, "memory": memory}


def read_core_score(run_dir: Path, max_per_task: int | None) -> float | None:
    """CORE of a run from RUN/eval/core-maxN.json (N = max_per_task), None when not evaluated."""
    if not max_per_task:
        return None
    f = run_dir / "eval" / f"core-max{max_per_task}.json"
    from tngram.readback import read_core_file

    return float(read_core_file(f, run_dir)["core"]) if f.is_file() else None


def collect(out: Path, specs: list[Any], core_max: int | None = None) -> list[dict[str, Any]]:
    """One row per finished run (summary.json present, same config as its spec): tags + the numbers
    the map needs."""
    from tngram.train.recipes import param_summary
    from tngram.experiments.runner import is_complete, run_dir_of

    raw_total: dict[str, int] = {}
    for s in specs:
        if s.tags["family"] == "raw":
            raw_total[s.tags["corpus"]] = param_summary(s.config)["total_params"]
    rows = []
    for s in specs:
        f = run_dir_of(out, s) / "summary.json"
        if not is_complete(run_dir_of(out, s), s.config):
            continue
        from tngram.readback import get, read_summary_file

        summ = read_summary_file(f, run_dir_of(out, s))  # checked: one line naming a bad field
        get(summ, "total_params", "int", str(f), lo=0)
        for k in ("val_loss", "val_bpb", "train_loss"):  # a point of the map: finite, never null
            get(summ, k, "float", str(f))
        total = int(summ["total_params"])
        delta = total - raw_total.get(s.tags["corpus"], total)
        rows.append(
            {
                **s.tags,
                "label": s.label,
                "seed": s.config.run.seed,
                "delta_params": delta,
                "total_params": total,
                "val_loss": summ["val_loss"],
                "val_bpb": summ["val_bpb"],
                "train_loss": summ["train_loss"],
                "opt_state_bytes": optimizer_state_bytes(s.config),
                "table_lr": s.config.optim.memory_table_lr,
                "core": read_core_score(run_dir_of(out, s), core_max),
                "view": s.tags.get("view", "params"),  # "total": on an iso-parameter backbone
                "mlp_width": s.config.model.mlp_width(),
                **{k: v for k, v in point_costs(s.config.model).items() if k != "total_params"},
            }
        )
    return rows


def aggregate(rows: list[dict[str, Any]], bench: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per (corpus, family, size): losses per seed, Δparams, timing."""
    pts: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r.get("confirm"):
            continue  # the confirmation's extra seeds feed paired_rows only
        key = (r["corpus"], r["family"], r["size"])
        p = pts.setdefault(
            key,
            {
                "corpus": r["corpus"],
                "family": r["family"],
                "size": r["size"],
                "delta_params": r["delta_params"],
                "opt_state_bytes": r["opt_state_bytes"],
                **{k: r.get(k) for k in COST_KEYS},
                # "total": on an iso-parameter backbone (corpus_tables keeps it off the Δ map)
                "view": r.get("view", "params"),
                "mlp_width": r.get("mlp_width"),
                "val_loss": [],
                "val_bpb": [],
                "core": [],
                "seeds": [],
            },
        )
        if r.get("core") is not None:
            p["core"].append(r["core"])
        p["val_loss"].append(r["val_loss"])
        p["val_bpb"].append(r["val_bpb"])
        p["seeds"].append(r["seed"])
    for p in pts.values():
        t = bench.get("points", {}).get(point_key(p["family"], p["size"], p["corpus"]), {})
        p["step_ms"], p["decode_ms_per_token"] = t.get("step_ms"), t.get("decode_ms_per_token")
        p["loss"] = statistics.fmean(p["val_loss"])
    order = {f: i for i, f in enumerate(LABELS)}
    return sorted(
        pts.values(),
        key=lambda p: (p["corpus"], order.get(p["family"], len(order)), p["delta_params"]),
    )


def total_rows(points: list[dict[str, Any]], raw: dict[str, Any] | None) -> list[list[Any]]:
    """The "= total parameters" view: the raw GPT, then each point on an iso-parameter backbone
    (view "total"): its MLP width, total parameters, seeds, val loss, val loss minus the raw
    GPT's paired by seed (mean, 95% t interval, better/worse seeds; seeds the raw GPT lacks are
    left out), measured step over the raw GPT's (None where either is untimed) and the CORE
    scores of its seeds (None when none was scored)."""
    from tngram.report.stats import paired_stats

    raw_by_seed = {} if raw is None else dict(zip(raw["seeds"], raw["val_loss"]))
    iso = [p for p in points if p.get("view") == "total"]
    fams = list(dict.fromkeys(p["family"] for p in iso))  # families in the map's order
    iso.sort(key=lambda p: (fams.index(p["family"]), p["size"] or 0))  # each by size
    out = []
    for p in ([raw] if raw is not None else []) + iso:
        timed = raw is not None and raw.get("step_ms") and p.get("step_ms") is not None
        ratio = p["step_ms"] / raw["step_ms"] if timed and raw is not None else None
        diffs = [x - raw_by_seed[s] for s, x in zip(p["seeds"], p["val_loss"]) if s in raw_by_seed]
        st = paired_stats(diffs) if diffs and p is not raw else None
        out.append(
            [
                name_of(p),
                p["mlp_width"],
                p["total_params"],
                p["val_loss"],
                0.0 if p is raw else (None if st is None else st.mean),
                None if st is None or st.n < 2 else [st.ci_low, st.ci_high],
                None if st is None else f"{st.wins}/{st.losses}",
                ratio,
                p.get("core") or None,
            ]
        )
    return out


def corpus_tables(points: list[dict[str, Any]], corpus: str) -> dict[str, Any]:
    """The tables of one corpus: every point and best at ≤ P parameters (points on an
    iso-parameter backbone left out: their Δparams is not what they add), best at ≤ S step time
    (every timed point), and the "= total parameters" view (`total_rows`)."""
    everything = [p for p in points if p["corpus"] == corpus]
    pts = [p for p in everything if p.get("view") != "total"]
    raw = next((p for p in pts if p["family"] == "raw"), None)
    by_params = [(p["delta_params"], p["loss"]) for p in pts]
    front_p = set(pareto_front(by_params))
    timed = [i for i, p in enumerate(pts) if p["step_ms"] is not None]
    front_s = {timed[j] for j in pareto_front([(pts[i]["step_ms"], pts[i]["loss"]) for i in timed])}
    rows = []
    for i, p in enumerate(pts):
        rows.append(
            [
                LABELS.get(p["family"], p["family"]),
                "–" if p["size"] is None else str(p["size"]),
                len(p["seeds"]),
                p["delta_params"],
                p["val_loss"],
                p["val_bpb"],
                p["core"] or None,
                None if p["step_ms"] is None else p["step_ms"],
                None if p["decode_ms_per_token"] is None else p["decode_ms_per_token"],
                p["opt_state_bytes"]["memory"] / 1e6,
                *(p.get(k) for k in COST_KEYS),
                ("params" if i in front_p else "")
                + (
                    " + time" if i in front_s and i in front_p else ("time" if i in front_s else "")
                ),
            ]
        )
    best_p = []
    for cap in PARAM_CAPS_M:
        j = best_under(by_params, cap * 1e6)
        if j is not None:
            best_p.append(
                [f"≤ {cap:g}M", name_of(pts[j]), pts[j]["delta_params"], pts[j]["val_loss"]]
            )
    best_s = []
    if raw is not None and raw["step_ms"]:
        # every timed point, those on an iso-parameter backbone included
        timed_all = [p for p in everything if p["step_ms"] is not None]
        sp = [(p["step_ms"] / raw["step_ms"], p["loss"]) for p in timed_all]
        for cap in STEP_CAPS_X:
            j = best_under(sp, cap)
            if j is not None:
                q = timed_all[j]
                best_s.append(
                    [f"≤ {cap:g}× raw", name_of(q), q["step_ms"], q["delta_params"], q["val_loss"]]
                )
    return {
        "points": rows,
        "best_params": best_p,
        "best_step": best_s,
        "total": total_rows(everything, raw),
    }


def _table_file(
    kind_rows: list[list[Any]], columns: list[dict[str, str]], meta: dict[str, Any]
) -> dict[str, Any]:
    return {"kind": "table", **meta, "columns": columns, "rows": kind_rows}


POINT_COLUMNS = [
    {"header": "memory"},
    {"header": "size"},
    {"header": "seeds"},
    {"header": "Δparams", "fmt": "params"},
    {"header": "val loss", "fmt": "mean_std:.4f"},
    {"header": "val BPB", "fmt": "mean_std:.4f"},
    {"header": "CORE", "fmt": "mean_std:.4f"},
    {"header": "step ms", "fmt": ".0f"},
    {"header": "decode ms/token", "fmt": ".2f"},
    {"header": "memory optimiser state (MB)", "fmt": ".1f"},
    {"header": "total params", "fmt": "params"},
    {"header": "table rows/token"},
    {"header": "table bytes/token"},
    {"header": "forward FLOPs/token"},
    {"header": "on the front"},
]
# machine-independent cost axes of every point (point_costs), in POINT_COLUMNS order
COST_KEYS = ("total_params", "rows_per_token", "bytes_per_token", "flops_per_token")
TOTAL_COLUMNS = [
    {"header": "memory (= raw GPT's total parameters)"},
    {"header": "MLP width"},
    {"header": "total params", "fmt": "params"},
    {"header": "val loss", "fmt": "mean_std:.4f"},
    {"header": "− raw GPT (paired mean)", "fmt": "+.4f"},
    {"header": "95% CI", "fmt": "list:+.4f"},
    {"header": "better/worse seeds"},
    {"header": "step / raw GPT's", "fmt": ".2f"},
    {"header": "CORE", "fmt": "mean_std:.4f"},
]
BEST_P_COLUMNS = [
    {"header": "Δparams budget"},
    {"header": "best"},
    {"header": "Δparams", "fmt": "params"},
    {"header": "val loss", "fmt": "mean_std:.4f"},
]
BEST_S_COLUMNS = [
    {"header": "step-time budget"},
    {"header": "best"},
    {"header": "step ms", "fmt": ".0f"},
    {"header": "Δparams", "fmt": "params"},
    {"header": "val loss", "fmt": "mean_std:.4f"},
]


def cross_corpus(
    tables: dict[str, dict[str, Any]], kind: str
) -> tuple[list[dict[str, str]], list[list[Any]]] | None:
    """One table across corpora: a row per budget of `kind` ("best_params" / "best_step"), a
    column per corpus holding "best (val loss)"; None with fewer than two corpora."""
    corpora = [c for c, t in tables.items() if t[kind]]
    if len(corpora) < 2:
        return None
    budgets = list(dict.fromkeys(r[0] for c in corpora for r in tables[c][kind]))
    cells = {
        (c, r[0]): f"{r[1]} ({statistics.fmean(r[-1]):.4f})"
        for c in corpora
        for r in tables[c][kind]
    }
    columns = [{"header": "Δparams budget" if kind == "best_params" else "step-time budget"}]
    columns += [{"header": c} for c in corpora]
    return columns, [[b] + [cells.get((c, b)) for c in corpora] for b in budgets]


def write_figures(points: list[dict[str, Any]], corpus: str, png: Path) -> Path | None:
    try:
        from research.report.plots import xy_plot
    except ImportError:  # matplotlib is an optional extra
        return None
    from tngram.report.runs import mean_std

    pts = [p for p in points if p["corpus"] == corpus and p["family"] != "raw"]
    if not pts:
        return None
    by_p: dict[str, list] = {}
    by_s: dict[str, list] = {}
    for p in pts:
        m, s = mean_std(p["val_loss"])
        by_p.setdefault(LABELS[p["family"]], []).append((p["delta_params"] / 1e6, m, s))
        if p["step_ms"] is not None:
            by_s.setdefault(LABELS[p["family"]], []).append((p["step_ms"], m, s))
    raw = next((p for p in points if p["corpus"] == corpus and p["family"] == "raw"), None)
    title = f"{corpus}: val loss vs Δparams" + (f" (raw GPT {raw['loss']:.4f})" if raw else "")
    front_p = _front_xy([(p["delta_params"] / 1e6, p["loss"]) for p in pts])
    front_s = _front_xy([(p["step_ms"], p["loss"]) for p in pts if p["step_ms"] is not None])
    return xy_plot(
        by_p,
        png,
        "Δparams (M)",
        "val loss (nats/token)",
        title,
        front=front_p,
        panels=[
            {
                "series": by_s,
                "xlabel": "training step (ms, 1 thread)",
                "ylabel": "val loss (nats/token)",
                "title": f"{corpus}: val loss vs step time",
                "front": front_s,
            }
        ]
        if by_s
        else None,
    )


def _front_xy(points: list[Point]) -> list[Point]:
    """The Pareto-front points (ascending cost) of the memory families, for the figures'
    staircase."""
    return [points[i] for i in pareto_front(points)]


def write_report(
    out: Path,
    specs: list[Any],
    factors: dict[str, float],
    bench: dict[str, Any] | None = None,
    core_max: int | None = None,
    sizes: dict[str, tuple] | None = None,
    corpus_sizes: dict[str, dict[str, tuple]] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> Path:
    """OUT/pareto.json, OUT/report.md and OUT/pareto-<corpus>.png from the finished runs; with
    `sizes` (family -> its sizes, index-aligned) also the paired table against Engram. `rows`:
    `collect(out, specs, core_max)` when the caller already has it (it reads every run)."""
    rows = collect(out, specs, core_max) if rows is None else rows
    if bench is None:
        f = out / "bench.json"
        bench = read_results(f) if f.is_file() else {}  # times >= 0, strict JSON
    points = aggregate(rows, bench)
    corpora = list(dict.fromkeys(s.tags["corpus"] for s in specs))
    tables = {c: corpus_tables(points, c) for c in corpora}
    paired = paired_rows(rows, bench, sizes, corpus_sizes) if sizes else []
    atomic_write_json(
        out / "pareto.json",
        {
            "factors": factors,
            "rows": rows,
            "points": points,
            "bench": bench,
            "tables": tables,
            "paired": paired,
        },
    )
    md = [
        "# python -m research experiment pareto\n\nTable-lr factors (× the recipe's): "
        + ", ".join(f"{k} ×{v:g}" for k, v in factors.items())
        + f". {len(rows)} of {len(specs)} runs finished.\n"
    ]
    from research.report.docblocks import render_table

    for c in corpora:
        t = tables[c]
        png = write_figures(points, c, out / f"pareto-{c}.png")
        md.append(
            f"## {c}\n\n"
            + render_table({"columns": POINT_COLUMNS, "rows": t["points"]})
            + "\n\n"
            + "Best at ≤ Δparams:\n\n"
            + render_table({"columns": BEST_P_COLUMNS, "rows": t["best_params"]})
            + "\n\nBest at ≤ step time:\n\n"
            + (
                render_table({"columns": BEST_S_COLUMNS, "rows": t["best_step"]})
                if t["best_step"]
                else "(no timing yet)"
            )
            + (
                "\n\nAt the raw GPT's total parameters (MLP narrowed to pay for the memory):\n\n"
                + render_table({"columns": TOTAL_COLUMNS, "rows": t["total"]})
                if t.get("total")
                else ""
            )
            + (f"\n\n![{c}]({png.name})\n" if png else "\n")
        )
    if paired:
        md.append(
            "## TN-gram families − Engram at the same size index, paired by seed\n\n"
            + render_table({"columns": PAIRED_COLUMNS, "rows": paired})
            + "\n"
        )
    atomic_write_text(out / "report.md", "\n".join(md))
    write_results_files(out)
    print0("\n".join(md))
    return out / "report.md"


def write_results_files(out: Path) -> None:
    """OUT/results/*.json: the tables as research/results files (copy them there to publish; `tngram
    report doc` renders them into README/RESULTS blocks)."""
    import sys
    from tngram.train.metrics import git_info

    g = git_info(Path(__file__).resolve().parent)
    commit = (g["commit"] or "unknown")[:12] + (" (uncommitted changes)" if g["dirty"] else "")
    bench = read_results(out / "pareto.json").get("bench", {})
    m = bench.get("machine", {})
    machine = (
        f"{m.get('cpu', '?')}, {m.get('logical_cpus', '?')} CPUs; training runs one torch "
        f"thread each; timing at 1 thread, interleaved, load average {m.get('loadavg', '?')} "
        f"at the end of timing"
    )
    command = (
        "python -m research experiment pareto " + " ".join(sys.argv[3:])
        if sys.argv[1:3] == ["experiment", "pareto"]
        else "python -m research experiment pareto --out " + str(out)
    )
    for name, data in results_files(out, commit, machine, command).items():
        atomic_write_json(out / "results" / f"{name}.json", data)


def results_files(out: Path, commit: str, machine: str, command: str) -> dict[str, dict[str, Any]]:
    """research/results files (kind "table") per corpus: pareto-<corpus>,
    pareto-<corpus>-best-params,
    pareto-<corpus>-best-step, from OUT/pareto.json."""
    data = read_results(out / "pareto.json")
    files = {}
    for c, t in data["tables"].items():
        meta = {
            "command": command,
            "commit": commit,
            "machine": machine,
            "source": str(out / "pareto.json"),
        }
        files[f"pareto-{c}"] = _table_file(t["points"], POINT_COLUMNS, meta)
        files[f"pareto-{c}-best-params"] = _table_file(t["best_params"], BEST_P_COLUMNS, meta)
        files[f"pareto-{c}-best-step"] = _table_file(t["best_step"], BEST_S_COLUMNS, meta)
        if t.get("total"):
            files[f"pareto-{c}-total"] = _table_file(t["total"], TOTAL_COLUMNS, meta)
    meta = {
        "command": command,
        "commit": commit,
        "machine": machine,
        "source": str(out / "pareto.json"),
    }
    if data.get("paired"):
        files["pareto-vs-engram"] = _table_file(data["paired"], PAIRED_COLUMNS, meta)
    for kind in ("best_params", "best_step"):
        # the vocabulary setting (NAME@V) is another model size: its Δparams do not fit these
        # budgets
        cross = cross_corpus({c: t for c, t in data["tables"].items() if "@" not in c}, kind)
        if cross is not None:
            files[f"pareto-{kind.replace('_', '-')}"] = _table_file(cross[1], cross[0], meta)
    tuning = out / "tuning" / "tuning.json"
    if tuning.is_file():
        tj = read_results(tuning)
        by: dict[float, list[float]] = {}
        for r in tj["rows"]:
            by.setdefault(float(r["factor"]), []).append(float(r["val_loss"]))
        best = float(tj["best"]["oe"])
        rows = [
            [f"× {f:g}" + (" (chosen)" if f == best else ""), len(v), v]
            for f, v in sorted(by.items())
        ]
        files["pareto-tuning-oe"] = _table_file(
            rows,
            [
                {"header": "Over-Encoding table lr (× recipe)"},
                {"header": "seeds"},
                {"header": "val loss", "fmt": "mean_std:.4f"},
            ],
            {
                "command": command,
                "commit": commit,
                "machine": machine,
                "source": str(tuning),
                "corpus": tj.get("corpus"),
            },
        )
    return files


# ---- cost axes of a point (machine-independent) ----

BYTES_PER_VALUE = 4  # fp32 tables


def fusion_flops(d_mem: int, d: int, hc_mult: int, kernel_size: int) -> int:
    """GatedFusion: K per branch and the shared V (2 (M+1) d_mem d), gate dots, depthwise conv."""
    M = hc_mult
    return 2 * (M + 1) * d_mem * d + 2 * M * d + 2 * M * d * kernel_size


def memory_costs(mem: Any, d: int, vocab_size: int) -> tuple[int, int, int] | None:
    """(rows, bytes, FLOPs) per token of ONE layer of memory `mem` (a MemoryConfig); None for a
    kind this module has no cost model for."""
    kind = mem.kind
    if kind == "engram":
        E = mem.embed_per_ngram(d)
        rows, width = (mem.max_ngram - 1) * mem.n_head_per_ngram, E // mem.n_head_per_ngram
        flops = fusion_flops((mem.max_ngram - 1) * E, d, mem.hc_mult, mem.kernel_size)
        return rows, rows * width * BYTES_PER_VALUE, flops
    if kind in ("tngram", "tngram-variant"):
        from tngram.memory.tngram_variants import TNGramVariantConfig, lookup_width

        N, R = mem.max_ngram, mem.cp_rank
        rows, nbytes = N, N * R * BYTES_PER_VALUE
        if not isinstance(mem, TNGramVariantConfig):  # the paper's: K/V read e_concat
            kv = fusion_flops((N - 1) * R, d, mem.hc_mult, mem.kernel_size)
            return rows, nbytes, 2 * N * R + kv
        d_in = lookup_width(mem)
        if mem.hash_orders:
            h = len(mem.hash_orders) * mem.hash_heads
            rows, nbytes = (
                rows + h,
                nbytes + h * (mem.hash_embed // mem.hash_heads) * BYTES_PER_VALUE,
            )
            d_in += len(mem.hash_orders) * mem.hash_embed
        flops = 2 * N * R
        if mem.kv_rank:
            flops, d_in = flops + 2 * d_in * mem.kv_rank, mem.kv_rank
        return rows, nbytes, flops + fusion_flops(d_in, d, mem.hc_mult, mem.kernel_size)
    if kind == "oe":
        S = mem.n_tables  # n_slices * (N - 1)
        ds = mem.slice_width(d)
        return S, S * ds * BYTES_PER_VALUE, 2 * S * ds * d
    if kind == "pkm":
        H, k, n, Kd = mem.n_heads, mem.topk, mem.n_keys, mem.key_dim
        flops = 2 * d * H * Kd + 2 * H * n * Kd + H * k * k + 2 * H * k * d
        return H * k, H * k * d * BYTES_PER_VALUE, flops
    if kind == "stem":
        F = mem.width(d)
        return 1, F * BYTES_PER_VALUE, 4 * d * F + F
    if kind == "ple":
        P = mem.ple_dim
        return 1, P * BYTES_PER_VALUE, 2 * P * d + ((2 * d * P + P) if mem.gated else 0)
    return None  # a memory registered elsewhere: no cost model here


def backbone_flops(m: Any) -> int:
    """Forward FLOPs per token of the GPT without memory (GPTConfig `m`)."""
    d, L = m.n_embd, m.n_layer
    kv = m.n_kv_head * (d // m.n_head)
    per_block = 2 * (2 * d * d + 2 * d * kv) + 2 * 2 * d * m.mlp_width()  # q, o, k, v; MLP
    per_block += 2 * 2 * d * (m.sequence_len + 1) / 2  # scores and values over T_ctx
    return int(L * per_block + 2 * m.vocab_size * d)  # + the tied head


def point_costs(m: Any) -> dict[str, int | None]:
    """{rows_per_token, bytes_per_token, flops_per_token, total_params} of GPTConfig `m` (the
    first three None for a memory kind with no cost model here)."""
    from tngram.model.gpt import param_counts

    total = param_counts(m)["total_params"]
    costs = (0, 0, 0) if m.memory is None else memory_costs(m.memory, m.n_embd, m.vocab_size)
    if costs is None:
        return {
            "rows_per_token": None,
            "bytes_per_token": None,
            "flops_per_token": None,
            "total_params": total,
        }
    layers = len(m.memory_layers) if m.memory is not None and m.memory.injection == "block" else 1
    rows, nbytes, flops = (layers * c for c in costs)
    return {
        "rows_per_token": rows,
        "bytes_per_token": nbytes,
        "flops_per_token": backbone_flops(m) + flops,
        "total_params": total,
    }


# ---- the paired comparison with Engram ----

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
