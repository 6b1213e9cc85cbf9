"""Sharded checkpoints of FSDP2 runs with > 1 process, through torch.distributed.checkpoint (DCP).

    DIR/checkpoints/step_000500/
        dcp/shard-0000R-model-00001-of-00001.safetensors   one file per process R: its shards
                                       of every weight ("model/NAME") and optimiser tensor
                                       ("optim/OPT/IDX/KEY"), the shard offsets as JSON in the
                                       header
        model.safetensors              the weights gathered to full tensors (every reader of
                                       weights: tngram eval/export, run.init_from,
                                       load_run_model)
        state.safetensors              the RNG state (main process)
        meta.json                      as in tngram.train.checkpoint, plus "format": "sharded"
        manifest.json                  size and sha256 of the three files and of every dcp/ file
                                       ("shards")

Writing: every process writes its own shards (DCP's safetensors writer, HuggingFaceStorageWriter
with save_distributed) into one temporary folder (a name every process computes); the main
process adds the other files, the manifest last, and renames the folder into place, so a
process killed at any moment leaves the previous checkpoints. The folder must be on a file
system every process sees (one host, or a shared one). Resuming reads the shards at any world
size: DCP reshards to the live model's DTensors (each process reads its rows) or, in one process
without a process group, to full tensors. DCP's default storage (FileSystemWriter/Reader) is not
used: its reader unpickles a .metadata file, and loading a checkpoint never unpickles here; the
safetensors storage keeps tensors as raw data and the layout as JSON. Optimiser state keeps the
names of the gathered format (index-keyed), its shapes and dtypes come from the shards' headers,
so no optimiser step is needed to create it (torch's get_state_dict would re-key by parameter
name and run a zero step of every optimiser, a collective Muon step here, to make the state).
The weights are still gathered once per checkpoint for model.safetensors (1/3 of an Adam
checkpoint; the optimiser state, 2/3, is never gathered).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from tngram.common import TngramError, json_text
from tngram.safefs import make_dirs, real_dir, remove_tree
from tngram.train.checkpoint import (
    CKPT_DIR,
    DCP_DIR,
    DiskFull,
    check_checkpoint_meta,
    clear_path,
    commit_checkpoint,
    check_free_space,
    cpu_copy,
    load_checkpoint,
    load_checkpoint_json,
    load_optimizer_checked,
    load_tensors,
    restore_rng_checked,
    rng_tensors,
    save_checkpoint,
    short_error,
)
from tngram.train.fsdp import FullStateModel, checkpoint_views


def save_step_checkpoint(
    run_dir: Any,
    step: int,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    meta: dict[str, Any],
    keep: int,
    ctx: Any,
    sharded: bool,
) -> None:
    """The trainer's checkpoint (every process calls this; ctx: its DistContext): sharded through
    DCP when the model is FSDP-sharded, else the main process writes the usual files."""
    if sharded:
        save_sharded_checkpoint(run_dir, step, model, optimizers, meta, keep, ctx)
    elif ctx.is_main:
        save_checkpoint(run_dir, step, model, optimizers, meta, keep=keep)


def load_step_checkpoint(
    path: Path, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], sharded: bool
) -> dict[str, Any]:
    """Resume from checkpoint folder `path` whatever wrote it: DCP shards (resharded to this world
    size) or the usual full tensors (each process keeps its shard when `sharded`). Its meta.json."""
    if is_sharded_checkpoint(path):
        return load_sharded_checkpoint(path, model, optimizers)
    return load_checkpoint(path, *checkpoint_views(model, optimizers, sharded))


def sharded_state(
    model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a sharded checkpoint writes through torch.distributed.checkpoint: the tensors
    ("model/NAME", "optim/OPT/IDX/KEY": DTensor shards, or plain tensors equal on every process
    such as Adam's step count) and each optimiser's JSON-able rest (param groups, non-tensor state;
    for meta.json). The names are those of the gathered format (tngram.train.checkpoint)."""
    tensors: dict[str, Any] = {f"model/{k}": v.detach() for k, v in model.state_dict().items()}
    info: dict[str, Any] = {}
    for name, opt in optimizers.items():
        sd = opt.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"optim/{name}/{idx}/{k}"] = v.detach()
                else:
                    plain.setdefault(str(idx), {})[k] = v
        info[name] = {"param_groups": sd["param_groups"], "plain_state": plain}
    return tensors, info


def save_sharded_checkpoint(
    run_dir: Any,
    step: int,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    meta: dict[str, Any],
    keep: int,
    ctx: Any,
) -> None:
    """A checkpoint of a sharded model (every process calls this; ctx: the trainer's DistContext).

    Every process writes its own shards of the weights and optimiser state through
    torch.distributed.checkpoint into one temporary folder; the main process adds the gathered
    weights (model.safetensors, for every reader of weights), the RNG state, meta.json and the
    manifest, then renames the folder into place (tngram.train.checkpoint). A failure on any
    process is raised on every process (one line), and the previous checkpoints stay intact."""
    from tngram.train.dist import broadcast_str

    def agreed(fn: Any) -> Any:  # run fn on the main process; its error on every process
        out, err, exc = None, None, None
        if ctx.is_main:
            try:
                out = fn()
            except TngramError as e:
                err, exc = str(e), e
        err = broadcast_str(err, ctx)
        if err is not None:
            raise exc if exc is not None else TngramError(err)
        return out

    full = FullStateModel(model).state_dict()  # collective: the weights for readers
    tensors, info = sharded_state(model, optimizers)
    needed = sum(v.numel() * v.element_size() for v in [*tensors.values(), *full.values()]) + 65536
    agreed(lambda: begin_sharded_checkpoint(run_dir, step, needed))
    try:
        write_shards(sharded_temp(run_dir, step), tensors)  # collective
    except TngramError:
        if ctx.is_main:
            remove_tree(sharded_temp(run_dir, step))
        raise
    agreed(lambda: finish_sharded_checkpoint(run_dir, step, full, info, meta, keep))


def sharded_temp(run_dir: str | os.PathLike, step: int) -> Path:
    """The temporary folder of a sharded checkpoint: one name every process can compute."""
    return Path(run_dir) / CKPT_DIR / f".tmp-step_{step:06d}-sharded"


def begin_sharded_checkpoint(run_dir: str | os.PathLike, step: int, needed: int) -> Path:
    """(Main process, before the shards are written) check the free space for `needed` bytes and
    create the empty temporary folder with its dcp/ inside."""
    root = make_dirs(run_dir, Path(run_dir) / CKPT_DIR)  # a linked checkpoints/ is refused
    check_free_space(root, needed, f"checkpoint step_{step:06d}")
    tmp = sharded_temp(run_dir, step)
    try:
        clear_path(tmp)
        tmp.mkdir()
        (tmp / DCP_DIR).mkdir()
    except OSError as e:
        remove_tree(tmp)
        raise TngramError(
            f"cannot write checkpoint step_{step:06d} to {root}: {e.strerror or e}"
        ) from None
    return tmp


def write_shards(tmp: Path, tensors: dict[str, Any]) -> None:
    """(Every process, collective) this process's part of `tensors` into tmp/dcp/ through
    torch.distributed.checkpoint: DTensors as their local shards, plain tensors (equal on every
    process) once. The storage is DCP's safetensors writer (HuggingFaceStorageWriter with
    save_distributed: one file per process, each shard's offsets as JSON in the file's header),
    so reading needs no pickle (DCP's default FileSystemReader unpickles its .metadata file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    try:
        dcp.save(
            tensors,
            storage_writer=HuggingFaceStorageWriter(str(tmp / DCP_DIR), save_distributed=True),
        )
    except Exception as e:  # DCP raises every process's failure on every process
        text = short_error(e)
        if "No space left" in str(e) or "Disk quota" in str(e):
            raise DiskFull(
                f"disk full while writing the shards of checkpoint {tmp.name} ({text}); "
                f"the previous checkpoints are intact, free some space and --resume"
            ) from None
        raise TngramError(f"cannot write the shards of checkpoint {tmp}: {text}") from None


def finish_sharded_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    full_model: dict[str, torch.Tensor],
    optimizers_info: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
) -> Path:
    """(Main process, after every process wrote its shards) add the gathered weights (for
    `tngram eval/export` and every other reader of model.safetensors), the RNG state and
    meta.json, then the manifest (sizes and sha256 of these and of every file in dcp/) last;
    rename the folder into place and delete all but the newest `keep` checkpoints
    (commit_checkpoint)."""
    blobs = {
        "model.safetensors": save(
            {k: cpu_copy(v) for k, v in full_model.items()}, metadata={"step": str(step)}
        ),
        "state.safetensors": save(rng_tensors(), metadata={"step": str(step)}),
        "meta.json": (
            json_text(
                {**meta, "step": step, "format": "sharded", "optimizers": optimizers_info}, indent=1
            )
            + "\n"
        ).encode(),
    }
    return commit_checkpoint(run_dir, sharded_temp(run_dir, step), step, blobs, keep, sharded=True)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether checkpoint folder `path` holds DCP shards (written by FSDP with > 1 process)."""
    return real_dir(Path(path) / DCP_DIR)


def load_sharded_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng_state: bool = True,
) -> dict[str, Any]:
    """Restore weights, optimisers and RNG from a sharded checkpoint at any world size: the model
    and optimiser state may be FSDP-sharded (DTensors: each process reads the rows of its shard)
    or not (1 process, no process group: full tensors). torch.distributed.checkpoint reshards;
    the optimiser state's shapes and dtypes come from the shards' headers. Returns meta.json.
    Collective when a process group exists."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    where = path / DCP_DIR
    meta = check_checkpoint_meta(load_checkpoint_json(path / "meta.json"), path / "meta.json")
    reader = HuggingFaceStorageReader(str(where))
    try:
        md = reader.read_metadata().state_dict_metadata
        shapes = {
            k: (tuple(v.size), v.properties.dtype)
            for k, v in md.items()
            if isinstance(v, TensorStorageMetadata)
        }
        if len(shapes) != len(md):  # tngram writes only tensors
            raise ValueError("an entry is not a tensor")
    except Exception as e:
        raise TngramError(f"{where}: corrupt sharded checkpoint ({short_error(e)})") from None
    own = model.state_dict()
    template: dict[str, Any] = {}
    for k, v in own.items():
        got = shapes.get(f"model/{k}", (None,))[0]
        if got != tuple(v.shape):
            raise TngramError(
                f"{where}: the weights do not fit the model: {k} has shape {got}, the model "
                f"needs {tuple(v.shape)}; was it written by another config?"
            )
        template[f"model/{k}"] = v
    extra = [k for k in shapes if k.startswith("model/") and k[len("model/") :] not in own]
    if extra:
        raise TngramError(f"{where}: the weights do not fit the model: unexpected {extra[:5]}")
    for name, opt in (optimizers or {}).items():
        if name not in meta.get("optimizers", {}):
            raise TngramError(f"checkpoint {path} has no state for optimiser {name!r}")
        params = [p for g in opt.param_groups for p in g["params"]]
        prefix = f"optim/{name}/"
        for key, (shape, dtype) in shapes.items():
            if not key.startswith(prefix):
                continue
            try:
                p = params[int(key[len(prefix) :].split("/", 1)[0])]
            except (ValueError, IndexError):
                raise TngramError(
                    f"{where}: optimiser {name!r} state {key} does not fit this model"
                ) from None
            # a state shaped like its parameter is sharded like it (a DTensor under FSDP)
            template[key] = (
                torch.zeros_like(p, dtype=dtype)
                if shape == tuple(p.shape)
                else torch.zeros(shape, dtype=dtype, device=p.device)
            )
    single = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: it does
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=reader, no_dist=single)
    except Exception as e:
        raise TngramError(
            f"{where}: cannot read the sharded checkpoint ({short_error(e)})"
        ) from None
    for k, v in template.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            raise TngramError(
                f"{where}: non-finite values in {k} (corrupt); move {path.name} away to "
                f"resume from an older checkpoint"
            )
    model.load_state_dict({k: template[f"model/{k}"] for k in own}, strict=True)
    for name, opt in (optimizers or {}).items():
        load_optimizer_checked(
            where, name, opt, template, meta["optimizers"][name], meta.get("step")
        )
    if optimizers and restore_rng_state:
        restore_rng_checked(path, load_tensors(path / "state.safetensors"))
    return meta
