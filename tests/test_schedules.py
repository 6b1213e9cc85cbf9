"""LR multiplier and Muon momentum at the boundary steps (parameter-golf's train_gpt.py, step mode)."""

from __future__ import annotations

import pytest

from tngram.optim.schedules import lr_multiplier, muon_momentum


@pytest.mark.parametrize("step,expected", [
    (0, 1.0),
    (4799, 1.0),              # last flat step: 6000 - 1200 - 1
    (4800, 1.0),              # first warmdown step: (6000 - 4800) / 1200
    (4801, 1199 / 1200),
    (5400, 0.5),              # half-way through the warmdown
    (5999, 1 / 1200),         # last step
    (6000, 0.0),              # past the end
])
def test_paper_lr_schedule(step, expected):
    assert lr_multiplier(step, 6000, 1200) == pytest.approx(expected, abs=1e-15)


def test_no_warmdown_and_warmdown_longer_than_run():
    assert all(lr_multiplier(s, 10, 0) == 1.0 for s in range(10))
    # parameter-golf: with warmdown > steps the decay covers the whole run: (10 - 0) / 20 at step 0
    assert lr_multiplier(0, 10, 20) == 0.5
    assert lr_multiplier(9, 10, 20) == 1 / 20


def test_mini_warmdown_is_linear_to_zero():
    m = [lr_multiplier(s, 400, 120) for s in range(400)]
    assert m[279] == 1.0 and m[280] == 1.0 and m[399] == pytest.approx(1 / 120)
    diffs = {round(m[s] - m[s + 1], 12) for s in range(280, 399)}
    assert diffs == {round(1 / 120, 12)}


@pytest.mark.parametrize("step,expected", [
    (0, 0.85), (250, 0.90), (499, 0.85 + 0.1 * 499 / 500), (500, 0.95), (6000, 0.95)])
def test_muon_momentum_ramp(step, expected):
    assert muon_momentum(step, 0.85, 0.95, 500) == pytest.approx(expected, abs=1e-12)


def test_muon_momentum_without_warmup():
    assert muon_momentum(0, 0.85, 0.95, 0) == 0.95
