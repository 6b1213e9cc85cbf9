"""Layers point one way (DEVELOPERS.md): checked by scanning imports with ast.

memory never imports model/train/optim/...; the model never imports optim/train; optim never
imports the model; reporting only reads run folders (never imports train/model).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tngram"

FORBIDDEN = {
    "memory": ("tngram.model", "tngram.train", "tngram.optim", "tngram.data", "tngram.eval",
               "tngram.experiments", "tngram.report", "tngram.train.recipes", "tngram.bench"),
    "model": ("tngram.train", "tngram.optim", "tngram.data", "tngram.eval", "tngram.experiments",
              "tngram.report", "tngram.train.recipes", "tngram.bench"),
    "optim": ("tngram.model", "tngram.train", "tngram.data", "tngram.eval", "tngram.experiments",
              "tngram.report", "tngram.train.recipes"),
    "data": ("tngram.model", "tngram.train", "tngram.optim", "tngram.memory", "tngram.experiments",
             "tngram.report", "tngram.train.recipes"),
    "report": ("tngram.model", "tngram.train", "tngram.optim", "tngram.memory", "tngram.data"),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_import_directions():
    violations = []
    for area, banned in FORBIDDEN.items():
        for f in sorted((PKG / area).rglob("*.py")):
            for mod in imports_of(f):
                if mod.startswith(banned):
                    violations.append(f"{f.relative_to(PKG.parent)} imports {mod}")
    assert not violations, "\n".join(violations)


def test_no_bare_rank_names():
    """DEVELOPERS.md: never a bare `rank`; write cp_rank or ddp_rank."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Name) and node.id == "rank":
                bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
            if isinstance(node, ast.arg) and node.arg == "rank":
                bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not bad, bad


def test_no_source_file_over_600_lines():
    long = [f"{f.relative_to(PKG.parent)}: {n}" for f in PKG.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 600]
    assert not long, long
