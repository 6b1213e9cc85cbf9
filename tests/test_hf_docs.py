"""Every ```python block of docs/HF.md runs: in order, in one namespace, from an empty
temporary directory (offline; tiny random models)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

DOC = Path(__file__).resolve().parents[1] / "docs" / "HF.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python fenced block."""
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return out


def test_docs_have_examples():
    assert len(python_blocks(DOC.read_text())) >= 5


def test_every_python_block_runs(tmp_path, monkeypatch):
    for extra, package in (("quantized", "bitsandbytes"), ("trl", "trl")):  # make test has both
        pytest.importorskip(package, reason=f"the {extra} extra is not installed")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__hf_docs__"}
    for line, code in python_blocks(DOC.read_text()):
        try:
            exec(compile(code, f"{DOC.name}:{line}", "exec"), namespace)
        except Exception as e:  # name the block that failed
            raise AssertionError(f"docs/HF.md block at line {line} failed: {e!r}") from e
