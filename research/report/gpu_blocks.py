"""Generated-block views of the GPU results files (docs/GPU.md, research/GPU.md; see
research.report.docblocks).

Three kinds of file:

- "bench-gpu": the output of `python -m research bench gpu` (research.bench.gpu), one card, one
commit.
  `render_run` draws its tables: forward + backward (eager, compiled, MFU, peak memory), trainer
  tokens/s, table updates by vocabulary, lookup check and timing, the self-checks.
- "gpu-index" (research/results/gpu.json): words only. `resolve_index` lists every bench-gpu file
  beside it (gpu-*.json; runs at tiny CPU shapes are left out: they are no GPU figures) and
  `render_index` draws each run's tables and one table of the numbers the issue asks for ("wanted",
  each a list of section:key items of a bench-gpu file) saying, per number, which file measured
  it or that it is still open, and what the first GPU check (a "gpu-check" file) covered.
- "gpu-check": the raw numbers of the first GPU check (scripts outside the package, copied into
  research/results/ with card, torch, triton and commit); `render_check` draws them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import TngramError
from research.report.gpu_cells import cell as _cell
from research.report.gpu_cells import ok as _ok
from research.report.gpu_cells import ratio as _ratio
from research.report.gpu_goals import goals_table
from research.report.gpu_micro_blocks import attention_table, kernels_table, optim_table
from research.report.markdown import md_row, read_results

MODELS = (("raw", "raw"), ("engram", "Engram"), ("tngram", "TN-gram"))
UPDATES = ("dense", "sparse", "rowwise")


def run_heading(snap: dict[str, Any], source: str) -> str:
    pol = snap.get("kernel_policy") or {}  # named only when not the default (files before: none)
    bwd, warps = pol.get("triton_backward", "fused"), pol.get("triton_backward_warps", 0)
    return (
        f"**{snap['card']}** (torch {snap['torch']}, triton {snap.get('triton') or 'none'}, "
        f"commit {snap['commit']}; `{source}`; {snap.get('elapsed_s', '?')} s of a "
        f"{snap.get('budget_s', 0):.0f} s budget"
        + ("" if snap.get("complete") else "; INCOMPLETE: the run stopped before its end")
        + (
            f"; Triton backward: {bwd}" + (f", {warps} warps" if warps else "")
            if (bwd, warps) != ("fused", 0)
            else ""
        )
        + (f"; PYTORCH_CUDA_ALLOC_CONF={snap['alloc_conf']}" if snap.get("alloc_conf") else "")
        + ")"
    )


def fwdbwd_table(snap: dict[str, Any]) -> str:
    sec = snap["sections"].get("fwdbwd", {})
    sh = snap["shapes"]
    lines = [
        f"Forward + backward, {sh['batch']} sequences a step, bf16 autocast on CUDA, median ms "
        f"of {sh['reps']}:",
        "",
        "| recipe | eager ms | compiled ms | eager ÷ raw | compiled ÷ raw | compiled tokens/s "
        "| MFU (compiled) | peak GiB (compiled) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    raw_e, raw_c = sec.get("paper-l9-raw/eager"), sec.get("paper-l9-raw/compile")
    for r in snap["recipes"]:
        e, c = sec.get(f"{r}/eager"), sec.get(f"{r}/compile")
        lines.append(
            md_row(
                [
                    r,
                    _cell(e, "median_ms", ".1f"),
                    _cell(c, "median_ms", ".1f"),
                    _ratio(e, raw_e),
                    _ratio(c, raw_c),
                    _cell(c, "tokens_per_s", ",.0f"),
                    _cell(c, "mfu_spec", ".1f", 100.0) + ("%" if _ok(c) and c["mfu_spec"] else ""),
                    _cell(c, "peak_gb", ".1f"),
                ]
            )
        )
    fl = snap.get("flops", {})
    peak = fl.get("peak_bf16_spec")
    lines += [
        "",
        f"MFU = FLOPs ÷ time ÷ {f'{peak / 1e12:.1f} TFLOP/s' if peak else 'no spec peak'} "
        f"(bf16 dense spec peak); FLOPs: {fl.get('count', '?')}.",
    ]
    return "\n".join(lines)


MODES = (("compile", "compiled"), ("eager", "eager"))
TOP_KERNELS = (("paper-l9-engram", 5), ("paper-l9-tngram", 5))  # compiled items, top N each
TOP_TABLE_KERNELS = 4  # top kernels shown for each profiled TN-gram table step at V >= ...
TOP_TABLE_MIN_V = 8192  # ... this (where row-sparse updates should beat dense)


def _profiles(snap: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(recipe, mode label, item, profile) of every fwdbwd item with a profile, compiled first."""
    sec = snap["sections"].get("fwdbwd", {})
    out = []
    for mode, label in MODES:
        for r in snap["recipes"]:
            it = sec.get(f"{r}/{mode}")
            if _ok(it) and isinstance(it.get("profile"), dict):
                out.append((r, label, it, it["profile"]))
    return out


def profile_table(snap: dict[str, Any]) -> str:
    """`--profile`: ms per step by kernel category for each profiled fwdbwd item, and the top
    kernels of compiled Engram and TN-gram (TOP_KERNELS)."""
    rows = _profiles(snap)
    good = [p for *_, p in rows if "error" not in p]
    cats = list(good[0]["categories"]) if good else []
    measure = "self device time" if good and good[0].get("time") == "device" else "self CPU time"
    steps = good[0]["steps"] if good else "?"
    lines = [
        f"Where a step's time goes (`--profile`): {measure} per step, ms, summed by kernel "
        f"category over {steps} profiled steps after the timing (categories by kernel name, "
        "research.bench.gpu_profile.CATEGORIES); timed = the median ms above:",
        "",
        "| recipe | mode | timed | " + " | ".join(cats) + " | total |",
        "|" + "---|" * (len(cats) + 4),
    ]
    for r, label, it, p in rows:
        if "error" in p:
            lines.append(md_row([r, label, f"{it['median_ms']:.1f}", "profile error"]))
            continue
        cells = [f"{p['categories'].get(c, 0.0):.2f}" for c in cats]
        lines.append(
            md_row([r, label, f"{it['median_ms']:.1f}"] + cells + [f"{p['total_ms']:.2f}"])
        )
    compiled = {r: p for r, label, _, p in rows if label == "compiled" and "error" not in p}
    tops = [(r, n, compiled[r]) for r, n in TOP_KERNELS if r in compiled]
    if tops:
        lines += [
            "",
            "Top kernels of the compiled steps:",
            "",
            "| recipe | kernel | category | calls a step | ms a step | share |",
            "|---|---|---|---|---|---|",
        ]
        for r, n, p in tops:
            lines += _top_rows(r, p, n)
    return "\n".join(lines)


def _top_rows(label: str, p: dict[str, Any], n: int) -> list[str]:
    """The first n of a profile's top kernels as table rows led by `label`."""
    out = []
    for k in p["top"][:n]:
        name = "`" + k["name"].replace("|", "\\|").replace("`", "'") + "`"
        ms = [f"{k['calls']:g}", f"{k['ms']:.2f}", f"{100 * k['share']:.1f}%"]
        out.append(md_row([label, name, k["category"]] + ms))
    return out


def tables_profile_table(snap: dict[str, Any]) -> str:
    """`--profile` on the tables section: each profiled table step's time by kernel category,
    and the top kernels of TN-gram's dense, sparse and rowwise steps at V >= TOP_TABLE_MIN_V."""
    sec = snap["sections"].get("tables", {})
    rows = [(k, it, it["profile"]) for k, it in sec.items() if _ok(it) and "profile" in it]
    good = [p for *_, p in rows if "error" not in p]
    cats = list(good[0]["categories"]) if good else []
    measure = "self device time" if good and good[0].get("time") == "device" else "self CPU time"
    lines = [
        f"Where a table step's time goes (`--profile`): {measure} per step, ms, by kernel "
        "category; timed = the median ms above:",
        "",
        "| step | timed | " + " | ".join(cats) + " | total |",
        "|" + "---|" * (len(cats) + 3),
    ]
    for key, it, p in rows:
        if "error" in p:
            lines.append(md_row([key, f"{it['median_ms']:.1f}", "profile error"]))
            continue
        cells = [f"{p['categories'].get(c, 0.0):.2f}" for c in cats]
        lines.append(md_row([key, f"{it['median_ms']:.1f}"] + cells + [f"{p['total_ms']:.2f}"]))
    tops = [
        (k, p)
        for k, _, p in rows
        if k.startswith("tngram@")
        and int(k[7:].split("/")[0]) >= TOP_TABLE_MIN_V
        and "error" not in p
    ]
    if tops:
        lines += [
            "",
            f"Top kernels of TN-gram's table steps at V ≥ {TOP_TABLE_MIN_V:,}:",
            "",
            "| step | kernel | category | calls a step | ms a step | share |",
            "|---|---|---|---|---|---|",
        ]
        for k, p in tops:
            lines += _top_rows(k, p, TOP_TABLE_KERNELS)
    return "\n".join(lines)


def _compile_text(comp: Any, muon: Any = None, attention: Any = None) -> str:
    """env.json's "compile" record: what ran (eager / compiled), and Muon's Newton-Schulz
    (`muon`: its muon_impl, "loop" or "stacked", and `attention`: the SDPA kernel torch picked,
    in files that record them)."""
    if not isinstance(comp, dict):
        return "–"
    ran = str(comp.get("ran") or comp.get("setting") or "?")
    ns = comp.get("newton_schulz")
    ns = ", ".join(str(x) for x in (ns, muon) if x)
    extra = [f"Newton-Schulz {ns}"] if ns else []
    extra += [f"attention {attention}"] if attention else []
    return ran + (f" ({'; '.join(extra)})" if extra else "")


def trainer_table(snap: dict[str, Any]) -> str:
    sec = snap["sections"].get("trainer", {})
    sets = "".join(f" --set {kv}" for kv in snap["shapes"].get("trainer_sets", []))
    lines = [
        f"`tngram train RECIPE --stop-after {snap['shapes']['trainer_steps']}{sets}` "
        + ("(recipe defaults otherwise), " if sets else "(recipe defaults), ")
        + "tokens/s as the median of the per-step windows from step 3 on; val bpb on 1,048,576 "
        "validation tokens after the last step:",
        "",
        "| recipe | tokens/s | step ÷ Engram's | last train loss | val bpb | forward | lookup "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    eng = sec.get("paper-l9-engram")
    eng_tps = eng.get("tokens_per_s") if _ok(eng) else None
    for r in snap["recipes"]:
        t = sec.get(r)
        comp = t.get("compile") if _ok(t) else None
        tps = t.get("tokens_per_s") if _ok(t) else None
        # a step's time is tokens_per_step / tokens_per_s: Engram's rate over this one's
        ratio = f"{eng_tps / tps:.3f}×" if eng_tps and tps else "–"
        lines.append(
            md_row(
                [
                    r,
                    _cell(t, "tokens_per_s", ",.0f"),
                    ratio,
                    _cell(t, "last_train_loss", ".4f"),
                    _cell(t, "val_bpb", ".4f"),
                    _compile_text(
                        comp,
                        t.get("muon_impl") if _ok(t) else None,
                        t.get("sdpa_backend") if _ok(t) else None,
                    ),
                    str(t.get("lookup_impl")) if _ok(t) else "–",
                    _cell(t, "peak_gb", ".1f"),
                ]
            )
        )
    return "\n".join(lines)


def tables_table(snap: dict[str, Any]) -> str:
    sec = snap["sections"].get("tables", {})
    heads = ["V", "raw ms"] + [f"{lab} {u}" for m, lab in MODELS[1:] for u in UPDATES]
    lines = [
        f"One optimiser step, {snap['shapes']['table_batch']} sequences, per "
        "`optim.memory_update`: ms (÷ the raw step at the same V):",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "---|" * len(heads),
    ]
    for V in snap["shapes"]["vocabs"]:
        raw = sec.get(f"raw@{V}")
        cells = [f"{V:,}", _cell(raw, "median_ms", ".1f")]
        for m, _ in MODELS[1:]:
            for u in UPDATES:
                r = sec.get(f"{m}@{V}/{u}")
                ms = _cell(r, "median_ms", ".1f")
                cells.append(ms + (f" ({_ratio(r, raw)})" if _ok(r) and _ok(raw) else ""))
        lines.append(md_row(cells))
    mallocs = [
        f"{k} {it['cuda_mallocs']:.1f}"
        for k, it in sec.items()
        if _ok(it) and (it.get("cuda_mallocs") or 0) > 0
    ]
    if mallocs:  # files from before the allocator counts have none
        lines += [
            "",
            "Segments the allocator had to get from the driver (cudaMalloc) per timed step, "
            "where any: " + ", ".join(mallocs) + ".",
        ]
    how = timed_how(sec)
    return "\n".join(lines + (["", how] if how else []))


def timed_how(sec: dict[str, Any]) -> str:
    """How the table steps were timed, for files that record it (research.bench.gpu_tables): the
    groups timed interleaved, the batches cycled, the steps re-timed alone after running out of
    memory together; "" for older files (each step timed alone, on one batch)."""
    groups: list[list[str]] = []
    for k, it in sec.items():
        if _ok(it) and it.get("interleaved_with"):
            g = sorted([k, *it["interleaved_with"]], key=list(sec).index)
            if g not in groups:
                groups.append(g)
    if not groups:
        return ""
    batches = sorted({it["batches"] for it in sec.values() if _ok(it) and "batches" in it})
    alone = [k for k, it in sec.items() if _ok(it) and not it.get("interleaved_with")]
    oom = [k for k, it in sec.items() if it.get("alone_after_oom")]
    return (
        "Timed interleaved in one process (every step of a group in turn, round after round"
        + (f"; each step reads the next of its {batches[0]} batches" if len(batches) == 1 else "")
        + "), in these groups: "
        + "; ".join(", ".join(g) for g in groups)
        + "."
        + (f" Timed alone: {', '.join(alone)}." if alone else "")
        + (f" Out of memory together, re-timed alone: {', '.join(oom)}." if oom else "")
    )


def lookup_lines(snap: dict[str, Any]) -> str:
    lk = snap["sections"].get("lookup", {}).get("paper-l9-tngram")
    doc = snap["sections"].get("doctor", {}).get("self_checks")
    out = []
    if _ok(doc):
        checks = ", ".join(
            f"{k} {'passed' if v.get('passed') else 'FAILED'} ({v.get('max_rel_err', 0):.2e})"
            for k, v in doc["self_checks"].items()
        )
        out.append(f"- `tngram doctor` self-checks: {checks or 'none run'}.")
    else:
        out.append(f"- `tngram doctor` self-checks: {_cell(doc, 'passed', '')}.")
    if _ok(lk):
        k = lk["kernel"]
        for dt in ("fp32", "bf16"):
            m = lk[f"model_{dt}"]
            out.append(
                f"- {k} vs torch inside paper-l9-tngram ({lk['batch']} × {lk['seq']} tokens, "
                f"{dt}): loss {m['loss_torch']:.6f} vs {m['loss_kernel']:.6f}, memory gradients "
                f"within {m['max_rel_grad_err']:.1e}; one module's lookup fwd+bwd "
                f"{lk[f'time_torch_{dt}']['median_ms']:.2f} ms (torch) vs "
                f"{lk[f'time_{k}_{dt}']['median_ms']:.2f} ms ({k})."
            )
    else:
        out.append(f"- lookup check: {_cell(lk, 'kernel', '')}.")
    return "\n".join(out)


def render_run(snap: dict[str, Any], source: str) -> str:
    """Every table of one bench-gpu results file."""
    parts = [run_heading(snap, source)]
    if snap.get("notes"):  # how the run deviated from its command, or what was edited after it
        parts.append(f"Note: {snap['notes']}")
    parts.append(lookup_lines(snap))
    if snap["sections"].get("kernels"):
        parts.append(kernels_table(snap))
    if snap["sections"].get("attention"):
        parts.append(attention_table(snap))
    if snap["sections"].get("optim"):
        parts.append(optim_table(snap))
    if "fwdbwd" in snap["sections"]:
        parts.append(fwdbwd_table(snap))
        if _profiles(snap):  # only files of a --profile run
            parts.append(profile_table(snap))
    if "trainer" in snap["sections"]:
        parts.append(trainer_table(snap))
    if "tables" in snap["sections"]:
        parts.append(tables_table(snap))
        if any(_ok(it) and "profile" in it for it in snap["sections"]["tables"].values()):
            parts.append(tables_profile_table(snap))
    return "\n\n".join(parts)


# --- the index ---------------------------------------------------------------------------------


def resolve_index(snap: dict[str, Any], results_dir: Path) -> dict[str, Any]:
    """`snap` with "runs": [(file name, bench-gpu snapshot)] of research/results/gpu-*.json, oldest
    first as the index's "order" lists them, tiny CPU runs left out. A run the order does not
    list is refused with one line saying where to add it (the goals block reads the newest)."""
    runs = []
    for path in sorted(results_dir.glob("gpu-*.json")):
        other = read_results(path)  # strict JSON, times >= 0 (research.report.markdown)
        if isinstance(other, dict) and other.get("kind") == "bench-gpu" and not other.get("tiny"):
            runs.append((path.name, other))
    order = list(snap.get("order", []))
    missing = [name for name, _ in runs if name not in order]
    if missing:
        raise TngramError(
            f'{results_dir / "gpu.json"}: "order" (the runs, oldest first) does not list '
            f"{', '.join(missing)}; add it where it belongs"
        )
    runs.sort(key=lambda run: order.index(run[0]))
    return {**snap, "runs": runs}


def render_goals(snap: dict[str, Any]) -> str:
    """The "gpu:goals" view of the index: the goal point by point (research.report.gpu_goals)."""
    if "runs" not in snap:
        raise TngramError("a 'gpu-index' results file must be resolved against research/results "
        "first")
    files = ", ".join(f"`{n}`" for n, _ in snap["runs"]) or "none yet"
    return (
        goals_table(snap["runs"])
        + "\n\nGenerated from the `python -m research bench gpu` results files in "
        "`research/results/` (oldest "
        + f"first: {files}) by `research/report/gpu_goals.py`, which says what each point reads."
    )


def render_trainer(snap: dict[str, Any]) -> str:
    """The "gpu:trainer" view of the index: each paper-l9 recipe's newest `tngram train` tokens/s
    at the trainer's defaults (research.report.gpu_goals.at_defaults), beside what `tngram plan
    RECIPE --card CARD` estimates for it."""
    from research.report.gpu_goals import at_defaults
    from tngram.cli.plan import card_named, speed
    from tngram.train.recipes import get_recipe

    if "runs" not in snap:
        raise TngramError("a 'gpu-index' results file must be resolved against research/results "
        "first")
    newest: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for name, run in snap["runs"]:  # oldest first: a later run replaces an earlier one's row
        for recipe, r in (run.get("sections") or {}).get("trainer", {}).items():
            if at_defaults(run) and _ok(r) and r.get("tokens_per_s"):
                newest[recipe] = (name, run, r)
    lines = [
        md_row(["recipe", "card", "tokens/s", "`tngram plan --card`", "from"]),
        "|---|---|---|---|---|",
    ]
    for recipe, (name, run, r) in newest.items():
        tps = r["tokens_per_s"]
        try:
            est = speed(get_recipe(recipe), 1, card_named(run["card_slug"]))["tokens_per_s"]
            planned = f"{est:,.0f} ({est / tps - 1:+.1%})"
        except TngramError:  # a card plan has no preset for
            planned = "–"
        where = f"`{name}` ({run['commit']}, {r['steps']} steps)"
        lines.append(md_row([f"`{recipe}`", run["card"], f"{tps:,.0f}", planned, where]))
    return "\n".join(lines) + (
        "\n\nGenerated from the `python -m research bench gpu` results files in "
        "`research/results/` (the newest run of each recipe that changed no trainer setting: "
        "compiled, bf16 autocast, 524,288 tokens a step on one card; tokens/s the median of the "
        "per-step windows from step 3) and `tngram plan` (tngram/cli/plan.py)."
    )


def _items(want: dict[str, Any], run: dict[str, Any], base: list[str]) -> list[tuple[str, str]]:
    """(section, key) pairs of one wanted number in `run`; {recipe} expands per recipe group."""
    others = [r for r in run.get("recipes", []) if r not in base]
    out = []
    for item in want["items"]:
        sec, key = item.split(":", 1)
        if "{base}" in key:
            out += [(sec, key.replace("{base}", r)) for r in base]
        elif "{other}" in key:
            out += [(sec, key.replace("{other}", r)) for r in others]
        else:
            out.append((sec, key))
    return out


def measured_in(want: dict[str, Any], run: dict[str, Any], base: list[str]) -> bool:
    items = _items(want, run, base)
    return bool(items) and all(_ok(run["sections"].get(s, {}).get(k)) for s, k in items)


def open_table(snap: dict[str, Any]) -> str:
    base = snap["base_recipes"]
    lines = [
        "| number | `python -m research bench gpu` | first GPU check (fb2264d) |",
        "|---|---|---|",
    ]
    for want in snap["wanted"]:
        where = [f"`{name}`" for name, run in snap["runs"] if measured_in(want, run, base)]
        lines.append(
            md_row([want["label"], ", ".join(where) if where else "**open**", want["first_check"]])
        )
    return "\n".join(lines)


def render_index(snap: dict[str, Any]) -> str:
    if "runs" not in snap:
        raise TngramError("a 'gpu-index' results file must be resolved against research/results "
        "first")
    parts = []
    for name, run in snap["runs"]:
        parts.append(render_run(run, f"research/results/{name}"))
    if not snap["runs"]:
        parts.append(
            "No `python -m research bench gpu` results file (`research/results/gpu-<card>.json`) "
            "is in the "
            "repository yet: every number of that command is open. What each number is, and "
            "what the first GPU check measured of it at commit fb2264d (its table above):"
        )
    else:
        parts.append("Each number the issue asks for, and the results files that measured it:")
    parts.append(open_table(snap))
    files = ", ".join(f"`research/results/{n}`" for n, _ in snap["runs"]) or "none yet"
    parts.append(
        "Generated from `research/results/gpu.json` (the list of numbers) and every `python -m "
        "research bench "
        f"gpu` results file beside it ({files}); runs at tiny CPU shapes are not shown."
    )
    return "\n\n".join(parts)


# --- the first check -----------------------------------------------------------------------------


def render_check(snap: dict[str, Any]) -> str:
    """The first GPU check's table: fwd+bwd eager/compiled, trainer tokens/s, ratios to raw."""
    st, runs = snap["steps"]["steps"], snap["train"]["runs"]
    sh = snap["steps"]

    def ms_row(label: str, mode: str) -> list[str]:
        raw = st[f"raw/{mode}"]["median_ms"]
        cells = [label]
        for m, _ in MODELS:
            v = st[f"{m}/{mode}"]["median_ms"]
            cells.append(f"{v:.1f} ms" + ("" if m == "raw" else f" ({v / raw:.2f}× raw)"))
        return cells

    def tps_row(label: str, sfx: str) -> list[str]:
        cells = [label]
        for m, _ in MODELS:
            r = runs.get(m + sfx)
            cells.append("–" if r is None else f"{r['median_tokens_per_s'] / 1e3:,.0f}k")
        return cells

    head = "| paper-l9, bf16 autocast | raw | Engram | TN-gram |"
    lines = [head, "|---|---|---|---|"]
    n = f"{sh['B']} × {sh['T']} tokens"
    lines.append(md_row(ms_row(f"forward+backward, {n}, eager (median of 15)", "eager")))
    lines.append(md_row(ms_row("the same, `torch.compile`", "compile")))
    steps = snap["train"]["runs"]["raw"]["steps"]
    lines.append(md_row(tps_row(f"`tngram train … --stop-after {steps}`, tokens/s", "")))
    lines.append(md_row(tps_row("the same with `run.compile=true`", "+compile")))
    lines.append(md_row(tps_row("the same with `optim.memory_update=sparse`", "+sparse")))
    sc = ", ".join(f"{k} {v['max_rel_err']:.2e}" for k, v in snap["doctor"]["self_checks"].items())
    lc = "; ".join(
        f"{dt}: loss {snap['steps'][f'lookup_check_{dt}']['loss_torch']:.6f} both, memory "
        f"gradients within {snap['steps'][f'lookup_check_{dt}']['max_rel_grad_err']:.1e}"
        for dt in ("fp32", "bf16")
    )
    lines += [
        "",
        f"`tngram doctor` self-checks passed (max rel err {sc}). Triton vs torch lookup inside "
        f"paper-l9-tngram ({snap['steps']['lookup_batch']} × {sh['T']} tokens): {lc}.",
    ]
    return "\n".join(lines)
