"""Docs describe the present: no section is titled by its age ("Earlier", "Previous", "Before ...",
"Current: ..."); measurements of older code live in the log (docs/LOG.md and its archive
docs/history/) under headings naming their commit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "research").glob("*.md"))
AGE = re.compile(r"^#+\s+(earlier|previous|before|current|older|newer|latest|formerly|now)\b", re.I | re.M)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_section_is_titled_by_its_age(doc):
    assert AGE.findall(doc.read_text(encoding="utf-8")) == [], doc


def test_the_pattern_catches_the_titles_it_is_for():
    text = "# A\n## Earlier: threads\n### Previous: x\n## Before the profiling pass\n## Current: idle\n## Files checked before use\n"
    assert [m.lower() for m in AGE.findall(text)] == ["earlier", "previous", "before", "current"]


def test_performance_md_has_the_present_parts():
    text = (ROOT / "research" / "PERFORMANCE.md").read_text(encoding="utf-8")
    for head in ("## How to measure", "## What limits speed", "## Tried and not kept", "## Decode"):
        assert f"\n{head}" in text, head
