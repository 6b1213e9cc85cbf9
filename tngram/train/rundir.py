"""Claiming a run folder before any work: a folder (not a file), writable, ours, locked, clean.

`claim_run_dir` is what `train` calls first (on the main process, before data or model):

  * `--out` must be a folder or not exist yet; a file is refused;
  * the folder is locked (tngram.train.runlock): a second writer fails at once, naming the holder;
  * a non-empty folder must be a run of the same recipe (its config.json names it) — anything
    else (another recipe, a dataset, your home folder) is refused, nothing in it is touched
    (log/text files such as a redirected `train.log` do not count);
  * torn temporaries of a killed or failed writer are removed (checkpoints/.tmp-step_*, .*.tmp).

`claim_output_file` is the same for a single result file (`eval ... --out PATH`): its folder
must be writable before the evaluation starts, and when the file goes into a run folder that
run is locked for the duration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tngram.common import TngramError, check_writable_dir
from tngram.safefs import check_chain, is_link, write_json
from tngram.train.runlock import LOCK_FILE, RunLock

# what a run folder may hold besides its own records (so a crashed fresh run can be restarted)
_RUN_ENTRIES = {
    "config.json",
    "env.json",
    "metrics.jsonl",
    "summary.json",
    "model.safetensors",
    "checkpoints",
    "eval",
    "tb",
    "wandb",
    "wandb_id",
    "tokenizer.model",
    "dataset.json",
    "requested_config.json",
    LOCK_FILE,
}
# a user's own notes / redirected output (`> DIR/train.log`) never make a folder "not a run"
_NOTE_SUFFIXES = (".log", ".out", ".txt", ".md")


def claim_run_dir(run_dir: Path, recipe: str, resume: bool, what: str = "train") -> RunLock:
    """Check and lock `run_dir` for a run of `recipe` (see the module doc); returns the held
    lock."""
    from tngram.train.checkpoint import read_run_config, remove_torn_temps

    check_writable_dir(run_dir, "--out")
    existed = run_dir.exists()
    lock = RunLock(run_dir, what).acquire()
    try:
        lock.created = not existed
        links = sorted(n for n in _RUN_ENTRIES if n != LOCK_FILE and is_link(run_dir / n))
        if links:  # a received run folder must not lead a write (or a retention) outside it
            raise TngramError(
                f"--out {run_dir}: {', '.join(links)} "
                f"{'is a symbolic link' if len(links) == 1 else 'are symbolic links'}; "
                f"tngram never follows links in a run folder: replace them with real files/folders"
            )
        entries = {
            p.name
            for p in run_dir.iterdir()
            # requested_config.json: written by the compare/experiment runner before it trains
            if p.name not in (LOCK_FILE, "requested_config.json")
            and not (p.is_file() and p.name.endswith(_NOTE_SUFFIXES))
        }
        if entries:
            if "config.json" not in entries:
                raise TngramError(
                    f"--out {run_dir} is not empty and is not a tngram run (no config.json); "
                    f"choose an empty or new folder"
                )
            saved = read_run_config(run_dir)["name"]
            if saved != recipe:
                raise TngramError(
                    f"--out {run_dir} holds a run of recipe {saved!r}, not {recipe!r}; "
                    f"choose another folder"
                )
            strange = sorted(e for e in entries if e not in _RUN_ENTRIES and not e.startswith("."))
            if strange:
                raise TngramError(
                    f"--out {run_dir} holds files that are not part of a run "
                    f"({', '.join(strange[:5])}); choose another folder"
                )
        remove_torn_temps(run_dir)
    except BaseException:
        if lock.created_file:  # leave a folder we refused exactly as we found it
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
        release_run_dir(lock)
        raise
    return lock


def inside_lexically(path: Path, folder: Path) -> bool:
    """`path` names a location inside `folder` (by its components, not following links)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    return rel != ".." and not rel.startswith(".." + os.sep)


def write_result(path: Path, obj: Any, run_dir: Path | None) -> None:
    """Write a result JSON: a new file renamed into place; inside `run_dir` never through a link."""
    root = run_dir if run_dir is not None and inside_lexically(path, run_dir) else None
    write_json(path, obj, root)


def release_run_dir(lock: RunLock) -> None:
    """Release the lock; a folder this run created and left holding only the lock file goes too."""
    run_dir = lock.run_dir
    lock.release()
    if getattr(lock, "created", False):
        try:
            if {p.name for p in run_dir.iterdir()} == {LOCK_FILE}:
                (run_dir / LOCK_FILE).unlink()
                run_dir.rmdir()
        except OSError:
            pass


def claim_output_file(path: Path, run_dir: Path | None, what: str) -> RunLock | None:
    """Before an evaluation: `path`'s folder must be writable; if `path` lies inside `run_dir`,
    lock that run (returned; release it when done). TngramError otherwise."""
    if path.exists() and path.is_dir():
        raise TngramError(f"--out {path} is a folder, expected a file path")
    if run_dir is not None and inside_lexically(path, run_dir):
        check_chain(run_dir, path)  # RUN/eval as a link would write outside the run
    check_writable_dir(path.parent, "--out")
    if run_dir is not None:
        if not inside_lexically(path, run_dir):
            try:
                path.resolve().relative_to(run_dir.resolve())
            except ValueError:
                return None
        try:
            return RunLock(run_dir, what).acquire()
        except TngramError as e:
            raise TngramError(f"{e}, or write the result elsewhere with --out PATH") from None
    return None
