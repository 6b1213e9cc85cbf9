"""Run a list of training configs as subprocesses, reusing finished runs and resuming partial ones.

With `--jobs J` (`run_jobs`) up to J runs train at once, each a separate process with cores / J
torch threads (unless OMP_NUM_THREADS is set) and its output in RUN/worker.log: on a many-core
machine small models train far faster side by side than one after the other on all cores.
Each run's numbers depend only on its config and its thread count, never on the other runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from tngram.common import TngramError, atomic_write_json, print0
from tngram.readback import load_json, read_summary_file
from tngram.train.config import TrainConfig
from tngram.train.signals import ForwardSignals, exit_code, signal_name


@dataclass
class RunSpec:
    label: str  # unique folder name under OUT/runs/
    config: TrainConfig
    tags: dict[str, Any] = field(default_factory=dict)  # method, seed, sweep value...


# `--set` items of `tngram compare` / `python -m research experiment`, applied by run_all to every
# run
_OVERRIDES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "tngram_overrides", default=()
)


@contextlib.contextmanager
def config_overrides(items: list[str] | tuple[str, ...]) -> Iterator[None]:
    """Within the block, run_all applies these `section.field=value` items to every run's config
    (after the experiment's own settings); model.memory.* items skip runs without a memory."""
    token = _OVERRIDES.set(tuple(items))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


# `--jobs` of `tngram compare` / `python -m research experiment`: how many runs run_all trains at
# once
_JOBS: contextvars.ContextVar[int] = contextvars.ContextVar("tngram_jobs", default=1)


@contextlib.contextmanager
def run_jobs(jobs: int) -> Iterator[None]:
    """Within the block, run_all trains up to `jobs` runs at once (see the module docstring)."""
    token = _JOBS.set(max(1, int(jobs)))
    try:
        yield
    finally:
        _JOBS.reset(token)


# what a child run's Ctrl-C / SIGTERM line tells the user (tngram.train.loop reads it): the
# compare / experiment command resumes its interrupted runs by itself and rejects --resume
RESUME_HINT = "run the same command again (it resumes this run from its checkpoint)"


def child_env(jobs: int) -> dict[str, str]:
    """The environment of one child run: the resume hint, and with jobs > 1 its thread count."""
    env = {**os.environ, "TNGRAM_RESUME_HINT": RESUME_HINT}
    if jobs > 1:
        env["OMP_NUM_THREADS"] = job_threads(jobs)
    return env


def job_threads(jobs: int) -> str:
    """OMP_NUM_THREADS for each of `jobs` concurrent runs: the user's setting, else
    cores // jobs."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // jobs))


def check_jobs(jobs: int, nproc: int) -> None:
    """--jobs runs single-process runs side by side; torchrun runs (--nproc > 1) cannot join
    them."""
    if jobs > 1 and nproc > 1:
        raise TngramError(
            f"--jobs {jobs} trains several single-process runs at once; it cannot be "
            f"combined with --nproc {nproc} (torchrun)"
        )


def with_overrides(cfg: TrainConfig, items: tuple[str, ...] | list[str]) -> TrainConfig:
    """`--set` items of compare / experiment applied to one run; on a run without memory the
    memory-only ones (model.memory.* but kind, MEMORY_ONLY_KEYS) are left out, so a setting
    for the memories does not stop the raw baseline."""
    from tngram.train.config import MEMORY_ONLY_KEYS, apply_overrides, split_override

    def memory_only(key: str) -> bool:
        return (key.startswith("model.memory.") and key != "model.memory.kind") or (
            key in MEMORY_ONLY_KEYS
        )

    if cfg.model.memory is None and not any(
        split_override(i)[0] == "model.memory.kind" for i in items
    ):
        items = [i for i in items if not memory_only(split_override(i)[0])]
    return apply_overrides(cfg, list(items))


def _overridden(spec: RunSpec, items: tuple[str, ...]) -> RunSpec:
    """The spec with `--set` items applied. When they change the run's memory family its row is
    reported as what it is: method "raw+memory=tngram", not "raw" (folder and config name stay,
    so finished runs are still found)."""
    from tngram.train.recipes import memory_kind

    cfg = with_overrides(spec.config, items)
    tags = spec.tags
    if "method" in tags and memory_kind(cfg) != memory_kind(spec.config):
        tags = {**tags, "method": f"{tags['method']}+memory={memory_kind(cfg)}"}
    return replace(spec, config=cfg, tags=tags)


def run_dir_of(out: Path, spec: RunSpec) -> Path:
    return out / "runs" / spec.label


def is_complete(run_dir: Path, cfg: TrainConfig) -> bool:
    """Finished (summary.json written) with the same resolved config."""
    summary, config = run_dir / "summary.json", run_dir / "config.json"
    if not (summary.exists() and config.exists()):
        return False
    return _same_config(run_dir, cfg)


def check_same_dataset(run_dir: Path, cfg: TrainConfig) -> None:
    """Refuse a run folder trained on another version of the dataset at cfg's data path (its
    RUN/dataset.json fingerprint differs from the dataset there now, e.g. after a corpus was
    rebuilt with more sources): reusing or resuming it would mix two datasets in one table."""
    from tngram.data.build import default_data_dir
    from tngram.train.portable import read_dataset_record

    want = (read_dataset_record(run_dir) or {}).get("fingerprint")
    data_dir = (
        Path(cfg.data.dir).expanduser() if cfg.data.dir else default_data_dir(cfg.model.vocab_size)
    )
    manifest = data_dir / "manifest.json"
    if not want or not manifest.is_file():
        return  # a run from before dataset records, or no dataset to compare with yet
    have = load_json(manifest, data_dir).get("fingerprint")
    if have != want:
        raise TngramError(
            f"{run_dir} was trained on another version of {data_dir} (dataset fingerprint "
            f"{want[:12]}, now {str(have)[:12]}); remove that folder or choose another --out"
        )


def _normalized(saved: dict) -> dict:
    """A saved config.json as the current code resolves it: fields added since the run was made
    take their defaults (which keep the old behaviour), so finished runs stay reusable."""
    try:
        return json.loads(json.dumps(TrainConfig.from_dict(saved).to_dict()))
    except (TngramError, TypeError, KeyError, ValueError):
        return saved


def launch_command(nproc: int) -> list[str]:
    dist = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, *(dist if nproc > 1 else []), "-m", "tngram.experiments.worker"]


def run_all(specs: list[RunSpec], out: Path, nproc: int = 1) -> list[dict[str, Any]]:
    """Train every spec (in order; up to `run_jobs` at once) and return one row per run, in spec
    order: tags + summary.json. After a failed run no further run starts (runs already training
    finish), then the error names the failed run."""
    if _OVERRIDES.get():
        specs = [_overridden(s, _OVERRIDES.get()) for s in specs]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise TngramError(f"run labels must be unique, got {labels}")
    jobs = _JOBS.get()
    check_jobs(jobs, nproc)
    todo: list[tuple[int, RunSpec, Path]] = []
    for i, spec in enumerate(specs, 1):
        rdir = run_dir_of(out, spec)
        if (rdir / "config.json").exists():
            check_same_dataset(rdir, spec.config)
        if is_complete(rdir, spec.config):
            print0(f"[{i}/{len(specs)}] {spec.label}: finished earlier, reused ({rdir})")
            continue
        if (rdir / "config.json").exists() and not _same_config(rdir, spec.config):
            raise TngramError(
                f"{rdir} holds a run with a different config; choose another --out "
                f"or remove that folder"
            )
        todo.append((i, spec, rdir))
    stop = threading.Event()  # set by the first failure: no further run starts
    clock = RunClock(len(todo), runs=[run_work(spec) for _, spec, _ in todo])
    signals = ForwardSignals()  # SIGTERM / SIGINT: forwarded to the running children, no new run

    def train_one(i: int, spec: RunSpec, rdir: Path) -> str | None:
        if stop.is_set() or signals.signum is not None:
            return None
        err = _train_one(i, spec, rdir, len(specs), nproc, jobs, clock, signals)
        if err:
            stop.set()
        return err

    with signals:
        if jobs > 1 and len(todo) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=jobs) as pool:  # threads only wait on the processes
                errors = list(pool.map(lambda t: train_one(*t), todo))
        else:
            errors = [train_one(i, spec, rdir) for i, spec, rdir in todo]
    if signals.signum is not None:  # the children checkpointed; the same command resumes them
        print(
            f"tngram: stopped by {signal_name(signals.signum)}; finished runs are kept and "
            f"interrupted ones resume from their checkpoint: run the same command again "
            f"(exit {exit_code(signals.signum)})",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(exit_code(signals.signum))
    failed = [e for e in errors if e]
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise TngramError(failed[0] + more)
    rows = []
    for spec in specs:
        rdir = run_dir_of(out, spec)
        summary = read_summary_file(rdir / "summary.json", rdir)
        rows.append({**spec.tags, "label": spec.label, "run_dir": str(rdir), **summary})
    return rows


class RunClock:
    """Elapsed time and ETA of the runs a run_all call trains (reused runs do not count).

    Each run is costed by its work (tokens: steps x global batch) and its family (the compare
    method, e.g. raw / engram / tngram): the runs left take their work x their family's measured
    seconds per token, a family not measured yet the mean over the runs finished. With --jobs J
    the runs overlap: the sum is scaled by elapsed / (the finished runs' own seconds). Without
    `runs` every run is one unit of one family (the mean time per finished run)."""

    def __init__(
        self,
        total: int,
        now: float | None = None,
        runs: list[tuple[str, str, float]] | None = None,  # (label, family, work)
    ) -> None:
        self.total, self.done = total, 0
        self.t0 = time.monotonic() if now is None else now
        self.last = self.t0  # the previous finish (a run's seconds when none are given)
        self.runs = {lab: (fam, float(w)) for lab, fam, w in runs or []}
        self.left = list(self.runs) if runs else [str(i) for i in range(total)]
        if not runs:
            self.runs = {lab: ("", 1.0) for lab in self.left}
        self.took: dict[str, float] = {}  # label -> seconds of a finished run
        self._lock = threading.Lock()

    def eta(self, elapsed: float) -> float:
        """Seconds left for the runs not finished (module docstring); NaN before any finished."""
        done = [(*self.runs[lab], s) for lab, s in self.took.items()]
        if not done or elapsed < 0:
            return float("nan")
        work = sum(w for _, w, _ in done)
        mean = sum(s for *_, s in done) / work if work > 0 else float("nan")
        rate: dict[str, float] = {}
        for fam in {f for f, _, _ in done}:
            w = sum(w for f, w, _ in done if f == fam)
            rate[fam] = sum(s for f, _, s in done if f == fam) / w if w > 0 else mean
        left = sum(w * rate.get(f, mean) for f, w in (self.runs[lab] for lab in self.left))
        own = sum(s for *_, s in done)
        return max(0.0, left * (elapsed / own if own > 0 else 1.0))

    def finished(
        self, now: float | None = None, label: str | None = None, run_s: float | None = None
    ) -> str:
        """Count one finished run (`label`, which took `run_s` seconds; by default the next in
        order, the time since the previous finish); the text for its line, e.g. "1/3 trained,
        1 min 30 s elapsed, about 3 min 00 s left"."""
        from tngram.cpu import fmt_duration

        with self._lock:
            t = time.monotonic() if now is None else now
            self.done += 1
            lab = label if label in self.left else self.left[0]
            self.left.remove(lab)
            self.took[lab] = t - self.last if run_s is None else run_s
            self.last = t
            elapsed = t - self.t0
            text = f"{self.done}/{self.total} trained, {fmt_duration(elapsed)} elapsed"
            if self.left:
                text += f", about {fmt_duration(self.eta(elapsed))} left"
            return text


def run_work(spec: RunSpec) -> tuple[str, str, float]:
    """(label, family, work) of a run for RunClock: family = its method tag (else its memory
    kind), work = the tokens it trains (steps x global batch)."""
    from tngram.train.recipes import memory_kind

    c = spec.config
    fam = str(spec.tags.get("method", memory_kind(c)))
    return spec.label, fam, float(c.schedule.steps * c.data.global_batch_tokens)


def _train_one(
    i: int,
    spec: RunSpec,
    rdir: Path,
    total: int,
    nproc: int,
    jobs: int,
    clock: RunClock | None = None,
    signals: ForwardSignals | None = None,
) -> str | None:
    """Train one run in a subprocess; None when it finished, else the error line. With jobs > 1
    its output goes to RUN/worker.log and it gets job_threads(jobs) threads."""
    run_child = (
        signals.run_child
        if signals is not None  # forwards SIGTERM / SIGINT
        else lambda cmd, **kw: subprocess.run(cmd, **kw).returncode
    )
    rdir.mkdir(parents=True, exist_ok=True)
    cfg_path = rdir / "requested_config.json"
    atomic_write_json(cfg_path, spec.config.to_dict())
    command = launch_command(nproc) + [str(cfg_path), str(rdir)]
    t0 = time.time()
    if jobs > 1:
        log = rdir / "worker.log"
        print0(f"[{i}/{total}] {spec.label}: training ({rdir}; output in {log.name})")
        # O_NOFOLLOW: a linked worker.log is refused, never appended to
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(log, flags, 0o644), "ab") as f:
            code = run_child(command, stdout=f, stderr=subprocess.STDOUT, env=child_env(jobs))
        where = f"its output is in {log}"
    else:
        print0(f"[{i}/{total}] {spec.label}: training ({rdir})")
        code = run_child(command, env=child_env(1))
        where = f"its folder is {rdir}"
    if code != 0:
        return f"run {spec.label} failed (exit {code}); {where}"
    run_s = time.time() - t0
    done = f" ({clock.finished(label=spec.label, run_s=run_s)})" if clock is not None else ""
    print0(f"[{i}/{total}] {spec.label}: done in {run_s:.0f} s{done}")
    return None


def _same_config(rdir: Path, cfg: TrainConfig) -> bool:
    return _normalized(load_json(rdir / "config.json", rdir)) == json.loads(
        json.dumps(cfg.to_dict())
    )
