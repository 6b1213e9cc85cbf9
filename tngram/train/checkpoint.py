"""Checkpoints without pickle: safetensors for tensors, JSON for everything else.

Layout of a run folder:

    DIR/config.json                    resolved TrainConfig (cfg.to_dict())
    DIR/checkpoints/step_000500/       one folder per checkpoint, renamed into place when complete
        model.safetensors              model state_dict (metadata: step)
        state.safetensors              optimiser state tensors + RNG states (torch uint8)
        meta.json                      step, token/time counters, loader state, optimiser
                                       param groups and non-tensor state, world size
        manifest.json                  size and sha256 of the three files above, written last
    DIR/model.safetensors              final weights (metadata: step), written at the end

An FSDP-sharded run (> 1 process) writes its checkpoints through torch.distributed.checkpoint
instead: the same folder plus dcp/ (each process's shards; tngram.train.sharded_checkpoint),
state.safetensors then holds only the RNG state, and the manifest lists the dcp/ files too.

A checkpoint is written into a hidden temporary folder (every file fsync'ed, manifest.json
last) and renamed to step_NNNNNN only when complete, so a process killed at any moment leaves
either the previous set of checkpoints or the new one; leftover temporary folders are removed
at the next start and when a save fails. A checkpoint is verified as a unit against its
manifest before it is used: `--resume` takes the newest checkpoint that verifies and says
which newer ones it skipped and why. Only the last `keep` checkpoints are kept. Before writing,
the free space is checked against the checkpoint's size; a full disk gives one line with the
size needed. Loading never unpickles: safetensors holds only raw tensors, JSON only plain data;
a corrupt, truncated or mismatched file is one TngramError naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save
from torch import nn

from tngram.common import MissingFileError, TngramError, json_text
from tngram.memory import memory_dict_now
from tngram.model.gpt import GPT
from tngram.readback import load_json, plain_name
from tngram.safefs import (
    is_link,
    make_dirs,
    open_fd,
    real_dir,
    remove_tree,
    write_bytes,
    write_json,
)
from tngram.train.ckpt_files import (
    file_sha256,
    load_checkpoint_json,
    load_tensors,
    safetensors_shapes,
    sha256_hex,
    short_error,
    model_tensors,
)
from tngram.train.optim_check import check_checkpoint_meta
from tngram.train.optim_state import (
    load_optimizer_checked,
    optimizer_to_flat,
    restore_rng_checked,
    rng_tensors,
)

# the run folder's names and the checkpoint listing live in runfiles (below config), the weights
# files in weights: their names are kept importable from here
from tngram.train.runfiles import (  # noqa: F401
    CKPT_DIR,
    FINAL_WEIGHTS,
    checkpoint_step,
    has_checkpoint,
    latest_checkpoint,
    list_checkpoints,
)
from tngram.train.saved import config_from_saved
from tngram.train.weights import (  # noqa: F401  (final_problem .. resume_suspect: the trainer's)
    weights_step,
    check_final,
    check_finite_model,
    final_problem,
    load_weights,
    recorded_config,
    refuse_final,
    resume_suspect,
    verify_weights_file,
    weights_with_digest,
)

MANIFEST = "manifest.json"
CKPT_FILES = ("model.safetensors", "state.safetensors", "meta.json")
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint files (FSDP, > 1 process)


# ---- writing helpers


def write_file(path: Path, data: bytes) -> None:
    """A new file (O_EXCL | O_NOFOLLOW: never an existing file or a link's target)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


class DiskFull(TngramError):
    """Not enough free space for an output (raised before writing when we can tell)."""


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """TngramError if `folder`'s filesystem has fewer than `needed` bytes free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed:
        raise DiskFull(
            f"not enough disk space for {what} in {folder}: it needs {_mib(needed)}, "
            f"{_mib(free)} free; free some space or choose another --out"
        )


# ---- save / load


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    meta: dict[str, Any],
    keep: int,
) -> Path:
    """Write DIR/checkpoints/step_NNNNNN atomically, then delete all but the newest `keep`.

    The files are serialised in memory first, so their exact size is known: the free space is
    checked before anything is written, and a write that still fails (disk full, I/O error)
    removes the temporary folder and raises one TngramError saying how much space is needed.
    """
    root = make_dirs(run_dir, Path(run_dir) / CKPT_DIR)  # a linked checkpoints/ is refused
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    state: dict[str, torch.Tensor] = rng_tensors()
    opt_info = {}
    for name, opt in optimizers.items():
        t, info = optimizer_to_flat(name, opt)
        state.update(t)
        opt_info[name] = info
    blobs = {
        "model.safetensors": save(model_tensors(model), metadata={"step": str(step)}),
        "state.safetensors": save(state, metadata={"step": str(step)}),
        "meta.json": (
            json_text({**meta, "step": step, "optimizers": opt_info}, indent=1) + "\n"
        ).encode(),
    }
    manifest = {
        "step": step,
        "files": {n: {"size": len(b), "sha256": sha256_hex(b)} for n, b in blobs.items()},
    }
    needed = sum(len(b) for b in blobs.values()) + 4096
    check_free_space(root, needed, f"checkpoint step_{step:06d}")
    try:
        if os.path.lexists(tmp):
            if not remove_tree(tmp):  # a file or a link in its place
                os.unlink(tmp)
        tmp.mkdir()
        for name, data in blobs.items():
            write_file(tmp / name, data)
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())  # last
        fsync_dir(tmp)
        if os.path.lexists(final):  # re-saving the same step (a resumed run that was complete)
            if not remove_tree(final):  # a file or a link in its place
                os.unlink(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except OSError as e:
        remove_tree(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"disk full while writing checkpoint step_{step:06d} to {root}: a checkpoint "
                f"needs {_mib(needed)}; the torn copy was removed and the previous "
                f"checkpoints are intact; free some space and --resume"
            ) from None
        raise TngramError(
            f"cannot write checkpoint step_{step:06d} to {root}: {e.strerror or e}"
        ) from None
    for old in list_checkpoints(run_dir)[:-keep]:  # only our own step_* folders, never a link
        remove_tree(old, run_dir)
    remove_torn_temps(run_dir)
    return final


def remove_torn_temps(run_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary files/folders that a killed or failed writer left in a run folder:
    checkpoints/.tmp-step_* and the `.NAME.*.tmp` files of atomic writes (in DIR and DIR/eval).
    Only call this while holding the run's lock (another writer's temporaries would go too)."""
    run_dir = Path(run_dir)
    gone = []
    for sub, pattern in (("", ".*.tmp"), (CKPT_DIR, ".tmp-step_*"), ("eval", ".*.tmp")):
        folder = run_dir / sub
        if sub and (is_link(folder) or not real_dir(folder)):
            continue  # never look through a linked folder
        for p in folder.glob(pattern):
            if is_link(p) or not real_dir(p):
                p.unlink(missing_ok=True)  # a file, or a link itself (never its target)
            else:
                remove_tree(p)
            gone.append(p)
    return gone


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- verification


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint folder verifies, else the reason (one short phrase naming the file).

    With manifest.json: every listed file exists with the recorded size and sha256; a sharded
    checkpoint's manifest also lists its dcp/ files ("shards"), and dcp/ must hold exactly those
    (the shard reader reads every file there). Older checkpoints without a manifest are accepted
    if meta.json parses and both safetensors headers read (their payloads cannot be checked)."""
    path = Path(path)
    mpath = path / MANIFEST
    if os.path.lexists(mpath):
        try:
            manifest = load_json(mpath, limit=1 << 20)
            files, shards = manifest["files"], manifest.get("shards", {})
            assert isinstance(files, dict) and set(files) >= set(CKPT_FILES)
            assert isinstance(shards, dict)
            assert all(isinstance(r, dict) for r in [*files.values(), *shards.values()])
            for name in [*files, *shards]:
                plain_name(name, str(mpath), "a file name")
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            return f"{MANIFEST} is corrupt"
        checks = [(path / n, n, r) for n, r in files.items()]
        if "shards" in manifest or os.path.lexists(path / DCP_DIR):
            folder = path / DCP_DIR
            if is_link(folder) or not real_dir(folder):
                return f"{DCP_DIR}/ is missing or not a folder"
            present = set(os.listdir(folder))
            if present != set(shards):
                odd = sorted(present ^ set(shards))[0]
                return f"{DCP_DIR}/{odd} is " + (
                    "not in the manifest" if odd in present else "missing"
                )
            checks += [(folder / n, f"{DCP_DIR}/{n}", r) for n, r in shards.items()]
        for f, name, rec in checks:
            try:
                size = os.fstat(fd := open_fd(f)).st_size
                os.close(fd)
            except (OSError, TngramError) as e:
                return f"{name} is missing" if isinstance(e, FileNotFoundError) else short_error(e)
            if size != rec.get("size"):
                return (
                    f"{name} has {size} bytes, the manifest says {rec.get('size')} "
                    f"(truncated or replaced)"
                )
            if file_sha256(f) != rec.get("sha256"):
                return f"{name} does not match its sha256 in the manifest (corrupt)"
        return None
    if os.path.lexists(path / DCP_DIR):
        return f"{MANIFEST} is missing (a sharded checkpoint is always written with one)"
    for name in CKPT_FILES:
        if not os.path.lexists(path / name):
            return f"{name} is missing (no {MANIFEST}: an incomplete or older checkpoint)"
    try:
        load_json(path / "meta.json")
    except (OSError, ValueError):
        return "meta.json is corrupt"
    for name in ("model.safetensors", "state.safetensors"):
        try:
            safetensors_shapes(path / name)
        except TngramError as e:
            return str(e).split(": ", 1)[-1]
    return None


def newest_good_checkpoint(
    run_dir: str | os.PathLike, say: Callable[[str], None] | None = None
) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is reported via `say`."""
    for p in reversed(list_checkpoints(run_dir)):
        reason = verify_checkpoint(p)
        if reason is None:
            return p
        if say is not None:
            say(f"tngram: skipping checkpoint {p.name}: {reason}")
    return None


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The meta.json of checkpoint folder `path` (step, tokens, times, loader state, config)."""
    file = Path(path) / "meta.json"
    return check_checkpoint_meta(load_checkpoint_json(file), file)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng_state: bool = True,
) -> dict[str, Any]:
    """Restore weights (and optimisers, RNG) from a checkpoint folder; returns its meta.json.
    Every problem is a TngramError naming the file."""
    path = Path(path)
    meta = check_checkpoint_meta(load_checkpoint_json(path / "meta.json"), path / "meta.json")
    # tensors read by tngram.readback.tensors: every float tensor finite (a checkpoint without a
    # manifest cannot be verified byte for byte: its values are checked)
    load_weights(model, path / "model.safetensors", (optimizers or {}).values())
    if optimizers:
        state = load_tensors(path / "state.safetensors")
        for name, opt in optimizers.items():
            if name not in meta.get("optimizers", {}):
                raise TngramError(f"checkpoint {path} has no state for optimiser {name!r}")
            load_optimizer_checked(
                path / "state.safetensors",
                name,
                opt,
                state,
                meta["optimizers"][name],
                meta.get("step"),
            )
        if restore_rng_state:
            restore_rng_checked(path, state)
    return meta


def save_final_weights(
    run_dir: str | os.PathLike, model: nn.Module, step: int, config: dict[str, Any] | None = None
) -> Path:
    """DIR/model.safetensors with its payload digest and `config` (the run's) in its header."""
    path = Path(run_dir) / FINAL_WEIGHTS
    data = weights_with_digest(model_tensors(model), step, config)
    check_free_space(path.parent, len(data) + 4096, "the final weights")
    try:
        write_bytes(path, data, run_dir)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"disk full while writing {path}: the final weights need {_mib(len(data))}; "
                f"the checkpoints are intact, free some space and --resume"
            ) from None
        raise TngramError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def save_run_config(run_dir: str | os.PathLike, cfg_dict: dict[str, Any]) -> None:
    write_json(Path(run_dir) / "config.json", cfg_dict, run_dir)


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """DIR/config.json as a dict; TngramError naming the file if missing or corrupt."""
    path = Path(run_dir) / "config.json"
    if not os.path.lexists(path):
        raise MissingFileError(f"{run_dir} is not a run folder (no config.json)")
    d = load_checkpoint_json(path)
    if (
        not isinstance(d, dict)
        or not isinstance(d.get("name"), str)
        or not isinstance(d.get("model"), dict)
    ):
        raise TngramError(f"{path}: not a tngram run config (no name/model)")
    return d


# run.* fields that may change between an interrupted run and its resumption (they change how
# a run is driven, not what its weights compute)
RESUMABLE_RUN_FIELDS = (
    "compile",  # how the forward runs, not what it computes
    "log_every",
    "val_every",
    "checkpoint_every",
    "keep_checkpoints",
    "threads",
    "parallel",
    "sdpa",  # which attention kernel computes the same attention
)


def config_differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted field, value in a, value in b) for every leaf where two config dicts differ
    (run.RESUMABLE_RUN_FIELDS and tokenizer_path left out; model.memory compared as today's
    code writes it, so a TN-gram variant saved as kind tngram equals its tngram-variant)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if prefix == "model.memory.":
            a, b = memory_dict_now(a), memory_dict_now(b)
        out = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{prefix}{k}"
            if key in {f"run.{f}" for f in RESUMABLE_RUN_FIELDS} or k == "tokenizer_path":
                continue  # (a file's place, not what the weights compute)
            out += config_differences(a.get(k, "(missing)"), b.get(k, "(missing)"), key + ".")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def check_recorded_config(cfg: dict[str, Any], recorded: Any, where: str, rec_where: str) -> None:
    """A run's config.json must say what its weights were trained with (the model section
    recorded beside them): an edit that keeps every shape (e.g. product keys' topk) would
    otherwise compute other numbers, and `export` would sign it. Paths (data.dir, a memory's
    tokenizer_path) and the training settings may change: they do not change the weights."""
    if not isinstance(recorded, dict):
        raise TngramError(f"{rec_where}: field config must be an object")
    diffs = config_differences(cfg.get("model"), recorded.get("model"), "model.")
    if diffs:
        key, now, then = diffs[0]
        more = f" (and {len(diffs) - 1} more field(s))" if len(diffs) > 1 else ""
        raise TngramError(
            f"{where}: field {key} is {now!r:.60} but the weights were trained with {then!r:.60} "
            f"({rec_where}){more}; config.json was edited after training: restore it"
        )


def load_run_model(
    run_dir: str | Path, device: str = "cpu", say: Callable[[str], None] | None = None
) -> tuple[GPT, dict]:
    """The trained model of a run folder (eval mode, on `device`) and its resolved config dict.

    Weights come from whichever is newer: the final weights DIR/model.safetensors or the newest
    checkpoint that verifies (a run still going, or interrupted, has only checkpoints).
    """
    run_dir = Path(run_dir)
    cfg_dict = read_run_config(run_dir)
    cfg = config_from_saved(cfg_dict, str(run_dir / "config.json"))  # before anything is allocated
    candidates = []
    final = run_dir / FINAL_WEIGHTS
    if os.path.lexists(final):
        candidates.append((weights_step(final), 1, final))
    ckpt = newest_good_checkpoint(run_dir, say)
    if ckpt is not None:
        candidates.append((checkpoint_step(ckpt), 0, ckpt / "model.safetensors"))
    if not candidates:
        raise TngramError(
            f"{run_dir} has no usable weights (no {FINAL_WEIGHTS}, no intact checkpoint)"
        )
    weights = max(candidates)[2]
    if weights == final:
        verify_weights_file(final)  # its recorded size + sha256 (checkpoints: their manifest)
        recorded, rec_where = recorded_config(final), f"{final} (its header)"
        if recorded is None and ckpt is not None:  # weights written before they recorded it
            recorded, rec_where = read_checkpoint_meta(ckpt).get("config"), str(ckpt / "meta.json")
    else:
        recorded, rec_where = (
            read_checkpoint_meta(weights.parent).get("config"),
            str(weights.parent / "meta.json"),
        )
    if recorded is not None:
        check_recorded_config(cfg_dict, recorded, str(run_dir / "config.json"), rec_where)
    model = GPT(cfg.model)  # random init (cheap), overwritten by the weights below
    load_weights(model, weights)
    model.to(device).eval()
    check_finite_model(model, weights)
    return model, cfg_dict
