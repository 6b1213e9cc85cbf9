"""The GPU results tables of the micro-benchmark sections: the Triton lookup's backwards and
its factor-gradient adds alone (kernels), the attention per SDPA backend (attention) and the
optimiser step (optim)."""

from __future__ import annotations

from typing import Any

from research.report.gpu_cells import cell, ok, ratio
from research.report.markdown import md_row


def kernels_table(snap: dict[str, Any]) -> str:
    """The kernels section: each TN-gram recipe's lookup forward and forward + backward per
    Triton backward variant (ms, and ÷ the default "fused" at the forward's warps)."""
    sec = snap["sections"].get("kernels", {})
    names = []
    for it in sec.values():
        for k in it.get("variants", {}) if ok(it) else ():
            if k not in names:
                names.append(k)
    dtypes = sorted({it["out_dtype"] for it in sec.values() if ok(it)})
    lines = [
        f"The Triton lookup alone (one TN-gram module, uniform random ids, "
        f"{' / '.join(dtypes) or 'no'} output), forward and forward + backward per backward "
        "variant, median ms (÷ `fused` at the forward's warps), interleaved in one process"
        + (
            "; `inductor`: the same stage without a hand-written kernel (the plain-autograd "
            "path), compiled by torch.compile:"
            if any("inductor" in it.get("variants", {}) for it in sec.values() if ok(it))
            else ":"
        ),
        "",
        "| recipe | R | fwd ms | " + " | ".join(f"`{n}`" for n in names) + " | fastest |",
        "|" + "---|" * (len(names) + 4),
    ]
    for r, it in sec.items():
        if not ok(it):
            why = it.get("skipped") if isinstance(it, dict) else None  # e.g. no Triton there
            lines.append(md_row([r, "", why or cell(it, "", "")] + [""] * len(names) + [""]))
            continue
        v = it["variants"]
        ref = next((x for x in v.values() if x["backward"] == "fused"), None)
        cells = [r, str(it["cp_rank"]), f"{it['fwd']['median_ms']:.2f}"]
        for n in names:
            x = v.get(n)
            cells.append(
                "–"
                if x is None
                else f"{x['fwdbwd']['median_ms']:.2f}"
                + (f" ({ratio(x['fwdbwd'], ref['fwdbwd'])})" if ref else "")
            )
        cells.append(f"`{it['fastest']}`")
        lines.append(md_row(cells))
    worst = max(
        (x["grad_rel_diff"] for it in sec.values() if ok(it) for x in it["variants"].values()),
        default=None,
    )
    if worst is not None:
        lines += ["", f"Every variant's gradients within {worst:.1e} (relative) of `fused`'s."]
    adds = row_grads_table(sec)
    return "\n".join(lines + (["", adds] if adds else []))


def row_grads_table(sec: dict[str, Any]) -> str:
    """The kernels items' `row_grads`: the factor-gradient adds alone per id set, atomic
    (index_add_) and sorted (deterministic index_put_), against a copy of the same rows; ""
    when no item has them (files from before they were timed)."""
    items = {r: it["row_grads"] for r, it in sec.items() if ok(it) and "row_grads" in it}
    if not items:
        return ""
    lines = [
        "The factor-gradient adds alone (the backward's rows of R fp32 added into the factors' "
        "gradient), median ms: `index_add_` (atomic adds on CUDA), torch's sort-based "
        "`index_put_(accumulate=True)` (deterministic), and a copy of the same rows; the ids "
        "uniform or drawn from a Zipf law (exponent 1), with the most adds one row takes:",
        "",
        "| recipe | rows added × R | copy | uniform: atomic / sorted | most to one row "
        "| Zipf: atomic / sorted | most to one row |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, a in items.items():
        t = a["timings"]
        cells = [r, f"{a['adds']:,} × {a['width']:,}", f"{t['copy']['median_ms']:.2f}"]
        for ids in ("uniform", "zipf"):
            at, so = t[f"atomic/{ids}"]["median_ms"], t[f"sorted/{ids}"]["median_ms"]
            cells += [f"{at:.2f} / {so:.2f}", f"{a[f'max_row_adds/{ids}']:,}"]
        lines.append(md_row(cells))
    worst = max(v for a in items.values() for k, v in a.items() if k.startswith("sorted_rel"))
    lines += ["", f"The sorted sums within {worst:.1e} (relative) of the atomic ones."]
    return "\n".join(lines)


def optim_table(snap: dict[str, Any]) -> str:
    """The optim section: each recipe's optimiser step alone, Adam and Muon per matrix against
    stacked by shape (median ms, interleaved)."""
    sec = snap["sections"].get("optim", {})
    lines = [
        "The optimiser step alone (random gradients), median ms, interleaved in one process; "
        "Muon one matrix at a time (`loop`) and stacked by shape (`stacked`):",
        "",
        "| recipe | Muon matrices (shapes) | Adam | Muon `loop` | Muon `stacked` "
        "| stacked ÷ loop |",
        "|---|---|---|---|---|---|",
    ]
    for r, it in sec.items():
        if not ok(it):
            lines.append(md_row([r, cell(it, "", "")] + [""] * 4))
            continue
        t = it["optimisers"]
        lines.append(
            md_row(
                [
                    r,
                    f"{it['muon_matrices']} ({len(it['muon_shapes'])})",
                    f"{t['adam']['median_ms']:.2f}",
                    f"{t['muon/loop']['median_ms']:.2f}",
                    f"{t['muon/stacked']['median_ms']:.2f}",
                    f"{it['stacked_over_loop']:.2f}×",
                ]
            )
        )
    worst = max((it["update_rel_diff"] for it in sec.values() if ok(it)), default=None)
    if worst is not None:
        ns = {it["newton_schulz"] for it in sec.values() if ok(it)}
        lines += [
            "",
            f"Newton-Schulz {' / '.join(sorted(ns))}. One step of each from the same state: "
            f"the stacked updates within {worst:.1e} (relative) of the per-matrix ones.",
        ]
    return "\n".join(lines)


def attention_table(snap: dict[str, Any]) -> str:
    """The attention section: forward + backward per SDPA backend (ms, TFLOP/s, ÷ torch's own
    pick), or why a backend could not run."""
    it = snap["sections"].get("attention", {}).get("paper-l9")
    if not ok(it):
        return f"Attention per SDPA backend: {cell(it, '', '')}."
    s, rows = it["shape"], it["backends"]
    lines = [
        f"paper-l9's attention alone ({s['batch']} × {s['heads']} heads ({s['kv_heads']} for "
        f"k, v) × {s['seq']} × {s['head_dim']}, causal, {it['dtype']}), forward + backward, "
        f"median ms, interleaved; torch's own pick here: `{it['default_backend']}`:",
        "",
        "| backend | ms | TFLOP/s | ÷ torch's pick | rel. diff to fp32 math |",
        "|---|---|---|---|---|",
    ]
    base = rows["default"]["fwdbwd"]
    for name, r in rows.items():
        if "fwdbwd" not in r:
            lines.append(
                md_row([f"`{name}`", "cannot run here (its error is in the file)"] + [""] * 3)
            )
            continue
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else "–"
        label = f"`{name}`" + (f" (= `{r['backend']}`)" if name == "default" else "")
        lines.append(
            md_row(
                [
                    label,
                    f"{r['fwdbwd']['median_ms']:.2f}",
                    f"{r['tflops']:.3g}",
                    ratio(r["fwdbwd"], base),
                    diff,
                ]
            )
        )
    return "\n".join(lines)
