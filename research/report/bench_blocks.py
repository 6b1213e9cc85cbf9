"""Generated-block views of a `python -m research bench threads --json` results file (see
docblocks).

speed       Engram vs TN-gram per measurement and thread count, with targets (compact)
candidates  every candidate at 1 and 2 threads, median (min) ms, 2-thread speed-up, Amdahl p and
            the 16-core projection (research/PERFORMANCE.md)
targets     the TN-gram / Engram ratios against their targets, met or not
"""

from __future__ import annotations

from typing import Any

from tngram.common import TngramError
from research.report.markdown import md_row

STEP_TARGET = 1.10  # mini training step, TN-gram / Engram
MODULE_SLACK = 1.05  # module time ratio target = 1.05 x the analytic FLOP ratio
PARTS = (
    ("lookup", "lookup fwd+bwd, paper-l9 shapes", 2),
    ("module", "whole module fwd+bwd, paper-l9 shapes", 1),
    ("step", "mini training step, bf16", 1),
)


def _ms(res: dict[str, Any], key: str, field: str = "median_s") -> float:
    try:
        return 1000.0 * res["times"][key][field]
    except KeyError:
        raise TngramError(f"bench threads results have no {field} for {key!r}") from None


def _times_key(part: str, method: str, t: int) -> str:
    return f"{part}:{'mini-' if part == 'step' else ''}{method}@{t}"


def targets(res: dict[str, Any]) -> dict[str, float]:
    return {
        "lookup": res["bytes_ratio"],
        "module": MODULE_SLACK * res["flop_ratio"],
        "step": STEP_TARGET,
    }


def met(res: dict[str, Any], part: str) -> bool:
    goal = targets(res)[part]
    return all(round(res["ratios"][str(t)][part], 2) <= goal for t in res["threads"])


def target_text(res: dict[str, Any], part: str) -> str:
    t = targets(res)[part]
    if part == "lookup":
        return f"≤ bytes ratio {t:.2f}"
    if part == "module":
        return f"≤ {t:.2f} ({MODULE_SLACK:.2f} × FLOPs {res['flop_ratio']:.2f})"
    return f"≤ {t:.2f}" + ("" if met(res, part) else " (not met)")


def speed_table(res: dict[str, Any]) -> str:
    lines = [
        "| measured with | threads | Engram | TN-gram | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for part, label, digits in PARTS:
        for i, t in enumerate(res["threads"]):
            en, tn = (
                _ms(res, _times_key(part, "engram", t)),
                _ms(res, _times_key(part, "tngram", t)),
            )
            lines.append(
                md_row(
                    [
                        label if i == 0 else "",
                        str(t),
                        f"{en:.{digits}f}",
                        f"{tn:.{digits}f}",
                        f"{res['ratios'][str(t)][part]:.2f}",
                        target_text(res, part) if i == 0 else "",
                    ]
                )
            )
    return "\n".join(lines)


def _label(key: str) -> str:
    part, what = key.split(":", 1)
    if part == "zero":
        return f"zero-fill (N,V,R) grad, V {what.lstrip('V')}"
    return f"{part} {({'engram': 'Engram', 'tngram': 'TN-gram'}).get(what, what)}"


def candidates_table(res: dict[str, Any]) -> str:
    t1, t2 = res["threads"][:2]
    lines = [
        f"| candidate | {t1} thread{'s' if t1 > 1 else ''} | {t2} threads | S2 | p | 16-core |",
        "|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys(k.rsplit("@", 1)[0] for k in res["times"]))
    for k in keys:
        if k.startswith("zero:"):
            cells = [f"{_ms(res, f'{k}@{t}'):.2f}" for t in (t1, t2)] + ["", "", ""]
        else:
            cells = [
                f"{_ms(res, f'{k}@{t}'):.2f} ({_ms(res, f'{k}@{t}', 'min_s'):.2f})"
                for t in (t1, t2)
            ]
            s = res["speedups"][k]
            cells += [
                f"{s['speedup_2']:.2f}",
                f"{s['parallel_fraction']:.2f}",
                f"{s['amdahl_16']:.2f}",
            ]
        lines.append(md_row([_label(k)] + cells))
    return "\n".join(lines)


def targets_table(res: dict[str, Any]) -> str:
    ts = res["threads"]
    lines = [
        "| target (TN-gram / Engram) | "
        + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in ts)
        + " | met? |",
        "|---|" + "---|" * len(ts) + "---|",
    ]
    goals = targets(res)
    names = {
        "lookup": f"lookup ≤ bytes ratio {goals['lookup']:.2f}",
        "module": f"module ≤ {MODULE_SLACK:.2f} × FLOP ratio {res['flop_ratio']:.2f} = "
        f"{goals['module']:.2f}",
        "step": f"mini step ≤ {goals['step']:.2f}",
    }
    for part, _, _ in PARTS:
        lines.append(
            f"| {names[part]} | "
            + " | ".join(f"{res['ratios'][str(t)][part]:.2f}" for t in ts)
            + f" | {'yes' if met(res, part) else '**no**'} |"
        )
    return "\n".join(lines)


def render_threads(res: dict[str, Any], view: str) -> str:
    views = {"speed": speed_table, "candidates": candidates_table, "targets": targets_table}
    if view not in views:
        raise TngramError(
            f"bench-threads block view {view!r}: expected one of {', '.join(views)} "
            "(block name FILE:VIEW)"
        )
    return views[view](res)


# --- `python -m research bench contention --json` (kind "bench-contention")
# ---------------------------------

CONDITION_LABELS = {"idle": "competitor stopped", "busy": "beside a 2-thread torch job"}


def render_contention(res: dict[str, Any], view: str = "") -> str:
    """Tokens/s per (condition, thread policy), median of the interleaved reps, and the ratio to
    the idle machine at torch's default thread count; a line on what else ran."""
    if view not in ("", "table"):
        raise TngramError(
            f"bench-contention block view {view!r}: expected table (block name FILE:table)"
        )
    try:
        med, rel, chose = res["median_tokens_per_s"], res["vs_idle_default"], res["auto_chose"]
        default = res["default_threads"]
    except KeyError as e:
        raise TngramError(f"bench contention results have no {e.args[0]!r}") from None
    label = {"default": f"torch's default ({default})", "1": "1"}
    lines = [
        "| condition | threads | tokens/s | × competitor stopped, default threads |",
        "|---|---|---|---|",
    ]
    for cond in ("idle", "busy"):
        for i, pol in enumerate(("default", "1", "auto")):
            k = f"{cond}:{pol}"
            picked = sorted(set(chose.get(cond, [])))
            name = label.get(pol) or ("automatic (chose " + "/".join(map(str, picked)) + ")")
            lines.append(
                md_row(
                    [
                        CONDITION_LABELS[cond] if i == 0 else "",
                        name,
                        f"{med[k]:,.0f}",
                        f"{rel[k]:.2f}",
                    ]
                )
            )
    bg = res.get("background")
    n = res["steps_per_rep"]
    lines += [
        "",
        f"{res['recipe']}, {n} optimiser step{'s' if n > 1 else ''} of {res['tokens_per_step']:,} "
        f"tokens per rep, median of {res['reps']} reps, all six candidates interleaved in one "
        f"process. "
        + (f"Also running: {bg} — not an idle machine." if bg else "Nothing else was running."),
    ]
    return "\n".join(lines)


# --- `python -m research bench vocab --json` (kind "bench-vocab")
# -------------------------------------------

VOCAB_GOALS = {"overhead": 1.5, "step128k": 1.3, "rowwise_bytes": 5.0}


def _vocab_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        return list(res["rows"])
    except KeyError:
        raise TngramError("bench vocab results have no 'rows'") from None


def vocab_table(res: dict[str, Any]) -> str:
    """Every candidate: V, table parameters, step CPU ms (the measure on a busy machine), wall ms
    median (min), x raw and the memory's overhead over the raw step of the same V (both from CPU
    time), optimiser-state bytes per table parameter, peak RSS."""
    lines = [
        "| V | model | update | table params | step CPU ms | step wall ms, median (min) | "
        "× raw | overhead CPU ms | state B / table param | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _vocab_rows(res):
        sb, pk = r.get("state_bytes_per_table_param"), r.get("peak_rss_delta_bytes")
        raw = r["model"] == "raw"
        lines.append(
            md_row(
                [
                    f"{r['vocab']:,}",
                    r["model"],
                    "" if raw else r["update"],
                    "" if raw else f"{r['table_params'] / 1e6:,.1f} M",
                    f"{r['step_cpu_s'] * 1e3:,.0f}",
                    f"{r['step']['median_s'] * 1e3:,.0f} ({r['step']['min_s'] * 1e3:,.0f})",
                    f"{r['ratio_to_raw_cpu']:.2f}",
                    "" if raw else f"{r['overhead_cpu_s'] * 1e3:+,.0f}",
                    "" if sb is None else f"{sb:.2f}",
                    "" if pk is None else f"{pk / 1e6:,.0f}",
                ]
            )
        )
    skipped = res.get("skipped") or []
    large = res.get("large_reps", res["reps"])
    lines += [
        "",
        f"One optimiser step of {res['batch']} × {res['seq']} random tokens, {res['dtype']} "
        f"autocast, {res['threads']} thread, the mini backbone with vocabulary V; the candidates "
        f"of one V interleaved in one process, medians of {res['reps']} timed reps "
        f"({large} at V ≥ 65,536) after {res['warmup']} warm-up. CPU ms = the step's process CPU "
        "time (one thread: its own work, without the time spent waiting for a core; the machine "
        "was shared, see the load averages below), the basis of × raw and overhead "
        "(= step − raw step of the same V). Peak MB = peak RSS increase of two steps in a fresh "
        "process (gradients, optimiser state, activations; not the weights)"
        + (f", measured up to V = {res['peak_max_vocab']:,}" if res.get("peak_max_vocab") else "")
        + "."
        + (" Not run: " + "; ".join(skipped) + "." if skipped else ""),
    ]
    return "\n".join(lines)


def vocab_goals(res: dict[str, Any]) -> str:
    """The goals against the measured numbers: from CPU time, wall-time medians in brackets; an
    overhead ratio is left out when the 1k overhead is not above zero."""
    g = res.get("goals", {})
    lines = [
        "| goal | target | measured: CPU time (wall median) | met (CPU time) |",
        "|---|---|---|---|",
    ]

    def row(label: str, key: str, target: float) -> None:
        cpu, wall = g.get(key + " (cpu)"), g.get(key)
        if cpu is None:
            lines.append(
                md_row(
                    [label, f"≤ {target:g}", "not run" if wall is None else f"— ({wall:.2f})", ""]
                )
            )
            return
        lines.append(
            md_row(
                [
                    label,
                    f"≤ {target:g}",
                    f"{cpu:.2f}" + (f" ({wall:.2f})" if wall is not None else ""),
                    "yes" if cpu <= target else "no",
                ]
            )
        )

    # the catch-up options (optim.memory_catchup) only when measured
    def measured(u: str, key: str) -> bool:
        return "+" not in u or key in g or key + " (cpu)" in g

    updates = ("dense", "sparse", "rowwise", "sparse+catchup", "rowwise+catchup")
    for m, name in (("engram", "Engram"), ("tngram", "TN-gram")):
        for u in updates:
            if measured(u, f"{m}/{u} overhead 32k / 1k"):
                row(
                    f"{name} {u}: overhead at V = 32k / at 1k",
                    f"{m}/{u} overhead 32k / 1k",
                    VOCAB_GOALS["overhead"],
                )
    for u in updates:
        if measured(u, f"tngram/{u} step / raw at 128k"):
            row(
                f"TN-gram {u}: step / raw step at V = 128k",
                f"tngram/{u} step / raw at 128k",
                VOCAB_GOALS["step128k"],
            )
    for m, name in (("engram", "Engram"), ("tngram", "TN-gram")):
        key = f"{m}/rowwise max state bytes per table param"
        if key in g:
            lines.append(
                md_row(
                    [
                        f"{name} rowwise: optimiser state per table parameter",
                        "≤ 5 B",
                        f"{g[key]:.2f} B",
                        "yes" if g[key] <= 5 else "no",
                    ]
                )
            )
    return "\n".join(lines)


def render_vocab(res: dict[str, Any], view: str) -> str:
    views = {"table": vocab_table, "goals": vocab_goals}
    if view not in views:
        raise TngramError(
            f"bench-vocab block view {view!r}: expected one of {', '.join(views)} "
            "(block name FILE:VIEW)"
        )
    return views[view](res)
