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
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save
from torch import nn

from tngram.common import MissingFileError, TngramError
from tngram.model.gpt import GPT
from tngram.readback import BadRecordError, load_json, plain_name
from tngram.safefs import (check_regular, is_link, make_dirs, open_fd, open_read, real_dir,
                           remove_tree, write_bytes, write_json)
# the run folder's names and the checkpoint listing live in runfiles (below config); kept as names here
from tngram.train.runfiles import (CKPT_DIR, FINAL_WEIGHTS, checkpoint_step, has_checkpoint,  # noqa: F401
                                   latest_checkpoint, list_checkpoints)
from tngram.train.saved import config_from_saved

MANIFEST = "manifest.json"
CKPT_FILES = ("model.safetensors", "state.safetensors", "meta.json")
DCP_DIR = "dcp"     # a sharded checkpoint's torch.distributed.checkpoint files (FSDP, > 1 process)


# ---- (de)serialisation helpers

def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _cpu(v) for k, v in model.state_dict().items()}


def optimizer_to_flat(name: str, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split opt.state_dict() into tensors ("optim/NAME/IDX/KEY") and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"optim/{name}/{idx}/{k}"] = _cpu(v)
            else:
                plain.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def optimizer_from_flat(name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                        info: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"optim/{name}/"
    for key, v in tensors.items():
        if key.startswith(prefix):
            idx, k = key[len(prefix):].split("/", 1)
            state.setdefault(int(idx), {})[k] = v
    for idx, rest in info["plain_state"].items():
        state.setdefault(int(idx), {}).update(rest)
    groups = []
    for g in info["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda_{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("rng/cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


def _write_file(path: Path, data: bytes) -> None:
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
        raise DiskFull(f"not enough disk space for {what} in {folder}: it needs {_mib(needed)}, "
                       f"{_mib(free)} free; free some space or choose another --out")


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- save / load

def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module,
                    optimizers: dict[str, torch.optim.Optimizer], meta: dict[str, Any],
                    keep: int) -> Path:
    """Write DIR/checkpoints/step_NNNNNN atomically, then delete all but the newest `keep`.

    The files are serialised in memory first, so their exact size is known: the free space is
    checked before anything is written, and a write that still fails (disk full, I/O error)
    removes the temporary folder and raises one TngramError saying how much space is needed.
    """
    root = make_dirs(run_dir, Path(run_dir) / CKPT_DIR)    # a linked checkpoints/ is refused
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
        "meta.json": (json.dumps({**meta, "step": step, "optimizers": opt_info}, indent=1) + "\n").encode(),
    }
    manifest = {"step": step, "files": {n: {"size": len(b), "sha256": _sha256(b)} for n, b in blobs.items()}}
    needed = sum(len(b) for b in blobs.values()) + 4096
    check_free_space(root, needed, f"checkpoint step_{step:06d}")
    try:
        if os.path.lexists(tmp):
            remove_tree(tmp) or os.unlink(tmp)
        tmp.mkdir()
        for name, data in blobs.items():
            _write_file(tmp / name, data)
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())  # last
        _fsync_dir(tmp)
        if os.path.lexists(final):  # re-saving the same step (a resumed run that was complete)
            remove_tree(final) or os.unlink(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        remove_tree(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"disk full while writing checkpoint step_{step:06d} to {root}: a checkpoint "
                           f"needs {_mib(needed)}; the torn copy was removed and the previous "
                           f"checkpoints are intact; free some space and --resume") from None
        raise TngramError(f"cannot write checkpoint step_{step:06d} to {root}: {e.strerror or e}") from None
    for old in list_checkpoints(run_dir)[:-keep]:     # only our own step_* folders, never a link
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
            continue                          # never look through a linked folder
        for p in folder.glob(pattern):
            if is_link(p) or not real_dir(p):
                p.unlink(missing_ok=True)     # a file, or a link itself (never its target)
            else:
                remove_tree(p)
            gone.append(p)
    return gone


def _fsync_dir(path: Path) -> None:
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

def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
                return (f"{DCP_DIR}/{odd} is " + ("not in the manifest" if odd in present else "missing"))
            checks += [(folder / n, f"{DCP_DIR}/{n}", r) for n, r in shards.items()]
        for f, name, rec in checks:
            try:
                size = os.fstat(fd := open_fd(f)).st_size
                os.close(fd)
            except (OSError, TngramError) as e:
                return f"{name} is missing" if isinstance(e, FileNotFoundError) else _short(e)
            if size != rec.get("size"):
                return f"{name} has {size} bytes, the manifest says {rec.get('size')} (truncated or replaced)"
            if _file_sha256(f) != rec.get("sha256"):
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
            _read_safetensors_header(path / name)
        except TngramError as e:
            return str(e).split(": ", 1)[-1]
    return None


def newest_good_checkpoint(run_dir: str | os.PathLike,
                           say: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is reported via `say`."""
    for p in reversed(list_checkpoints(run_dir)):
        reason = verify_checkpoint(p)
        if reason is None:
            return p
        if say is not None:
            say(f"tngram: skipping checkpoint {p.name}: {reason}")
    return None


def _read_safetensors_header(file: Path) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", ...}} of a safetensors file; TngramError naming it if the
    file is missing, truncated or not safetensors."""
    from safetensors import safe_open
    try:
        check_regular(file)
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except TngramError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError / OSError / ValueError
        raise TngramError(f"{file}: corrupt or truncated safetensors file ({_short(e)})") from None


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        check_regular(file)
        return load_file(str(file))
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except TngramError:
        raise
    except Exception as e:
        raise TngramError(f"{file}: corrupt or truncated safetensors file ({_short(e)})") from None


def _load_json(file: Path) -> Any:
    try:
        return load_json(file, want_dict=False)
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except BadRecordError as e:
        if "JSON" in str(e) or "UTF-8" in str(e):
            raise TngramError(f"{file}: corrupt or truncated JSON ({str(e).split(': ', 1)[-1]})") from None
        raise
    except OSError as e:
        raise TngramError(f"{file}: corrupt or truncated JSON ({_short(e)})") from None


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The meta.json of checkpoint folder `path` (step, tokens, times, loader state, config)."""
    return _load_json(Path(path) / "meta.json")


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    restore_rng_state: bool = True) -> dict[str, Any]:
    """Restore weights (and optimisers, RNG) from a checkpoint folder; returns its meta.json.
    Every problem is a TngramError naming the file."""
    path = Path(path)
    meta = _load_json(path / "meta.json")
    load_weights(model, path / "model.safetensors", (optimizers or {}).values())
    bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:     # a checkpoint without a manifest cannot be verified byte for byte: check the values
        raise TngramError(f"{path / 'model.safetensors'}: non-finite values in {bad[0]} (corrupt); move "
                          f"{path.name} away to resume from an older checkpoint")
    if optimizers:
        state = _load_tensors(path / "state.safetensors")
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise TngramError(f"{path / 'state.safetensors'}: non-finite values in {bad[0]} (corrupt); move "
                              f"{path.name} away to resume from an older checkpoint")
        for name, opt in optimizers.items():
            if name not in meta.get("optimizers", {}):
                raise TngramError(f"checkpoint {path} has no state for optimiser {name!r}")
            load_optimizer_checked(path / "state.safetensors", name, opt, state, meta["optimizers"][name])
        if restore_rng_state:
            restore_rng_checked(path, state)
    return meta


def load_optimizer_checked(where: Path | str, name: str, opt: torch.optim.Optimizer,
                           tensors: dict[str, torch.Tensor], layout: Any) -> None:
    """`optimizer_from_flat`, any failure one line naming `where` (state that does not fit)."""
    try:
        optimizer_from_flat(name, opt, tensors, layout)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TngramError(f"{where}: optimiser {name!r} state does not fit this model ({_short(e)})") from None


def restore_rng_checked(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`restore_rng` from checkpoint folder `path`'s state.safetensors tensors, one line if absent
    or corrupt."""
    if "rng/torch_cpu" not in state:
        raise TngramError(f"{path / 'state.safetensors'}: no RNG state")
    try:
        restore_rng(state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise TngramError(f"{path / 'state.safetensors'}: the RNG state is corrupt ({_short(e)}); move "
                          f"{path.name} away to resume from an older checkpoint") from None


def load_weights(model: nn.Module, file: str | os.PathLike,
                 optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
    """Load a safetensors state dict into `model`; names and shapes are checked first, so a file
    that does not fit raises one TngramError naming it (and loads nothing)."""
    file = Path(file)
    tensors = _load_tensors(file)
    # weights saved after adaptive CP-rank pruning have smaller TN-gram shapes than the config's
    # starting rank: shrink those modules first (the loaded values then overwrite them; the
    # optimisers are pointed at the new, smaller parameters)
    from tngram.memory.cp_rank import shrink_to_state
    shrink_to_state(model, tensors, optimizers)
    own = model.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    if missing or unexpected:
        raise TngramError(f"weights in {file} do not fit the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    bad = [(k, tuple(tensors[k].shape), tuple(v.shape)) for k, v in own.items() if tensors[k].shape != v.shape]
    if bad:
        k, got, want = bad[0]
        raise TngramError(f"weights in {file} do not fit the model: {k} has shape {got}, the model "
                          f"needs {want} ({len(bad)} mismatched tensor(s)); was it written by another config?")
    model.load_state_dict(tensors, strict=True)


def weights_with_digest(tensors: dict[str, torch.Tensor], step: int) -> bytes:
    """A safetensors file whose header records its payload's size and sha256 (the final weights'
    manifest, inside the file so a copied model.safetensors carries it): `verify_weights_file`."""
    data = save(tensors, metadata={"step": str(step)})
    payload = memoryview(data)[8 + int.from_bytes(data[:8], "little"):]
    meta = {"step": str(step), "payload_bytes": str(len(payload)), "payload_sha256": _sha256(payload)}
    return save(tensors, metadata=meta)      # the payload does not depend on the metadata


def verify_weights_file(file: Path) -> None:
    """A weights file whose header records a payload digest must match it (size and sha256);
    files without one (checkpoints, verified by their manifest; older runs) pass."""
    from safetensors import safe_open
    try:
        check_regular(file)
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
    except TngramError:
        raise
    except Exception as e:
        raise TngramError(f"{file}: corrupt or truncated final weights ({_short(e)}); delete it to "
                          f"use the newest checkpoint, or re-run the last step with --resume") from None
    want = meta.get("payload_sha256")
    if want is None:
        return
    h = hashlib.sha256()
    with open_read(file) as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)
        size = 0
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            size += len(chunk)
    if str(size) != meta.get("payload_bytes") or h.hexdigest() != want:
        raise TngramError(f"{file}: the weights do not match the size and sha256 recorded in their header "
                          f"(corrupt or replaced); delete it to use the newest checkpoint")


def check_finite_model(model: nn.Module, file: Path) -> None:
    """Loaded weights must be finite and give finite logits on a first probe (8 tokens)."""
    bad = [n for n, p in model.state_dict().items() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        raise TngramError(f"{file}: non-finite values in {bad[0]} ({len(bad)} tensor(s)); the weights are "
                          f"corrupt or diverged")
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    T = min(8, int(cfg.sequence_len))
    ids = torch.arange(T, device=next(model.parameters()).device).remainder(int(cfg.vocab_size)).view(1, T)
    with torch.no_grad():
        out = model(ids)
    logits = out[0] if isinstance(out, tuple) else out
    if not bool(torch.isfinite(logits).all()):
        raise TngramError(f"{file}: the weights give non-finite logits on a first probe; they are corrupt "
                          f"or diverged")


def save_final_weights(run_dir: str | os.PathLike, model: nn.Module, step: int) -> Path:
    path = Path(run_dir) / FINAL_WEIGHTS
    data = weights_with_digest(model_tensors(model), step)
    check_free_space(path.parent, len(data) + 4096, "the final weights")
    try:
        write_bytes(path, data, run_dir)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"disk full while writing {path}: the final weights need {_mib(len(data))}; "
                           f"the checkpoints are intact, free some space and --resume") from None
        raise TngramError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _weights_step(file: Path) -> int:
    from safetensors import safe_open
    try:
        check_regular(file)
        with safe_open(str(file), framework="pt") as f:
            return int((f.metadata() or {}).get("step", -1))
    except TngramError:
        raise
    except Exception as e:
        raise TngramError(f"{file}: corrupt or truncated final weights ({_short(e)}); delete it to "
                          f"use the newest checkpoint, or re-run the last step with --resume") from None


def save_run_config(run_dir: str | os.PathLike, cfg_dict: dict[str, Any]) -> None:
    write_json(Path(run_dir) / "config.json", cfg_dict, run_dir)


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """DIR/config.json as a dict; TngramError naming the file if missing or corrupt."""
    path = Path(run_dir) / "config.json"
    if not os.path.lexists(path):
        raise MissingFileError(f"{run_dir} is not a run folder (no config.json)")
    d = _load_json(path)
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("model"), dict):
        raise TngramError(f"{path}: not a tngram run config (no name/model)")
    return d


def load_run_model(run_dir: str | Path, device: str = "cpu",
                   say: Callable[[str], None] | None = None) -> tuple[nn.Module, dict]:
    """The trained model of a run folder (eval mode, on `device`) and its resolved config dict.

    Weights come from whichever is newer: the final weights DIR/model.safetensors or the newest
    checkpoint that verifies (a run still going, or interrupted, has only checkpoints).
    """
    run_dir = Path(run_dir)
    cfg_dict = read_run_config(run_dir)
    cfg = config_from_saved(cfg_dict, str(run_dir / "config.json"))   # before anything is allocated
    candidates = []
    final = run_dir / FINAL_WEIGHTS
    if os.path.lexists(final):
        candidates.append((_weights_step(final), 1, final))
    ckpt = newest_good_checkpoint(run_dir, say)
    if ckpt is not None:
        candidates.append((checkpoint_step(ckpt), 0, ckpt / "model.safetensors"))
    if not candidates:
        raise TngramError(f"{run_dir} has no usable weights (no {FINAL_WEIGHTS}, no intact checkpoint)")
    weights = max(candidates)[2]
    if weights == final:
        verify_weights_file(final)  # its recorded size + sha256 (checkpoints: their manifest)
    model = GPT(cfg.model)          # random init (cheap), overwritten by the weights below
    load_weights(model, weights)
    model.to(device).eval()
    check_finite_model(model, weights)
    return model, cfg_dict
