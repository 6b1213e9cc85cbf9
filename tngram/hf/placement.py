"""Memory tables kept in host memory: add_memory(..., table_device="cpu").

The memory's lookup tables (Engram / Over-Encoding tables, TN-gram CP factors and hashed table,
the token-indexed memories' tables: each module's `table_parameters()`) stay on the CPU while
the rest of the model (the memory's projections, gates and conv included) goes wherever the
model goes. A lookup then finds the distinct rows its ids read, gathers them on the CPU and
moves only those to the model's device (tngram.kernels.sparse_rows.host_read / compact_rows);
the gradient flows back to the CPU tables (dense, or row-sparse with memory_update="sparse").

    place_tables(model)   moves the tables to the spec's table_device and keeps them there:
                          each memory module's `_apply` (what .to / .cuda / .half call) lets a
                          dtype change through and leaves a device change out for its tables
    table_bytes(model)    bytes of the tables (what stays out of the accelerator's memory)

Accelerate's device_map places tensors without `_apply`; from_pretrained therefore calls
place_tables after loading (tngram.hf.attach.check_loaded), which moves them back.
"""

from __future__ import annotations

from functools import partial
import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.hf.classes import MEMORY_ATTR
from tngram.memory.base import MemoryModule

TABLE_DEVICES = ("cpu",)
SPEC_KEY = "table_device"


def check_table_device(value: Any, where: str = "table_device") -> None:
    """None (the tables follow the model) or one of TABLE_DEVICES, else one TngramError."""
    if value is not None and value not in TABLE_DEVICES:
        raise TngramError(
            f"{where} must be null (the tables follow the model) or one of "
            f"{list(TABLE_DEVICES)}, got {value!r}"
        )


def check_memory_config(cfg: Any) -> None:
    """table_device='cpu' reads every table through compact_rows, which a memory supports exactly
    when its tables can train row-sparse (the `row_sparse_problem` hook of tngram.memory.base;
    TN-gram's fused=False reference indexes the factors in place): refuse one that cannot."""
    if not cfg.row_sparse_problem():
        return
    if cfg.kind in ("tngram", "tngram-variant"):
        raise TngramError(
            "table_device='cpu' needs TNGramConfig(fused=True) (the default): the fused=False "
            "reference reads the factors in place, on the model's device"
        )
    raise TngramError(
        f"table_device='cpu' needs a memory whose tables are read row by row; "
        f"kind {cfg.kind!r} reads them in place"
    )


def _memories(model: nn.Module) -> list[MemoryModule]:
    """The memory modules of `model` (as tngram.hf.attach.memory_modules finds them)."""
    return [cast(MemoryModule, m) for n, m in model.named_modules() if n.endswith(MEMORY_ATTR)]


def table_params(model: nn.Module) -> list[nn.Parameter]:
    """Every memory table of `model`, each once (TN-gram share_factors: one A_1..A_N)."""
    seen: dict[int, nn.Parameter] = {}
    for m in _memories(model):
        for p in m.table_parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def table_bytes(model: nn.Module) -> int:
    """Bytes of the memory's tables: what table_device="cpu" keeps out of the accelerator's
    memory (their gradients and optimiser state, where they exist, stay on the CPU too)."""
    return sum(p.numel() * p.element_size() for p in table_params(model))


def _host_apply(
    module: nn.Module, device: str, fn: Callable[[Tensor], Tensor], recurse: bool = True
) -> nn.Module:
    """nn.Module._apply of a memory module whose tables stay on `device`: `fn` is tried on an
    empty tensor of a table's dtype; when it would change the device, the table (and its
    gradient) only takes the new dtype; otherwise (.double(), .half(), share_memory_) fn
    applies as usual."""
    tables = cast(MemoryModule, module).table_parameters()
    keep = {id(t) for p in tables for t in (p, p.grad) if t is not None}

    def placed(t: Tensor) -> Tensor:
        if id(t) not in keep:
            return fn(t)
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        if probe.device == t.device:
            return fn(t)
        return t.detach().to(device=device, dtype=probe.dtype)

    return type(module)._apply(module, placed, recurse)


def place_tables(model: nn.Module, device: str | None) -> None:
    """Move every memory table of `model` to `device` (None: nothing) and keep it there when
    the model is moved (each memory module's _apply, bound on the instance so deepcopy keeps
    it)."""
    if device is None:
        return
    check_table_device(device)
    for m in _memories(model):
        # bound on the instance (nn.Module stores a plain attribute in __dict__)
        setattr(m, "_apply", types.MethodType(partial(_unbound_host_apply, device=device), m))
    with torch.no_grad():
        for p in table_params(model):
            # meta: from_pretrained builds on the meta device; check_loaded places them after
            if not p.is_meta and p.device != torch.device(device):
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)


def _unbound_host_apply(
    module: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool = True, *, device: str
) -> nn.Module:
    return _host_apply(module, device, fn, recurse)
