"""Layers point one way: the contracts in .importlinter (import-linter), plus a few rules of our own.

The layers, top to bottom (.importlinter is the source of truth; docs/ARCHITECTURE.md draws them):
cli <- experiments <- hf | report <- train <- eval <- optim | data <- model <- memory <- kernels <-
readback <- safefs | cpu <- common. No library module imports tngram.hf or the lab (research/),
no package has an import cycle, and no module imports another's private names. `import tngram` loads no torch, transformers, matplotlib or scipy.
Below, by scanning imports with ast: memory never imports model/train/optim/...; the model never
imports optim/train; optim never imports the model; reporting only reads run folders.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tngram"


def test_import_linter_contracts():
    """`lint-imports` on .importlinter: layers, tngram.hf on top, no import cycles (imports inside
    functions count too). A broken contract prints the offending import chain."""
    pytest.importorskip("importlinter", reason="import-linter is in the dev extra (make test installs it)")
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())", str(ROOT / ".importlinter"), "--no-cache",
                        "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_contracts_name_every_package():
    """Every package and loose module of tngram sits in a layer (a new one must be placed)."""
    text = (ROOT / ".importlinter").read_text()
    layers = text.split("layers =", 1)[1].split("ignore_imports", 1)[0]
    named = {m.strip() for line in layers.splitlines() for m in line.split("|") if m.strip()}
    have = {f"tngram.{p.name}" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    have |= {f"tngram.{p.stem}" for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert have <= named, sorted(have - named)


def test_import_tngram_is_light():
    """`import tngram` (a fresh process) imports none of the heavy or optional dependencies and
    patches nothing (no import hook: the Hugging Face integration is `import tngram.hf`); the
    public names load them on first use."""
    code = ("import sys, json; hooks = list(sys.meta_path); import tngram; "
            "heavy = ('torch', 'transformers', 'peft', 'matplotlib', 'scipy'); "
            "print(json.dumps([m for m in heavy if m in sys.modules] + "
            "(['meta_path'] if sys.meta_path != hooks else [])))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []

FORBIDDEN = {
    "memory": ("tngram.model", "tngram.train", "tngram.optim", "tngram.data", "tngram.eval",
               "tngram.experiments", "tngram.report", "tngram.train.recipes", "research.bench"),
    "model": ("tngram.train", "tngram.optim", "tngram.data", "tngram.eval", "tngram.experiments",
              "tngram.report", "tngram.train.recipes", "research.bench"),
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
    """Never a bare `rank`; write cp_rank (tensor rank) or ddp_rank (process)."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Name) and node.id == "rank":
                bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
            if isinstance(node, ast.arg) and node.arg == "rank":
                bad.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not bad, bad


def test_no_module_imports_another_modules_private_names():
    """Modules use each other's public names only: no `from tngram.a import _x` across modules,
    in the library or the lab (research.proportion's scan; size is ruff's PLR0915's job)."""
    from research.proportion import private_imports
    assert private_imports(PKG, ROOT) == []
    assert private_imports(ROOT / "research", ROOT) == []


def test_private_import_scan_finds_one(tmp_path):
    """The scan above reports a cross-module private import (and not a module's own names)."""
    from research.proportion import private_imports
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\nfrom pkg.a import _x as y\n")
    (pkg / "b.py").write_text("from pkg.a import _x\nfrom pkg.a import __doc__\n")
    assert private_imports(pkg, tmp_path) == ["pkg.b: from pkg.a import _x"]
