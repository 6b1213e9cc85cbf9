"""Docs describe the present: no section is titled by its age ("Earlier", "Previous", "Before ...",
"Current: ..."), and the decision log (docs/LOG.md) is headed by decisions, not by when they were
made; git keeps the history."""

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


LOG = ROOT / "docs" / "LOG.md"
WHEN = re.compile(r"\b(1[89]|20)\d\d\b|\d{4}-\d\d|\b(sitting|session)s?\b|\bissues? \d", re.I)


def bad_log_headings(text: str) -> list[str]:
    """The log's `## ` headings longer than 70 characters or naming a date, sitting or issue."""
    heads = re.findall(r"^## (.+)$", text, re.M)
    return [h for h in heads if len(h) > 70 or WHEN.search(h)]


def test_log_headings_are_short_decisions_not_dates():
    text = LOG.read_text(encoding="utf-8")
    assert len(re.findall(r"^## ", text, re.M)) >= 10
    assert bad_log_headings(text) == []


def test_the_log_rule_catches_what_it_is_for():
    ok = "Muon stacks same-shape matrices on CUDA; the CPU keeps the loop"
    bad = ["Engram wins (2026-11-23)", "No GPU again, ninth sitting", "Fixed in issue 12", "x" * 71]
    text = "".join(f"## {h}\n\nbody\n\n" for h in [ok, *bad])
    assert bad_log_headings(text) == bad
