"""Training progress lines carry the elapsed time and an ETA, on and off a terminal."""

from __future__ import annotations

import math
import re

import pytest

from tngram.train import metrics
from tngram.train.metrics import Progress, progress_line


def test_progress_line_format():
    # 65 s = 1 min 05 s; ETA 260 s = 4 min 20 s; loss rounded to 4 places, tokens/s to an int
    assert progress_line("mini-tngram", 40, 200, 5.12346, 9868.4, 65.0, 260.0) == (
        "mini-tngram: step 40/200 loss 5.1235 9,868 tokens/s, 1 min 05 s elapsed, ETA 4 min 20 s")
    assert progress_line("r", 1, 2, 1.0, 0.0, 3.4, math.nan).endswith("3 s elapsed, ETA ?")
    assert progress_line("r", 1, 2, 1.0, 0.0, 7200.0, 0.0).endswith("2 h 00 min elapsed, ETA 0 s")


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("initial", [0, 4])
def test_plain_lines_show_elapsed_and_eta_at_the_session_rate(initial, monkeypatch, capsys):
    clock = FakeClock(100.0)
    monkeypatch.setattr(metrics.time, "monotonic", clock)
    p = Progress(total=10, initial=initial, desc="run", enabled=True, bar=False, log_every=2)
    lines = []
    for k in range(1, 10 - initial + 1):     # one step every 5 s
        clock.t = 100.0 + 5 * k
        p.update(2.0, 1000.0)
        lines += [x for x in capsys.readouterr().err.splitlines() if x]
    steps = [s for s in range(initial + 1, 11) if s % 2 == 0 or s == 10]
    assert len(lines) == len(steps)
    for line, s in zip(lines, steps):
        done = s - initial
        elapsed, eta = 5 * done, 5 * (10 - s)          # 5 s per step, steps left
        assert line == (f"run: step {s}/10 loss 2.0000 1,000 tokens/s, "
                        f"{elapsed} s elapsed, ETA {eta} s")


def test_terminal_bar_shows_elapsed_and_remaining(capsys):
    p = Progress(total=3, initial=0, desc="run", enabled=True, bar=True)
    for _ in range(3):
        p.update(2.0, 1000.0)
    p.close()
    err = capsys.readouterr().err
    assert re.search(r"3/3 \[\d\d:\d\d<\d\d:\d\d", err), err      # tqdm's [elapsed<remaining]
