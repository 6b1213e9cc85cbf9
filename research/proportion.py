"""The package's proportions, as the library/lab issue measures them: lines of tngram/ and of its
core (memory + model + kernels + optim), Markdown lines in the tree, imports of another module's
private (`_name`) names, TNGramConfig's fields, and whether `import tngram` has side effects.

    python -m research.proportion [--json]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
CORE = ("memory", "model", "kernels", "optim")
SKIP = {".git", ".venv", "node_modules", "runs"}


def source_lines(folder: Path) -> int:
    """Lines of Python and C source under `folder` (the C kernel is part of the package)."""
    files = [p for ext in ("*.py", "*.c") for p in folder.rglob(ext)]
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)


def markdown_lines(root: Path) -> int:
    files = [p for p in root.rglob("*.md") if not SKIP & set(p.relative_to(root).parts)]
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(package: Path, root: Path) -> list[str]:
    """`from A import _x` (or `import A._x`) where A is another module of the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "tests" in path.relative_to(package).parts:  # tests may reach into what they test
            continue
        here = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not node.module.startswith(package.name) or node.module == here:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{here}: from {node.module} import {alias.name}")
                if any(
                    p.startswith("_") and not p.startswith("__") for p in node.module.split(".")
                ):
                    found.append(f"{here}: from {node.module} import ...")
    return found


def import_side_effects() -> dict[str, bool]:
    code = (
        "import sys; before = list(sys.meta_path); import tngram; "
        "print(int(sys.meta_path != before), int('transformers' in sys.modules), "
        "int('torch' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    hook, transformers, torch = (bool(int(v)) for v in out.stdout.split())
    return {
        "meta_path_changed": hook,
        "transformers_imported": transformers,
        "torch_imported": torch,
    }


def figures() -> dict[str, object]:
    from tngram.memory.tngram import TNGramConfig

    package = ROOT / "tngram"
    total = source_lines(package)
    core = sum(source_lines(package / name) for name in CORE)
    return {
        "package_lines": total,
        "core_lines": core,
        "core_share": round(core / total, 4),
        "research_lines": source_lines(ROOT / "research"),
        "markdown_lines": markdown_lines(ROOT),
        "private_imports": private_imports(package, ROOT),
        "tngram_config_fields": len(dataclasses.fields(TNGramConfig)),
        "import_side_effects": import_side_effects(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    f = figures()
    if args.json:
        print(json.dumps(f, indent=2))
        return 0
    print(f"tngram/ lines:                {f['package_lines']:,} (goal <= 24,000)")
    print(
        f"memory+model+kernels+optim:   {f['core_lines']:,} = {f['core_share']:.1%} (goal >= 28%)"
    )
    print(f"research/ lines:              {f['research_lines']:,}")
    print(f"Markdown lines in the tree:   {f['markdown_lines']:,} (goal <= 5,000)")
    private = cast(list[str], f["private_imports"])
    print(f"private-name imports:         {len(private)} (goal 0)")
    for line in private:
        print(f"  {line}")
    print(f"TNGramConfig fields:          {f['tngram_config_fields']} (goal <= 19)")
    print(f"`import tngram` side effects: {f['import_side_effects']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
