"""Static checks `make test` runs over tngram/: the linter (ruff: pyflakes' rules F and the line
length E501, configured in pyproject.toml [tool.ruff]) and the type checker (mypy,
[tool.mypy]). A finding fails the test with the tool's own report. Each test skips, saying so,
only where its tool is not installed (both are in the `dev` extra that `make test` installs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    """The tool next to this Python (the venv's), else on PATH; skip if neither."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]' installs it)")
    return found


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing_in_the_package():
    r = _run([_tool("ruff"), "check", "--no-cache", "tngram"], timeout=120)
    assert r.returncode == 0, f"ruff check tngram:\n{r.stdout}{r.stderr}"


@pytest.mark.slow  # about a minute from scratch; mypy's cache (.mypy_cache) makes reruns quick
def test_mypy_finds_nothing_in_the_package():
    r = _run([_tool("mypy")], timeout=900)
    assert r.returncode == 0, f"mypy (pyproject.toml [tool.mypy]):\n{r.stdout}{r.stderr}"


def test_the_static_checks_are_configured_as_documented():
    """The checks this file runs are the ones pyproject.toml promises (so a changed config
    cannot silently drop a rule)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["tool"]["ruff"]["line-length"] == 100
    assert {"F", "E501"} <= set(conf["tool"]["ruff"]["lint"]["select"])
    assert conf["tool"]["mypy"]["files"] == ["tngram"]
    dev = " ".join(conf["project"]["optional-dependencies"]["dev"])
    assert "ruff" in dev and "mypy" in dev
