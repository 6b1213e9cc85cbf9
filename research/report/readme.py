"""The demo's table comes from a results file in the repository, never by hand.

`python -m research report readme DIR` takes a `tngram compare` folder (e.g. the `runs/compare-cpu`
of `make
demo`), writes a snapshot of it to research/results/demo-compare-cpu.json (rows + the commit,
machine
and command the runs recorded) and regenerates the block of research/RESULTS.md (the default --doc;
the README links to it rather than carrying tables and their provenance) between

    <!-- BEGIN generated: demo-compare-cpu -->
    <!-- END generated: demo-compare-cpu -->

from that snapshot. `--name NAME --doc FILE` does the same for any block of any Markdown file
(snapshot research/results/NAME.json), e.g. a three-seed table in research/RESULTS.md. The markers
and
the check of every block of a file live in research.report.docblocks (`python -m research report
doc FILE
--check`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import MissingFileError

# names kept importable from here (research.cli.report and tests import them from this module)
from research.report.markdown import (  # noqa: F401
    begin_marker,
    block_names,
    current_block,
    end_marker,
    replace_block,
    snapshot_path,
)
from tngram.report.compare import compare_table

BLOCK = "demo-compare-cpu"
SNAPSHOT = Path("research/results/demo-compare-cpu.json")
KEEP = (
    "method",
    "seed",
    "delta_params",
    "train_loss",
    "val_loss",
    "val_bpb",
    "core",
    "tokens_per_s",
    "wall_s",
)


def snapshot(compare_dir: Path) -> dict[str, Any]:
    """The parts of a `tngram compare` folder the README shows, with provenance from the runs'
    env.json (commit, dirty flag, CPU count, torch version, command line)."""
    path = compare_dir / "results.json"
    if not path.is_file():
        raise MissingFileError(f"{path} not found: is {compare_dir} a `tngram compare` folder?")
    from tngram.readback import load_json, read_results_file

    results = read_results_file(path)
    envs, row_commits = [], []
    for r in results["rows"]:
        env = compare_dir / "runs" / Path(str(r.get("run_dir", ""))).name / "env.json"
        e = load_json(env) if env.is_file() else {}
        envs.append(e)
        row_commits.append(((e.get("git") or {}).get("commit") or "unknown")[:12])
    commits = list(dict.fromkeys(row_commits))
    rows = results["rows"]
    dirty = any((e.get("git") or {}).get("dirty") for e in envs)
    first = next((e for e in envs if e), {})
    return {
        "command": (
            f"tngram compare --preset {results.get('preset')} --seeds {results.get('seeds')}"
        ),
        "commit": commits[0]
        if len(commits) == 1
        else ", ".join(
            f"{c} ({', '.join(r['method'] for r, rc in zip(rows, row_commits) if rc == c)})"
            for c in commits
        ),
        "dirty": dirty,
        "platform": first.get("platform"),
        "cpu_count": first.get("cpu_count"),
        "torch": first.get("torch"),
        "torch_threads": first.get("torch_threads"),
        "preset": results.get("preset"),
        "seeds": results.get("seeds"),
        "rows": [{k: r.get(k) for k in KEEP} for r in results["rows"]],
    }


def render_block(snap: dict[str, Any], source: str = str(SNAPSHOT)) -> str:
    """The README table (Table 1 layout, one row per method) and one provenance line."""
    table = compare_table({"preset": snap["preset"], "rows": snap["rows"]}).split("\n\n")[0]
    wall = sum(r.get("wall_s") or 0 for r in snap["rows"])
    dirty = " (with uncommitted changes)" if snap.get("dirty") else ""
    note = f" Note: {snap['note']}" if snap.get("note") else ""
    where = [
        f"{snap['cpu_count']} CPUs" if snap.get("cpu_count") else "",
        f"{snap['torch_threads']} torch thread(s)" if snap.get("torch_threads") else "",
        f"{wall:.0f} s of training in total",
    ]
    return (
        f"{table}\n\nGenerated from `{source}` (`{snap['command']}` at commit "
        f"{snap['commit']}{dirty}; {', '.join(w for w in where if w)}).{note}"
    )
