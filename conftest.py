"""Fixtures shared by the library's tests (tests/) and the lab's (research/tests/)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# subprocesses of the tests (`python -m research ...`) import the lab from the clone's root, as a
# user does when running from the root; the library itself comes from the installed package
_ROOT = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture
def fresh_lookup_choice(monkeypatch):
    """A process state in which no lookup implementation has been chosen or self-checked yet, and
    none is forced by TNGRAM_LOOKUP_IMPL; returns the monkeypatch so a test can patch more."""
    import tngram.kernels.choice as choice
    monkeypatch.setattr(choice, "_CHOICE", {})
    monkeypatch.setattr(choice, "SELF_CHECKS", {})
    monkeypatch.delenv("TNGRAM_LOOKUP_IMPL", raising=False)
    return monkeypatch


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """Every test leaves SIGINT/SIGTERM handlers as it found them (a process that inherits an
    ignored SIGINT passes it on across exec: a later test's child would ignore Ctrl-C). A test that
    changes one fails here, naming the handler, and the handler is put back for the next test."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {s: signal.getsignal(s) for s in before if signal.getsignal(s) is not before[s]}
    for s in changed:
        if before[s] is not None:
            signal.signal(s, before[s])
    if changed:
        pytest.fail("left signal handlers changed: " + ", ".join(
            f"{signal.Signals(s).name} {before[s]!r} -> {h!r}" for s, h in changed.items()), pytrace=False)
