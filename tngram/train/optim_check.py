"""The optimiser state of a checkpoint checked field by field before anything is restored
(docs/RELIABILITY.md, "Files read back"): every state tensor present, of its parameter's shape,
dtype kind, finite and in range; the step counts in [0, the checkpoint's step]; the catch-up lr
history finite and at most the group's base lr; the param groups' hyperparameters in range.
A failure is one BadRecordError naming the file and the field (exit 2), so a forged or damaged
state never reaches the first step (where it would show as a non-finite loss)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tngram.readback import BadRecordError, get
from tngram.readback.tensors import check_number, check_tensor

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
