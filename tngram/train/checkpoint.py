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
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save
from torch import nn

from tngram.common import MissingFileError, TngramError, json_text
from tngram.memory import memory_dict_now
from tngram.model.gpt import GPT
from tngram.readback import BadRecordError, get, load_json, plain_name
from tngram.readback.tensors import (
    SafetensorsHeader,
    check_finite_module,
    check_number,
    check_tensor,
    payload_digest,
    read_safetensors,
    read_safetensors_header,
)
from tngram.safefs import (
    is_link,
    make_dirs,
    open_fd,
    open_read,
    real_dir,
    remove_tree,
    write_bytes,
    write_json,
)

# the run folder's names and the checkpoint listing live in runfiles (below config): their names
# are kept importable from here
from tngram.train.runfiles import (  # noqa: F401
    CKPT_DIR,
    FINAL_WEIGHTS,
    checkpoint_step,
    has_checkpoint,
    latest_checkpoint,
    list_checkpoints,
)
from tngram.train.saved import config_from_saved


# ---- reading files back: safetensors tensors and JSON records (a failure names the file)


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: cpu_copy(v) for k, v in model.state_dict().items()}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def short_error(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def safetensors_shapes(file: Path) -> dict[str, Any]:
    """{tensor name: shape} of a safetensors file, read and checked by tngram.readback.tensors
    (missing, truncated, oversized or not safetensors: one TngramError naming it)."""
    return dict(read_safetensors_header(file).shapes)


def load_tensors(file: Path, finite: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (tngram.readback.tensors.read_safetensors: header and
    size checked first, float tensors finite)."""
    return read_safetensors(file, finite=finite)[0]


def load_checkpoint_json(file: Path) -> Any:
    try:
        return load_json(file, want_dict=False)
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except BadRecordError as e:
        if "JSON" in str(e) or "UTF-8" in str(e):
            raise TngramError(
                f"{file}: corrupt or truncated JSON ({str(e).split(': ', 1)[-1]})"
            ) from None
        raise
    except OSError as e:
        raise TngramError(f"{file}: corrupt or truncated JSON ({short_error(e)})") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- the optimiser state checked field by field before anything is restored (docs/RELIABILITY.md,
# "Files read back"): every state tensor present, of its parameter's shape, dtype kind, finite and
# in range; the step counts in [0, the checkpoint's step]; the catch-up lr history finite and at
# most the group's base lr; the param groups' hyperparameters in range. A failure is one
# BadRecordError naming the file and the field (exit 2), so a forged or damaged state never
# reaches the first step (where it would show as a non-finite loss).

# the state keys each optimiser class keeps for a parameter it has stepped ("+catchup": also
# last_step and lr_history when its group has catchup on); others' keys are checked if present
EXPECTED = {
    "RowwiseAdam": ("step", "exp_avg", "exp_avg_sq_row"),
    "LazyAdam": ("step", "exp_avg", "exp_avg_sq"),
    "Adam": ("step", "exp_avg", "exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq"),
    "Muon": ("momentum_buffer",),
}
PLAIN_STEP = ("RowwiseAdam", "LazyAdam")  # their step is a plain int in meta.json
CATCHUP = ("last_step", "lr_history")
LIKE_PARAM = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row")
LR_SLACK = 1.0 + 1e-6  # lr = base_lr * multiplier (<= 1), stored in float64


def check_optimizer_state(
    where: Path | str,
    name: str,
    opt: torch.optim.Optimizer,
    tensors: dict[str, Any],
    layout: Any,
    step: Any,
) -> None:
    """Check optimiser `name`'s saved state (tensors "optim/NAME/IDX/KEY" read from `where`, and
    the JSON `layout` of meta.json next to it) against `opt` built for this model, at the
    checkpoint's `step`. Raises BadRecordError naming the file and the field."""
    where = Path(where)
    meta = str(where.parent / "meta.json")
    cur = int(check_number(step, meta, "step", lo=0, integral=True))
    if not isinstance(layout, dict):
        raise BadRecordError(f"{meta}: optimizers.{name} must be an object")
    groups = _check_groups(meta, name, opt, get(layout, "param_groups", "list", meta))
    plain = get(layout, "plain_state", "dict", meta)
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, tuple[Any, str]]] = {}
    prefix = f"optim/{name}/"
    for key, v in tensors.items():
        if key.startswith(prefix):
            idx, _, k = key[len(prefix) :].partition("/")
            state.setdefault(_index(idx, len(params), str(where), key), {})[k] = (v, str(where))
    for idx, rest in plain.items():
        field = f"optimizers.{name}.plain_state.{idx}"
        if not isinstance(rest, dict):
            raise BadRecordError(f"{meta}: {field} must be an object")
        i = _index(idx, len(params), meta, field)
        for k, v in rest.items():
            state.setdefault(i, {})[k] = (v, meta)
    base_lr = max((g.get("base_lr", g.get("lr", 0.0)) for g in groups), default=0.0)
    group_of = {i: g for g in groups for i in g["params"]}
    want = EXPECTED.get(type(opt).__name__)
    for i, st in sorted(state.items()):
        g = group_of.get(i, {})
        expected = (*want, *(CATCHUP if g.get("catchup") else ())) if want else ()
        for k in expected:
            if k not in st:
                file = meta if k == "step" and type(opt).__name__ in PLAIN_STEP else str(where)
                raise BadRecordError(
                    f"{file}: optimiser {name!r} state {prefix}{i}/{k} is missing (truncated)"
                )
        table_step = cur
        if "step" in st:
            v, file = st["step"]
            table_step = int(
                check_number(v, file, f"{prefix}{i}/step", lo=0, hi=cur, integral=True)
            )
        for k, (v, file) in st.items():
            if k != "step":
                _check_one(k, v, file, f"{prefix}{i}/{k}", params[i], table_step, base_lr, want)


def _check_one(
    k: str,
    v: Any,
    file: str,
    field: str,
    p: torch.Tensor,
    table_step: int,
    base_lr: float,
    known: tuple[str, ...] | None,
) -> None:
    lo = 0.0 if k in NON_NEGATIVE else None
    if k in LIKE_PARAM:
        check_tensor(v, file, field, shape=tuple(p.shape), kind="float", lo=lo)
    elif k == "exp_avg_sq_row":
        check_tensor(v, file, field, shape=(p.numel() // p.shape[-1],), kind="float", lo=0.0)
    elif k == "last_step":
        rows = p.numel() // p.shape[-1]
        check_tensor(v, file, field, shape=(rows,), kind="int", lo=0, hi=table_step)
    elif k == "lr_history":
        check_tensor(v, file, field, dtype=torch.float64, lo=0.0, hi=base_lr * LR_SLACK)
        if v.dim() != 1 or v.numel() < table_step:
            raise BadRecordError(
                f"{file}: {field} must be a list of at least {table_step} lrs "
                f"(one per step), has shape {tuple(v.shape)}"
            )
    elif known is not None:
        raise BadRecordError(f"{file}: {field} is not state tngram writes for this optimiser")
    elif torch.is_tensor(v):
        check_tensor(v, file, field)
    else:
        check_number(v, file, field)


def _index(idx: str, n: int, file: str, field: str) -> int:
    if not idx.isdigit() or int(idx) >= n:
        raise BadRecordError(
            f"{file}: {field} names parameter {idx!r}; this optimiser has {n} parameters "
            f"(written for another model?)"
        )
    return int(idx)


def _check_groups(
    meta: str, name: str, opt: torch.optim.Optimizer, groups: list[Any]
) -> list[dict[str, Any]]:
    """The saved param groups: as many as the optimiser's, each with as many parameters, its
    numeric hyperparameters finite and in range."""
    if len(groups) != len(opt.param_groups):
        raise BadRecordError(
            f"{meta}: optimizers.{name}.param_groups has {len(groups)} groups, this optimiser "
            f"{len(opt.param_groups)} (written for another model?)"
        )
    seen = 0
    for j, (g, own) in enumerate(zip(groups, opt.param_groups)):
        field = f"optimizers.{name}.param_groups[{j}]"
        if not isinstance(g, dict):
            raise BadRecordError(f"{meta}: {field} must be an object")
        ids = get(g, "params", "list", f"{meta}: {field}")
        if len(ids) != len(own["params"]) or ids != list(range(seen, seen + len(ids))):
            raise BadRecordError(
                f"{meta}: {field}.params must be the {len(own['params'])} parameter indices "
                f"{seen}..{seen + len(own['params']) - 1}"
            )
        seen += len(ids)
        for k, lo, hi in (
            ("lr", 0.0, None),
            ("base_lr", 0.0, None),
            ("eps", 0.0, None),
            ("weight_decay", 0.0, None),
            ("momentum", 0.0, 1.0),
        ):
            if k in g:
                check_number(g[k], meta, f"{field}.{k}", lo=lo, hi=hi)
        if "betas" in g:
            b = g["betas"]
            if not isinstance(b, (list, tuple)) or len(b) != 2:
                raise BadRecordError(f"{meta}: {field}.betas must be a pair, got {b!r:.60}")
            for x in b:
                check_number(x, meta, f"{field}.betas", lo=0.0, hi=1.0 - 1e-12)
        for k, want in own.items():  # the settings the config gives, never the saved ones
            if k in SCHEDULED or _same(g.get(k, "(missing)"), want):
                continue
            raise BadRecordError(
                f"{meta}: field {field}.{k} is {g.get(k, '(missing)')!r:.40} but the run's config "
                f"gives {want!r:.40}; the checkpoint's optimiser settings were edited: move it "
                f"away to resume from an older one"
            )
    return groups


# param-group fields not compared with the config: those the trainer sets every step from the
# schedule (a checkpoint holds the last), and how torch runs the update on this device
SCHEDULED = ("params", "lr", "momentum", "fused", "foreach", "capturable", "differentiable")


def _same(saved: Any, own: Any) -> bool:
    """A saved param-group value (JSON: tuples became lists) equals the optimiser's own."""
    if isinstance(own, tuple):
        return isinstance(saved, list) and _same(list(saved), list(own))
    if isinstance(own, list):
        return (
            isinstance(saved, list)
            and len(saved) == len(own)
            and all(_same(a, b) for a, b in zip(saved, own))
        )
    if isinstance(own, bool) or own is None or isinstance(own, str):
        return saved == own and type(saved) is type(own)
    if isinstance(own, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and saved == own
    return saved == own


OPTIONAL = ("seed", "batches")  # loader fields older checkpoints lack (the loader's defaults)


def check_checkpoint_meta(meta: Any, file: Path | str) -> dict[str, Any]:
    """A checkpoint's meta.json: an object whose counters the trainer resumes from are in range
    (step, tokens: whole numbers >= 0; train_time_s, wall_s: finite >= 0; world_size >= 1;
    train_loss a number or null), loader and config objects (each config section one)."""
    file = str(file)
    if not isinstance(meta, dict):
        raise BadRecordError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    get(meta, "step", "int", file, lo=0)
    get(meta, "tokens", "int", file, lo=0)
    for k in ("train_time_s", "wall_s"):
        get(meta, k, "float", file, lo=0)
    loader = get(meta, "loader", "dict", file)
    for k in ("version", "shard", "pos", "seed", "batches"):  # TokenLoader.state_dict
        get(loader, k, "int", f"{file} loader", lo=0, **({"default": 0} if k in OPTIONAL else {}))
    for k in ("counts", "order"):
        v = get(loader, k, "list", f"{file} loader")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise BadRecordError(f"{file}: field loader.{k} must be a list of ints >= 0")
    get(meta, "optimizers", "dict", file, default={})
    get(meta, "world_size", "int", file, lo=1, default=1)
    get(meta, "train_loss", "any-number?", file, default=None)
    config = get(meta, "config", "dict", file, default={})
    for sec, v in config.items():  # compared with the run's config on --resume
        if sec != "name" and not isinstance(v, dict):
            raise BadRecordError(f"{file}: field config.{sec} must be an object")
    # every step adds data.global_batch_tokens (fixed for a run: --resume refuses a change)
    batch = config.get("data", {}).get("global_batch_tokens")
    if isinstance(batch, int) and not isinstance(batch, bool) and "tokens" in meta:
        if meta["tokens"] != meta["step"] * batch:
            raise BadRecordError(
                f"{file}: field 'tokens' must be step x data.global_batch_tokens = "
                f"{meta['step']} x {batch}, got {meta['tokens']}"
            )
    return meta


# ---- optimiser and RNG state: flattened to safetensors tensors plus a JSON layout


def optimizer_to_flat(
    name: str, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split opt.state_dict() into tensors ("optim/NAME/IDX/KEY") and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"optim/{name}/{idx}/{k}"] = cpu_copy(v)
            else:
                plain.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def optimizer_from_flat(
    name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], info: dict
) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"optim/{name}/"
    for key, v in tensors.items():
        if key.startswith(prefix):
            idx, k = key[len(prefix) :].split("/", 1)
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
    cuda = sorted(
        (int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("rng/cuda_")
    )
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


def load_optimizer_checked(
    where: Path | str,
    name: str,
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    layout: Any,
    step: Any,
) -> None:
    """`optimizer_from_flat` after every field was checked (check_optimizer_state, at the
    checkpoint's `step`); any failure one line naming `where` (state that does not fit)."""
    check_optimizer_state(where, name, opt, tensors, layout, step)
    try:
        optimizer_from_flat(name, opt, tensors, layout)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TngramError(
            f"{where}: optimiser {name!r} state does not fit this model ({short_error(e)})"
        ) from None


def restore_rng_checked(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`restore_rng` from checkpoint folder `path`'s state.safetensors tensors, one line if absent
    or corrupt."""
    if "rng/torch_cpu" not in state:
        raise TngramError(f"{path / 'state.safetensors'}: no RNG state")
    try:
        restore_rng(state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise TngramError(
            f"{path / 'state.safetensors'}: the RNG state is corrupt ({short_error(e)}); move "
            f"{path.name} away to resume from an older checkpoint"
        ) from None


# ---- model weights files: loaded by name and shape, the final weights' digest, finiteness


def load_weights(
    model: nn.Module, file: str | os.PathLike, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> None:
    """Load a safetensors state dict into `model`; names and shapes are checked first, so a file
    that does not fit raises one TngramError naming it (and loads nothing)."""
    file = Path(file)
    tensors = load_tensors(file)
    # weights saved after adaptive CP-rank pruning have smaller TN-gram shapes than the config's
    # starting rank: shrink those modules first (the loaded values then overwrite them; the
    # optimisers are pointed at the new, smaller parameters)
    from tngram.memory.cp_rank import shrink_to_state

    shrink_to_state(model, tensors, optimizers)
    own = model.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    if missing or unexpected:
        raise TngramError(
            f"weights in {file} do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    bad = [
        (k, tuple(tensors[k].shape), tuple(v.shape))
        for k, v in own.items()
        if tensors[k].shape != v.shape
    ]
    if bad:
        k, got, want = bad[0]
        raise TngramError(
            f"weights in {file} do not fit the model: {k} has shape {got}, the model "
            f"needs {want} ({len(bad)} mismatched tensor(s)); was it written by another config?"
        )
    model.load_state_dict(tensors, strict=True)


def weights_with_digest(
    tensors: dict[str, torch.Tensor], step: int, config: dict[str, Any] | None = None
) -> bytes:
    """A safetensors file whose header records its payload's size and sha256 (the final weights'
    manifest, inside the file so a copied model.safetensors carries it: `verify_weights_file`)
    and the run config it was trained with (`recorded_config`)."""
    data = save(tensors, metadata={"step": str(step)})
    payload = memoryview(data)[8 + int.from_bytes(data[:8], "little") :]
    meta = {
        "step": str(step),
        "payload_bytes": str(len(payload)),
        "payload_sha256": sha256_hex(payload),
    }
    if config is not None:
        meta["config"] = json_text(config, sort_keys=True, separators=(",", ":"))
    return save(tensors, metadata=meta)  # the payload does not depend on the metadata


def _final_header(file: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(file)
    except MissingFileError:
        raise
    except TngramError as e:
        raise TngramError(
            f"{file}: corrupt or truncated final weights ({str(e).split(': ', 1)[-1]}); delete "
            f"it to use the newest checkpoint, or re-run the last step with --resume"
        ) from None


def verify_weights_file(file: Path) -> None:
    """A weights file whose header records a payload digest must match it (size and sha256);
    files without one (checkpoints, verified by their manifest; older runs) pass."""
    want = _final_header(file).metadata.get("payload_sha256")
    if want is None:
        return
    size, got, head = payload_digest(file)
    if str(size) != head.metadata.get("payload_bytes") or got != want:
        raise TngramError(
            f"{file}: the weights do not match the size and sha256 recorded in their header "
            f"(corrupt or replaced); delete it to use the newest checkpoint"
        )


def check_finite_model(model: nn.Module, file: Path) -> None:
    """Loaded weights must be finite and give finite logits on a first probe (8 tokens)."""
    check_finite_module(model, str(file))
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    T = min(8, int(cfg.sequence_len))
    ids = (
        torch.arange(T, device=next(model.parameters()).device)
        .remainder(int(cfg.vocab_size))
        .view(1, T)
    )
    with torch.no_grad():
        out = model(ids)
    logits = out[0] if isinstance(out, tuple) else out
    if not bool(torch.isfinite(logits).all()):
        raise TngramError(
            f"{file}: the weights give non-finite logits on a first probe; they are corrupt "
            f"or diverged"
        )


def weights_step(file: Path) -> int:
    try:
        return int(_final_header(file).metadata.get("step", -1))
    except ValueError as e:
        if isinstance(e, TngramError):
            raise
        raise TngramError(f"{file}: field __metadata__.step must be an int") from None


def recorded_config(file: Path) -> dict[str, Any] | None:
    """The run config final weights were written with (their header's `config`), or None for
    weights written before tngram recorded it."""
    from tngram.readback import parse_json

    text = _final_header(file).metadata.get("config")
    if text is None:
        return None
    cfg = parse_json(text, f"{file} (header field config)")
    if not isinstance(cfg, dict):
        raise TngramError(f"{file}: header field config must be a JSON object")
    return cfg


def final_problem(params: Iterable[torch.Tensor], val_loss: Any) -> str | None:
    """What makes a run's end unfit to be written as "done", or None: a non-finite parameter (of
    this process: call on every process and combine) or a non-finite validation loss."""
    flags = [torch.isfinite(p.detach()).all() for p in params if p.is_floating_point()]
    if flags and not bool(torch.stack(flags).all()):
        return "non-finite final weights"
    if not isinstance(val_loss, (int, float)) or not math.isfinite(val_loss):
        return f"non-finite validation loss ({val_loss})"
    return None


def refuse_final(run_dir: str | os.PathLike, problem: str, step: int) -> None:
    """Raise the one line that stops a run whose end is `problem` before its final weights and
    summary are written, naming the last good checkpoint to resume or inspect."""
    last = latest_checkpoint(run_dir)
    raise TngramError(
        f"{problem} at step {step}; not writing the final weights or summary.json. Last good "
        f"checkpoint: {last if last else 'none'} (resume from an older one by moving newer ones "
        f"away, or lower the learning rates)"
    )


SUSPECT_STEPS = 10  # a non-finite loss this soon after a resume points at the checkpoint


def resume_suspect(resumed_from: Path | None, resumed_step: int, step: int) -> str:
    """The sentence naming the checkpoint a run resumed from as a suspect when a non-finite loss
    comes within SUSPECT_STEPS steps of the resume (damaged or edited state shows there first),
    else ""."""
    if resumed_from is None or step - resumed_step > SUSPECT_STEPS:
        return ""
    return (
        f"The run resumed from {resumed_from} {step - resumed_step} step(s) earlier: that "
        f"checkpoint is a suspect (damaged or edited weights or optimiser state); move it away "
        f"to resume from an older one. "
    )


def check_final(
    run_dir: str | os.PathLike, params: Iterable[torch.Tensor], val_loss: Any, step: int, ctx: Any
) -> None:
    """`final_problem` on every process (this one's parameters; `ctx` a DistContext), then
    `refuse_final` everywhere if any process found one: before anything final is written."""
    from tngram.train.dist import all_true

    bad = final_problem(params, val_loss)
    if not all_true(bad is None, ctx):
        refuse_final(run_dir, bad or "non-finite final weights on another process", step)


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
    """Write DIR/checkpoints/step_NNNNNN atomically (commit_checkpoint), then delete all but the
    newest `keep`. The files are serialised in memory first: the free space they need is known
    exactly before anything is written."""
    root = make_dirs(run_dir, Path(run_dir) / CKPT_DIR)  # a linked checkpoints/ is refused
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
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    return commit_checkpoint(run_dir, tmp, step, blobs, keep)


def commit_checkpoint(
    run_dir: str | os.PathLike,
    tmp: Path,
    step: int,
    blobs: dict[str, bytes],
    keep: int,
    sharded: bool = False,
) -> Path:
    """Write `blobs` into the temporary folder `tmp` (made here; with `sharded` it exists and
    its dcp/ holds every process's shards), then manifest.json last (sizes and sha256 of the
    files, and of the shards), every file fsync'ed; rename it to step_NNNNNN and delete all but
    the newest `keep` checkpoints. The free space is checked first. On a failure `tmp` is
    removed and one TngramError says why (DiskFull: the size a checkpoint needs); the previous
    checkpoints stay intact."""
    root = tmp.parent
    needed = shard_bytes = sum(len(b) for b in blobs.values()) + 4096
    manifest: dict[str, Any] = {
        "step": step,
        "files": {n: {"size": len(b), "sha256": sha256_hex(b)} for n, b in blobs.items()},
    }
    try:
        if sharded:
            files = sorted((tmp / DCP_DIR).iterdir())
            manifest["shards"] = {
                f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)} for f in files
            }
            shard_bytes += sum(r["size"] for r in manifest["shards"].values())
        check_free_space(root, needed, f"checkpoint step_{step:06d}")
        if not sharded:
            clear_path(tmp)
            tmp.mkdir()
        for name, data in blobs.items():
            write_file(tmp / name, data)
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())  # last
        if sharded:
            fsync_dir(tmp / DCP_DIR)
        fsync_dir(tmp)
        final = root / f"step_{step:06d}"
        clear_path(final)  # re-saving the same step (a resumed run that was complete)
        os.replace(tmp, final)
        fsync_dir(root)
    except (OSError, TngramError) as e:
        remove_tree(tmp)
        if isinstance(e, TngramError):
            raise
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"disk full while writing checkpoint step_{step:06d} to {root}: a checkpoint "
                f"needs {_mib(shard_bytes)}; the torn copy was removed and the previous "
                f"checkpoints are intact; free some space and --resume"
            ) from None
        raise TngramError(
            f"cannot write checkpoint step_{step:06d} to {root}: {e.strerror or e}"
        ) from None
    for old in list_checkpoints(run_dir)[:-keep]:  # only our own step_* folders, never a link
        remove_tree(old, run_dir)
    remove_torn_temps(run_dir)
    return final


def clear_path(path: Path) -> None:
    """Remove what is at `path`: a folder tree, or a file or a link in its place."""
    if os.path.lexists(path) and not remove_tree(path):
        os.unlink(path)


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
