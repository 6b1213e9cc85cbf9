"""Large vocabularies through transformers' Trainer: the memory tables' row-sparse update.

`memory_update` (as `optim.memory_update` of our trainer, tngram.optim.memory_update):

    dense     Trainer's optimiser on every parameter, tables included (the default)
    sparse    the tables get row-sparse gradients and LazyAdam (torch.optim.SparseAdam's lazy
              Adam): a step reads and writes only the rows its batch touched
    rowwise   as sparse, with one second moment per table row (RowwiseAdam)

`memory_catchup` (as `optim.memory_catchup`, with sparse / rowwise): the table optimiser adds the
moves dense Adam would have made at the steps a row was not read, when the row is read again;
MemoryTrainer settles the owed moves for evaluation and at the end of training, as our trainer
does (`settle_memory_tables` for an optimiser stepped elsewhere).

With sparse / rowwise the optimiser Trainer sees is a `TableSplitOptimizer`: Trainer's own
optimiser class on every group but the tables, and the table optimiser on the tables, stepped,
zeroed, scheduled (its param_groups are both lists) and checkpointed together. Gradient
clipping must take row-sparse gradients (torch's clip_grad_norm_ does not): MemoryTrainer
clips with tngram.optim.memory_update.clip_grad_norm, torch's own call when nothing is sparse.
The update rules are tngram.optim's, not written again here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tngram.common import TngramError
from tngram.optim.memory_update import (
    MEMORY_UPDATES,
    settle_tables,
    settled_tables,
    setup_memory_update,
)


class TableSplitOptimizer(torch.optim.Optimizer):
    """Two optimisers as one: `main` (Trainer's class, every non-table group) and `tables`
    (LazyAdam / RowwiseAdam). Not built through Optimizer.__init__: its param_groups are the
    two optimisers' own group dicts, so an lr scheduler editing them edits both."""

    def __init__(self, main: torch.optim.Optimizer | None, tables: torch.optim.Optimizer) -> None:
        self.optimizers = [o for o in (main, tables) if o is not None]
        self.defaults = dict(self.optimizers[0].defaults)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            raise TngramError(
                "optimizer state: expected the state of a TableSplitOptimizer with "
                f"{len(self.optimizers)} optimisers (was memory_update changed?)"
            )
        for o, sd in zip(self.optimizers, parts, strict=True):
            o.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"TableSplitOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def split_tables(
    model: nn.Module,
    groups: list[dict[str, Any]],
    memory_update: str,
    betas: tuple[float, float],
    eps: float,
    make_main: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    catchup: bool = False,
) -> torch.optim.Optimizer:
    """The optimiser of `groups` (each with "params" and "names") under memory_update: "dense"
    is make_main(groups); "sparse" / "rowwise" switch the memories to row-sparse gradients and
    return a TableSplitOptimizer (catchup: the table optimiser catches lazy rows up)."""
    check_memory_update(memory_update, catchup)
    tables, rest = setup_memory_update(model, groups, memory_update, betas, eps, catchup)
    if tables is None:
        return make_main(rest)
    return TableSplitOptimizer(make_main(rest) if rest else None, tables)


def check_memory_update(memory_update: Any, catchup: Any) -> None:
    """One TngramError for a memory_update / memory_catchup pair our trainer would refuse."""
    if memory_update not in MEMORY_UPDATES:
        raise TngramError(
            f"memory_update must be one of {list(MEMORY_UPDATES)}, got {memory_update!r}"
        )
    if not isinstance(catchup, bool):
        raise TngramError(f"memory_catchup must be True or False, got {catchup!r}")
    if catchup and memory_update == "dense":
        raise TngramError(
            "memory_catchup=True needs memory_update='sparse' or 'rowwise' "
            "(dense Adam moves every row at every step already)"
        )


def table_optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The optimisers inside `opt` (accelerate's wrapper and a TableSplitOptimizer unwrapped)."""
    inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
    return list(inner.optimizers) if isinstance(inner, TableSplitOptimizer) else [inner]


def settle_memory_tables(opt: Any) -> None:
    """memory_catchup: apply every table row's owed moves now (our trainer does it at the end of
    training); nothing without catch-up. `opt`: the optimiser Trainer holds."""
    settle_tables(table_optimizers(opt))


def settled_memory_tables(opt: Any) -> Any:
    """A context: the tables with their owed moves applied inside (for evaluation), exactly as
    before after; nothing without catch-up."""
    return settled_tables(table_optimizers(opt))


def has_sparse_grads(model: nn.Module) -> bool:
    return any(p.grad is not None and p.grad.is_sparse for p in model.parameters())
