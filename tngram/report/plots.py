"""Plots from run folders (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.report.runs import read_metrics


def _plt():
    from tngram.common import require_extra

    matplotlib = require_extra("matplotlib", "report", "figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out_png: str | Path) -> Path:
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def loss_curves(runs: dict[str, list[str | Path]], out_png: str | Path, title: str = "") -> Path:
    """Train (and val) loss vs step: one colour per method, one line per seed. The validation
    panel is drawn only when some run was validated at 2 or more steps (run.val_every > 0); with
    only the final validation (the mini recipes) it would be one dot per run, so the final val
    loss goes into the legend instead."""
    plt = _plt()
    metrics = {m: [read_metrics(d) for d in dirs] for m, dirs in runs.items()}
    curves = {
        m: [(_series(rows, "train_loss"), _series(rows, "val_loss")) for rows in ms]
        for m, ms in metrics.items()
    }
    val_panel = any(len(va) >= 2 for cs in curves.values() for _, va in cs)
    fig, axes = plt.subplots(
        1, 2 if val_panel else 1, figsize=(11, 4) if val_panel else (6.5, 4), squeeze=False
    )
    axes = list(axes[0])
    for ci, (method, cs) in enumerate(curves.items()):
        color = f"C{ci}"
        finals = [va[-1][1] for _, va in cs if va]
        for si, (tr, va) in enumerate(cs):
            lab = method if si == 0 else None
            if lab and finals and not val_panel:
                lab += f" (final val {sum(finals) / len(finals):.4f})"
            if tr:
                axes[0].plot(*zip(*tr), color=color, alpha=0.8, lw=1, label=lab)
            if va and val_panel:
                axes[1].plot(*zip(*va), "o-", color=color, alpha=0.8, label=lab)
    axes[0].set(xlabel="step", ylabel="train loss (nats/token)", title="train loss")
    if val_panel:
        axes[1].set(xlabel="step", ylabel="val loss (nats/token)", title="validation loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return _save(plt, fig, out_png)


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def xy_plot(
    series: dict[str, list[tuple[float, float, float]]],
    out_png: str | Path,
    xlabel: str,
    ylabel: str,
    title: str = "",
    panels: list[dict[str, Any]] | None = None,
    front: list[tuple[float, float]] | None = None,
) -> Path:
    """Mean ± std error bars per series: series[name] = [(x, mean, std), ...]. Optional extra panels
    (each {"series", "xlabel", "ylabel", "title"}, optionally "front") are drawn to the right.
    `front` / a panel's "front": [(x, y), ...] in ascending x, drawn as a dashed staircase."""
    plt = _plt()
    all_panels = [
        {"series": series, "xlabel": xlabel, "ylabel": ylabel, "title": title, "front": front}
    ] + (panels or [])
    fig, axes = plt.subplots(1, len(all_panels), figsize=(5.5 * len(all_panels), 4), squeeze=False)
    for ax, p in zip(axes[0], all_panels):
        for name, pts in p["series"].items():
            pts = sorted(pts)
            ax.errorbar(
                [x for x, _, _ in pts],
                [m for _, m, _ in pts],
                yerr=[s for _, _, s in pts],
                marker="o",
                capsize=3,
                label=name,
            )
        if p.get("front"):  # [(x, y), ...] in ascending x: drawn as a dashed staircase
            fx, fy = zip(*p["front"])
            ax.step(
                fx,
                fy,
                where="post",
                color="black",
                linestyle="--",
                linewidth=1,
                zorder=0,
                label=p.get("front_label", "Pareto front"),
            )
        ax.set(xlabel=p["xlabel"], ylabel=p["ylabel"], title=p.get("title", ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(plt, fig, out_png)


def bar_plot(
    groups: dict[str, dict[str, tuple[float, float]]],
    out_png: str | Path,
    ylabel: str,
    title: str = "",
) -> Path:
    """Grouped bars with std error bars: groups[category][series] = (mean, std)."""
    plt = _plt()
    cats = list(groups)
    names = list(dict.fromkeys(n for g in groups.values() for n in g))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(cats) * max(1, len(names)) / 2, 4))
    for i, n in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(cats))]
        ms = [groups[c].get(n, (float("nan"), 0.0))[0] for c in cats]
        ss = [groups[c].get(n, (float("nan"), 0.0))[1] for c in cats]
        bars = ax.bar(xs, ms, width, yerr=ss, capsize=3, label=n)
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=8)
    ax.set_xticks(range(len(cats)), cats)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(plt, fig, out_png)
