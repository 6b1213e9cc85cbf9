"""Generated blocks: tables in README.md and docs/*.md rendered from a committed results file.

A generated block is the text between two markers,

    <!-- BEGIN generated: NAME -->
    ...
    <!-- END generated: NAME -->

and it is a pure function of research/results/FILE.json, where FILE is NAME up to the first ":"
(NAME = FILE:VIEW lets one results file feed several blocks, e.g. the README speed table and the
research/PERFORMANCE.md tables all come from one `python -m research bench threads` run). The
file's "kind" picks
the renderer:

- "compare": a snapshot of a `tngram compare` folder (`python -m research report readme DIR`, Table
1 layout);
- "bench-threads": the output of `python -m research bench threads --json` (views "speed",
"candidates",
  "targets");
- "bench-contention": the output of `python -m research bench contention --json` (view "table");
- "bench-vocab": the output of `python -m research bench vocab --json` (views "table", "goals");
- "hf-peer": `python -m research.experiments.hf_peer` (research.report.peer_blocks);
- "gpu-index" (research/results/gpu.json): every `python -m research bench gpu` results file beside
it and the
  numbers still open (research.report.gpu_blocks), view "goals": the GPU goal point by point
  (research.report.gpu_goals), view "trainer": each recipe's newest trainer tokens/s beside
  `tngram plan`'s estimate; "gpu-check": the first GPU check's raw numbers;
- "summary": sentences whose numbers are cells of other results files (research.report.summary;
  the summary that opens research/RESULTS.md);
- "table": a table stored as it is shown: "columns" (each a header and an optional "fmt") and
  "rows" (one list of raw values per row), see `render_cell`.

Every results file carries "command", "commit" and "machine" (and "source": where the numbers were
taken from); the block ends with one line citing them. `python -m research report doc FILE`
rewrites every
block of FILE from its results file; `python -m research report doc FILE --check` only compares
(tests/test_readme.py runs it on README.md and docs/*.md), so a table that disagrees with its
results file fails the tests. A marker that is not well formed (another spacing, a name with a
folder or a space, a BEGIN without its END, a name twice) is refused with one line naming it:
every block found is checked or refused, and --check says how many it checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError
from research.report.bench_blocks import render_contention, render_threads, render_vocab
from research.report.gpu_blocks import (
    render_check,
    render_goals,
    render_index,
    render_trainer,
    resolve_index,
)

# the Markdown pieces (render_cell and render_table also importable from here, as before)
from research.report.markdown import (
    block_names,
    current_block,
    provenance,
    read_results,
    render_cell,  # noqa: F401
    render_table,
    replace_block,
    results_name,
    snapshot_path,
)
from research.report.peer_blocks import render_peer
from research.report.readme import render_block
from research.report.summary import render_summary
from research.report.summary import resolve as resolve_summary


def load_snapshot(doc: Path, name: str) -> dict[str, Any]:
    path = snapshot_path(doc, name)
    if not path.is_file():
        raise MissingFileError(f"{doc}: block {name!r} cites {path}, which is missing")
    snap = read_results(path)  # strict JSON, times >= 0 (research.report.markdown)
    if isinstance(snap, dict) and snap.get("kind") == "summary":  # its numbers live in other files
        snap = resolve_summary(snap, path.parent)
    if isinstance(snap, dict) and snap.get("kind") == "gpu-index":  # lists the gpu-*.json files
        snap = resolve_index(snap, path.parent)
    return snap


# --- rendering ---------------------------------------------------------------------------------


def render(snap: dict[str, Any], name: str) -> str:
    """The text of block `name` from its results file; a value the block cannot show (NaN, a
    string where a number belongs, a missing seed, a bad format code) is one line naming it."""
    source = f"research/results/{results_name(name)}.json"
    try:
        return _render(snap, name, source)
    except TngramError as e:
        raise TngramError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    except KeyError as e:  # the renderers read only the snapshot: a field it lacks
        raise TngramError(f"{source}: field {e} is missing") from None
    except (TypeError, ValueError, IndexError, AttributeError) as e:
        raise TngramError(f"{source}: a field has the wrong type or shape ({e})") from None


def _render(snap: dict[str, Any], name: str, source: str) -> str:
    view = name.split(":", 1)[1] if ":" in name else ""
    kind = snap.get("kind", "compare")
    if kind == "compare":
        return render_block(snap, source)
    if kind == "table":
        return render_table(snap) + "\n\n" + provenance(snap, source)
    if kind == "bench-threads":
        return render_threads(snap, view) + "\n\n" + provenance(snap, source)
    if kind == "bench-contention":
        return render_contention(snap, view) + "\n\n" + provenance(snap, source)
    if kind == "bench-vocab":
        return render_vocab(snap, view) + "\n\n" + provenance(snap, source)
    if kind == "summary":
        return render_summary(snap) + "\n\n" + provenance(snap, source)
    if kind == "gpu-index":  # its own closing line names every file it read
        views = {"goals": render_goals, "trainer": render_trainer}
        return views.get(view, render_index)(snap)
    if kind == "gpu-check":
        return render_check(snap) + "\n\n" + provenance(snap, source)
    if kind == "hf-peer":
        return render_peer(snap) + "\n\n" + provenance(snap, source)
    raise TngramError(
        f"{source}: unknown kind {kind!r} (expected compare, table, bench-threads, "
        "bench-contention, bench-vocab, summary, gpu-index, gpu-check or hf-peer)"
    )


# --- a whole document ----------------------------------------------------------------------------


def check_doc(doc: Path) -> list[str]:
    """Names of the blocks of `doc` that differ from the rendering of their results file."""
    text = doc.read_text(encoding="utf-8")
    return [
        n
        for n in block_names(text, str(doc))
        if current_block(text, n) != render(load_snapshot(doc, n), n)
    ]


def regenerate_doc(doc: Path, names: list[str] | None = None) -> tuple[str, list[str]]:
    """The text of `doc` with blocks `names` (default: all) rendered again, and the names
    changed."""
    text = doc.read_text(encoding="utf-8")
    changed = []
    for n in names or block_names(text, str(doc)):
        block = render(load_snapshot(doc, n), n)
        if current_block(text, n) != block:
            text = replace_block(text, n, block)
            changed.append(n)
    return text, changed
