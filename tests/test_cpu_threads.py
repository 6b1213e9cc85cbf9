"""tngram.cpu: the thread choice from faked machine facts, the cgroup quota reader, and the
duration / ETA helpers of progress lines."""

from __future__ import annotations

import math

import pytest

from test_train_support import one_thread, tiny_data  # noqa: F401

from tngram.cpu import (BUSY_CPUS, CpuFacts, available_cpus, cgroup_quota, choose_threads, eta_seconds,
                        fmt_duration)


def test_idle_machine_keeps_the_default_exactly():
    # nothing else running, no quota: today's default, whatever the default is
    for default in (1, 2, 8, 64):
        c = choose_threads(CpuFacts(affinity=64), default)
        assert (c.threads, c.changed, c.busy, c.reason) == (default, False, False, "")


def test_niced_jobs_and_a_high_load_average_alone_change_nothing():
    # the background sweep of this machine: 2 nice-15 processes (load average ~2): not busy
    c = choose_threads(CpuFacts(affinity=2, others_niced=2.0, loadavg=2.5), 2)
    assert c.threads == 2 and not c.busy and not c.changed


def test_busy_two_cores_give_one_thread_and_say_why():
    c = choose_threads(CpuFacts(affinity=2, others_busy=1.9, loadavg=3.2), 2)
    assert c.threads == 1 and c.busy and c.changed
    assert "1.9 of 2 CPUs" in c.reason and "1 thread instead of 2" in c.reason and "3.20" in c.reason


def test_one_thread_per_free_cpu_never_more_than_the_default():
    # 16 CPUs, others keep 5.5 busy: floor(16 - 5.5) = 10 free
    assert choose_threads(CpuFacts(affinity=16, others_busy=5.5), 16).threads == 10
    # the default (e.g. OMP_NUM_THREADS=4 or a --jobs share) is a ceiling
    assert choose_threads(CpuFacts(affinity=16, others_busy=5.5), 4).threads == 4
    # everything busy: still one thread
    assert choose_threads(CpuFacts(affinity=4, others_busy=7.0), 4).threads == 1


def test_busy_threshold():
    below = choose_threads(CpuFacts(affinity=2, others_busy=BUSY_CPUS - 0.01), 2)
    at = choose_threads(CpuFacts(affinity=2, others_busy=BUSY_CPUS), 2)
    assert (below.threads, below.busy) == (2, False)
    assert (at.threads, at.busy) == (1, True)          # floor(2 - 0.5) = 1


def test_quota_and_affinity_cap_the_threads():
    assert available_cpus(CpuFacts(affinity=8, quota=2.5)) == 2
    assert available_cpus(CpuFacts(affinity=8, quota=0.5)) == 1
    assert available_cpus(CpuFacts(affinity=3, quota=None)) == 3
    c = choose_threads(CpuFacts(affinity=8, quota=2.0), 8)
    assert c.threads == 2 and not c.busy and "quota is 2 CPUs" in c.reason
    # affinity below torch's default (a taskset'd run): the affinity
    assert choose_threads(CpuFacts(affinity=2), 8).threads == 2


def test_cgroup_quota_reader(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(str(v2)) is None
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(str(v2)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_quota(str(v1)) == 3.0
    assert cgroup_quota(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("s, text", [(0, "0 s"), (4.4, "4 s"), (59.4, "59 s"), (59.6, "1 min 00 s"),
                                     (65, "1 min 05 s"), (3599, "59 min 59 s"), (3600, "1 h 00 min"),
                                     (96000, "26 h 40 min"), (-1, "?"), (float("nan"), "?"),
                                     (float("inf"), "?")])
def test_fmt_duration(s, text):
    assert fmt_duration(s) == text


def test_eta_is_the_mean_rate_of_the_finished_part():
    # 3 of 9 runs in 120 s: 40 s each, 6 left -> 240 s
    assert eta_seconds(3, 9, 120.0) == 240.0
    assert eta_seconds(9, 9, 500.0) == 0.0
    assert math.isnan(eta_seconds(0, 9, 10.0))


# --- the trainer acts on the choice -------------------------------------------------------------

def _fake_facts(monkeypatch, others_busy: float) -> None:
    import tngram.cpu
    monkeypatch.setattr(tngram.cpu, "read_cpu_facts",
                        lambda sample_s=0.3: CpuFacts(affinity=2, others_busy=others_busy, loadavg=3.0))


def test_train_on_a_busy_machine_uses_one_thread_and_says_so(tiny_data, tmp_path, monkeypatch, capsys):
    import json

    import torch

    from test_train_support import tiny_config
    from tngram.train.loop import train
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _fake_facts(monkeypatch, 2.0)
    torch.set_num_threads(2)                  # the default of a 2-core machine (one_thread restores 1)
    train(tiny_config(tiny_data, extra=["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"]),
          tmp_path / "run", progress=False)
    out = capsys.readouterr().out
    assert "tngram: note: the CPUs are busy (other jobs kept 2.0 of 2 CPUs busy" in out
    assert "training with 1 thread instead of 2" in out
    assert json.loads((tmp_path / "run" / "env.json").read_text())["torch_threads"] == 1
    assert torch.get_num_threads() == 2       # restored after the run


def test_idle_machine_omp_setting_or_cuda_change_nothing(monkeypatch, capsys):
    from types import SimpleNamespace

    import torch

    from tngram.train.loop import _choose_threads
    cpu = SimpleNamespace(device=torch.device("cpu"), is_main=True, world_size=1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _fake_facts(monkeypatch, 0.1)             # idle
    torch.set_num_threads(2)
    watch = _choose_threads(cpu, 2)
    assert watch is not None and watch.threads == 2 and not watch.done    # watching for a later job
    assert torch.get_num_threads() == 2
    _fake_facts(monkeypatch, 2.0)             # busy, but the user set OMP_NUM_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _choose_threads(cpu, 2) is None          # the user chose: no watch either
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _choose_threads(SimpleNamespace(device=torch.device("cuda"), is_main=True, world_size=1), 2) is None
    assert torch.get_num_threads() == 2 and capsys.readouterr().out == ""


def test_contention_summary_and_its_docs_table():
    from research.bench.contention import background_note, summarize
    from research.report.bench_blocks import render_contention
    tps = {"idle:default": [100.0, 120.0, 110.0], "idle:1": [60.0, 66.0, 63.0], "idle:auto": [118.0, 90.0, 112.0],
           "busy:default": [10.0, 30.0, 20.0], "busy:1": [44.0, 40.0, 48.0], "busy:auto": [41.0, 50.0, 45.0]}
    med, rel = summarize(tps)
    assert med == {"idle:default": 110.0, "idle:1": 63.0, "idle:auto": 112.0, "busy:default": 20.0,
                   "busy:1": 44.0, "busy:auto": 45.0}
    assert rel["busy:auto"] == 45.0 / 110.0 and rel["idle:default"] == 1.0
    quiet = {"others_busy": 0.02, "others_niced": 0.0}
    assert background_note(quiet, quiet) == ""
    res = {"median_tokens_per_s": med, "vs_idle_default": rel, "auto_chose": {"idle": [2, 2, 2], "busy": [1, 1, 1]},
           "default_threads": 2, "recipe": "mini-tngram", "steps_per_rep": 2, "tokens_per_step": 4096, "reps": 3,
           "background": background_note(quiet, {"others_busy": 1.24, "others_niced": 0.0})}
    table = render_contention(res, "table")
    assert "| competitor stopped | torch's default (2) | 110 | 1.00 |" in table
    assert "| | automatic (chose 2) | 112 | 1.02 |" in table
    assert "| beside a 2-thread torch job | torch's default (2) | 20 | 0.18 |" in table
    assert "| | automatic (chose 1) | 45 | 0.41 |" in table
    assert "other jobs at normal priority kept up to 1.2 CPUs busy — not an idle machine" in table


def test_step_watch_backs_off_once_when_steps_collapse_beside_busy_jobs():
    from tngram.cpu import StepWatch
    busy = CpuFacts(affinity=2, others_busy=2.0)
    calls = []

    def facts():
        calls.append(1)
        return busy

    w = StepWatch(2, window=4, factor=2.0, facts=facts)
    assert [w.add(s) for s in (0.5, 0.3, 0.3, 0.31)] == [None] * 4       # first window: best 0.31 (median)
    assert [w.add(s) for s in (0.5, 0.55, 0.6, 0.58)] == [None] * 4      # 0.58 < 2 x 0.31: no sample
    assert calls == [] and w.best == 0.31
    out = [w.add(s) for s in (3.0, 2.9, 3.1, 3.2)]                      # median 3.1 >= 2 x 0.31
    assert out[:3] == [None] * 3 and out[3].threads == 1 and len(calls) == 1
    assert w.last == 3.1 and w.add(5.0) is None and w.done               # once only


def test_step_watch_leaves_a_slow_but_unshared_machine_alone():
    from tngram.cpu import StepWatch
    w = StepWatch(2, window=2, factor=2.0, facts=lambda: CpuFacts(affinity=2, others_busy=0.1))
    for s in (0.3, 0.3, 1.0, 1.0, 1.0, 1.0):
        assert w.add(s) is None
    assert not w.done and w.best == 0.3
    assert StepWatch(1).done          # one thread: nothing to back off to


def test_trainer_backs_off_when_its_watch_says_so(tiny_data, tmp_path, monkeypatch, capsys):
    import torch

    import tngram.train.loop as loop
    from test_train_support import tiny_config
    from tngram.cpu import StepWatch, ThreadChoice
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _fake_facts(monkeypatch, 0.0)               # idle at start: 2 threads and a watch
    seen = []

    class Watch(StepWatch):                     # collapses after the 2nd step
        def add(self, seconds):
            seen.append(torch.get_num_threads())
            if len(seen) == 2:
                self.best, self.last = 0.1, 0.5
                return ThreadChoice(1, 2, True, "the CPUs are busy (test): training with 1 thread instead of 2")
            return None

    monkeypatch.setattr(loop, "StepWatch", Watch)
    torch.set_num_threads(2)
    loop.train(tiny_config(tiny_data, extra=["schedule.steps=4", "run.val_every=0", "run.checkpoint_every=0"]),
               tmp_path / "run", progress=False)
    assert seen == [2, 2, 1, 1]                 # steps 3 and 4 ran with 1 thread
    out = capsys.readouterr().out
    assert ("tngram: note: step 2: steps took 0.50 s (median of 10), 5.0x the best 0.10 s; the CPUs are "
            "busy (test): continuing with 1 thread instead of 2") in out
    assert torch.get_num_threads() == 2         # restored after the run


def test_read_cpu_facts_on_this_machine():
    import os

    from tngram.cpu import read_cpu_facts
    f = read_cpu_facts(0.05)
    assert f.affinity == len(os.sched_getaffinity(0)) and f.sample_s == 0.05
    # busy CPUs are a share of the machine's CPUs over the sample (our own sleep excluded)
    assert 0.0 <= f.others_busy <= (os.cpu_count() or 1) + 0.5
    assert 0.0 <= f.others_niced <= (os.cpu_count() or 1) + 0.5
