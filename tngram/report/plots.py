"""Plots from run folders (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.report.runs import read_metrics


def pyplot():
    from tngram.common import require_extra

    matplotlib = require_extra("matplotlib", "report", "figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, out_png: str | Path) -> Path:
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
    plt = pyplot()
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
    return save_figure(plt, fig, out_png)


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]
