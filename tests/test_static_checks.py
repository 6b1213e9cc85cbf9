"""Static checks `make test` runs over tngram/: the linter (ruff: pyflakes' rules F, the line
length E501 and the function size PLR0915, at most 50 statements a function; configured in
pyproject.toml [tool.ruff]) and the type checker (mypy,
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
    r = _run([_tool("ruff"), "check", "--no-cache", "tngram", "research"], timeout=120)
    assert r.returncode == 0, f"ruff check tngram research:\n{r.stdout}{r.stderr}"


# the packages of the `hf` extra that tngram.hf imports; `make install` installs none of them
HF_EXTRA = ("transformers", "peft", "accelerate", "tokenizers")


def _ini_value(v: object) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def _config_without_hf_extra(path: Path) -> Path:
    """pyproject.toml's [tool.mypy] as an ini file, plus the hf extra's packages skipped:
    mypy then types them as Any, exactly as when they are not installed (the same findings as
    a venv without them, checked by hand with mypy 2.4)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    conf = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"])
    overrides = conf.pop("overrides", [])
    lines = ["[mypy]", *(f"{k} = {_ini_value(v)}" for k, v in conf.items())]
    for o in overrides:
        section = f"[mypy-{_ini_value(o.pop('module'))}]"
        lines += ["", section, *(f"{k} = {_ini_value(v)}" for k, v in o.items())]
    lines += ["", "[mypy-" + ",".join(f"{m},{m}.*" for m in HF_EXTRA) + "]"]
    lines += ["follow_imports = skip", "follow_imports_for_stubs = True"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow  # about a minute from scratch; mypy's cache (.mypy_cache) makes reruns quick
@pytest.mark.parametrize("hf_extra", ["installed", "absent"])
def test_mypy_finds_nothing_in_the_package(hf_extra, tmp_path):
    """mypy passes with the hf extra installed (as `make test` has it) and as a plain
    `make install` leaves the package (transformers, peft, ... absent: typed as Any)."""
    argv = [_tool("mypy")]
    if hf_extra == "installed":
        import importlib.util

        missing = [m for m in HF_EXTRA if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"the hf extra is not installed ({missing}): pip install -e '.[hf]'")
    else:
        ini = _config_without_hf_extra(tmp_path / "mypy.ini")
        argv += ["--config-file", str(ini), "--cache-dir", str(ROOT / ".mypy_cache" / "no-hf")]
    r = _run(argv, timeout=900)
    assert r.returncode == 0, f"mypy (hf extra {hf_extra}):\n{r.stdout}{r.stderr}"


def test_the_static_checks_are_configured_as_documented():
    """The checks this file runs are the ones pyproject.toml promises (so a changed config
    cannot silently drop a rule)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["tool"]["ruff"]["line-length"] == 100
    assert {"F", "E501", "PLR0915"} <= set(conf["tool"]["ruff"]["lint"]["select"])
    assert conf["tool"]["ruff"]["lint"]["pylint"]["max-statements"] == 50
    assert conf["tool"]["mypy"]["files"] == ["tngram", "research"]
    dev = " ".join(conf["project"]["optional-dependencies"]["dev"])
    assert "ruff" in dev and "mypy" in dev
