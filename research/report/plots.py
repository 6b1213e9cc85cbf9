"""Figures of the experiments: mean ± std error bars per series and grouped bars (matplotlib,
through tngram.report.plots), and the "mean ± std" cell of their tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.report.plots import pyplot, save_figure


def fmt_pm(mean: float, std: float, n: int, spec: str = ".4f") -> str:
    """ "mean ± std", or the mean alone when it is of one value (n < 2: there is no spread to
    show, and "± 0.0000" would read as a measured one)."""
    return f"{mean:{spec}}" if n < 2 else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


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
    plt = pyplot()
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
    return save_figure(plt, fig, out_png)


def bar_plot(
    groups: dict[str, dict[str, tuple[float, float]]],
    out_png: str | Path,
    ylabel: str,
    title: str = "",
) -> Path:
    """Grouped bars with std error bars: groups[category][series] = (mean, std)."""
    plt = pyplot()
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
    return save_figure(plt, fig, out_png)
