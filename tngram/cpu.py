"""How many CPU threads a run should use, decided at start from what the machine is doing.

Torch runs one OpenMP thread per core and its threads spin while they wait for each other. When
another CPU-bound job shares the cores, a spinning thread waits for a thread that is not
scheduled, and a 2-thread run on 2 cores drops to 0.1-0.3x its idle speed (docs/TRAINING.md,
"Threads on a busy machine"; research/PERFORMANCE.md, "Training beside another job"). Fewer
threads than busy cores do not collapse. So, when nobody asked for a thread count, a run looks at

  - the CPUs it may run on (sched affinity) and its cgroup CPU quota (cgroup v2 cpu.max or v1
    cpu.cfs_quota_us / cpu.cfs_period_us),
  - the CPUs other processes at normal priority kept busy during a short sample of /proc/stat
    (user + system + irq + softirq + steal time; CPU time of niced processes is counted apart:
    the scheduler gives a nice-0 thread ~28x the share of a nice-15 one, so niced jobs do not
    make the threads wait),

and keeps torch's default unless those say the threads would wait (`choose_threads`, a pure
function of those facts). On an idle machine the choice is always torch's default, so the
default behaviour and its numbers are unchanged. The 1-minute load average is recorded for the
message but not used: it lags by minutes (a job that ended a minute ago still shows).

`fmt_duration` and `eta_seconds` (elapsed / remaining time of a run or a list of runs) live here
too: small pure helpers for every progress line.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BUSY_CPUS = 0.5  # other jobs keeping at least this many CPUs busy make the machine "busy"


@dataclass(frozen=True)
class CpuFacts:
    """What the thread choice looks at (all read by `read_cpu_facts`, or faked in tests)."""

    affinity: int  # CPUs this process may run on
    quota: float | None = None  # cgroup CPU quota in CPUs (None: no quota)
    others_busy: float = 0.0  # CPUs kept busy by other processes at normal priority
    others_niced: float = 0.0  # CPUs kept busy by niced (nice > 0) processes
    loadavg: float | None = None  # 1-minute load average (reported, not used)
    sample_s: float = 0.0  # length of the /proc/stat sample


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch threads to use
    default: int  # what the run would have used without the choice
    busy: bool  # other jobs compete for the CPUs
    reason: str  # one line for the user ("" when nothing changed)
    facts: CpuFacts | None = field(default=None, compare=False)

    @property
    def changed(self) -> bool:
        return self.threads != self.default


def available_cpus(facts: CpuFacts) -> int:
    """CPUs the run may use: the affinity, capped by the cgroup quota (rounded down, >= 1)."""
    n = max(1, facts.affinity)
    if facts.quota is not None and facts.quota > 0:
        n = min(n, max(1, int(math.floor(facts.quota + 1e-9))))
    return n


def choose_threads(facts: CpuFacts, default: int, doing: str = "training") -> ThreadChoice:
    """The torch thread count for a run whose default (torch's, or what the caller already set)
    is `default`: never more than it; fewer when the quota caps the CPUs or when other jobs at
    normal priority keep at least BUSY_CPUS of them busy (then one thread per CPU they leave
    free, at least 1). Idle and unlimited: `default`, unchanged."""
    default = max(1, int(default))
    cpus = available_cpus(facts)
    busy = facts.others_busy >= BUSY_CPUS
    free = cpus - facts.others_busy if busy else cpus
    threads = max(1, min(default, cpus, int(math.floor(free + 1e-9))))
    if threads == default:
        return ThreadChoice(threads, default, busy, "", facts)
    if busy:
        why = (
            f"the CPUs are busy (other jobs kept {facts.others_busy:.1f} of {cpus} CPUs busy"
            + (f", load average {facts.loadavg:.2f}" if facts.loadavg is not None else "")
            + ")"
        )
    elif facts.quota is not None and available_cpus(facts) < facts.affinity:
        why = f"the cgroup CPU quota is {facts.quota:g} CPUs"
    else:
        why = f"this process may run on {facts.affinity} CPUs (sched affinity)"
    return ThreadChoice(
        threads,
        default,
        busy,
        f"{why}: {doing} with {threads} thread{'s' if threads > 1 else ''} instead of "
        f"{default} (spinning threads collapse beside other jobs; --threads N chooses)",
        facts,
    )


# --- reading the facts (Linux; elsewhere: affinity = os.cpu_count(), nothing busy) --------------


def cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The cgroup CPU quota in CPUs, or None (no quota, or not readable)."""
    try:
        quota, period = open(os.path.join(root, "cpu.max")).read().split()[:2]  # cgroup v2
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int(open(os.path.join(root, "cpu", "cpu.cfs_quota_us")).read())  # cgroup v1
        p = int(open(os.path.join(root, "cpu", "cpu.cfs_period_us")).read())
        return None if q <= 0 or p <= 0 else q / p
    except (OSError, ValueError):
        return None


def _proc_stat() -> tuple[float, float] | None:
    """(normal-priority busy ticks, niced busy ticks) summed over all CPUs."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return float(user + system + irq + softirq + steal), float(nice)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def read_cpu_facts(sample_s: float = 0.3) -> CpuFacts:
    """The facts of this machine now; `sample_s` of /proc/stat (this process's own CPU time in
    the window is subtracted)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    busy = niced = 0.0
    a, own0, t0 = _proc_stat(), _own_cpu_s(), time.monotonic()
    if a is not None and sample_s > 0:
        time.sleep(sample_s)
        b, own1, t1 = _proc_stat(), _own_cpu_s(), time.monotonic()
        if b is not None:
            hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
            dt = max(1e-6, t1 - t0)
            own = (own1 - own0) if os.nice(0) == 0 else 0.0
            busy = max(0.0, (b[0] - a[0]) / hz / dt - own / dt)
            niced = max(
                0.0, (b[1] - a[1]) / hz / dt - (0.0 if os.nice(0) == 0 else (own1 - own0) / dt)
            )
    return CpuFacts(
        affinity=affinity,
        quota=cgroup_quota(),
        others_busy=round(busy, 2),
        others_niced=round(niced, 2),
        loadavg=load,
        sample_s=sample_s,
    )


def auto_threads(default: int, sample_s: float = 0.3, doing: str = "training") -> ThreadChoice:
    """choose_threads on this machine's facts; no sample (and no change) when `default` is 1."""
    if default <= 1:
        return ThreadChoice(max(1, default), max(1, default), False, "")
    return choose_threads(read_cpu_facts(sample_s), default, doing)


def _n_threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def thread_rule(
    requested: int,
    device_type: str,
    default: int,
    doing: str = "training",
    choose: Callable[[int], ThreadChoice] | None = None,
    omp: str | None = None,
) -> tuple[int, str]:
    """The thread rule of every command that computes (`tngram train`'s): (torch threads to use,
    one line saying what was chosen and why). `requested` > 0 (--threads N / run.threads=N):
    that many. Otherwise torch's `default` (OMP_NUM_THREADS when `omp` is set, else all cores),
    fewer on the CPU when other jobs keep the CPUs busy or a quota caps them (`choose`, default
    auto_threads: a /proc/stat sample). Pure given `choose`."""
    if requested > 0:
        return requested, f"{_n_threads(requested)} (--threads {requested})"
    if device_type != "cpu":
        return (
            default,
            f"{_n_threads(default)} on the host ({device_type} computes; --threads N chooses)",
        )
    if omp:
        return default, f"{_n_threads(default)} (OMP_NUM_THREADS={omp}; --threads N chooses)"
    choice = (choose or (lambda d: auto_threads(d, doing=doing)))(default)
    if choice.changed:
        return choice.threads, choice.reason
    f = choice.facts
    why = "torch's default"
    if f is not None:  # niced jobs do not make the threads wait (module docstring)
        why += (
            f": other jobs at normal priority kept {f.others_busy:.1f} of {available_cpus(f)} "
            f"CPUs busy, niced ones {f.others_niced:.1f}"
            + (f"; load average {f.loadavg:.2f}" if f.loadavg is not None else "")
        )
    return choice.threads, f"{_n_threads(choice.threads)} ({why}; --threads N chooses)"


class StepWatch:
    """Backing off mid-run, for a job that starts after the run did: feed each optimiser step's
    wall time. Every `window` steps the window's median is compared with the best window median
    so far; when it is at least `factor` times slower (the steps collapsed) and other jobs keep
    the CPUs busy now (a fresh `facts()` sample), `add` returns the choose_threads decision, once;
    then it stops watching. Slow steps on a machine nobody else uses change nothing."""

    def __init__(
        self,
        threads: int,
        window: int = 10,
        factor: float = 2.0,
        facts: Callable[[], CpuFacts] | None = None,
    ) -> None:
        self.threads, self.window, self.factor = threads, window, factor
        self.facts = facts or read_cpu_facts
        self.buf: list[float] = []
        self.best: float | None = None
        self.last: float | None = None
        self.done = threads <= 1

    def add(self, seconds: float) -> ThreadChoice | None:
        if self.done:
            return None
        self.buf.append(seconds)
        if len(self.buf) < self.window:
            return None
        med = sorted(self.buf)[len(self.buf) // 2]
        self.buf.clear()
        self.last = med
        if self.best is None or med < self.best:
            self.best = med
            return None
        if med < self.factor * self.best:
            return None
        choice = choose_threads(self.facts(), self.threads)
        if not choice.changed:
            return None
        self.done = True
        return choice


# --- time -----------------------------------------------------------------------------------------


def fmt_duration(seconds: float) -> str:
    """4 s, 59 s, 1 min 05 s, 59 min 59 s, 1 h 00 min, 26 h 40 min ("?" for NaN/inf/negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def eta_seconds(done: float, total: float, elapsed: float) -> float:
    """Remaining time if the rest goes at the mean rate so far: elapsed / done * (total - done);
    NaN before anything is done."""
    if done <= 0 or elapsed < 0:
        return float("nan")
    return max(0.0, elapsed / done * max(0.0, total - done))
