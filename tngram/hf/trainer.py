"""Training a model with a memory through transformers' `Trainer`: the optimiser recipe.

`Trainer`'s own optimiser puts `TrainingArguments.weight_decay` on every weight that is not a
bias or a norm, so it decays the n-gram tables (Engram / Over-Encoding tables, TN-gram CP
factors) and the memories' gains and conv kernels. A table row is trained only when its n-gram
occurs; decay shrinks every other row at every step, so rarely seen rows fade (our own trainer
never decays them, tngram.optim.groups). The recipe here:

    group          params                                          lr             weight decay
    memory_table   each memory's table_parameters()                table_lr       0
    memory_control each memory's control_parameters()              args lr        0
    decay          everything else Trainer would decay             args lr        args.weight_decay
    no_decay       everything else (biases, norms)                 args lr        0

with the optimiser class and its other settings (betas, eps, `optim=`) taken from the
TrainingArguments, as Trainer does. Two ways in:

    trainer = MemoryTrainer(model=model, args=args, train_dataset=ds, memory_table_lr=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizers=(memory_optimizer(model, args, table_lr=1e-2), None))

(row-sparse table updates need MemoryTrainer: a plain Trainer takes the gradient norm with
torch's clip_grad_norm_, which fails on sparse gradients). The table group comes last, so the
learning_rate Trainer logs is the args' lr; MemoryTrainer logs memory_table_lr beside it.

Accumulated micro-steps (gradient_accumulation_steps > 1) with row-sparse tables: torch adds
each micro-step's sparse gradient to `p.grad` by concatenation, copying the growing gradient
once per micro-step (k(k+1)/2 - 1 micro-steps' worth of rows for k). MemoryTrainer runs the
micro-steps of one optimiser step inside tngram.kernels.sparse_rows.accumulate_at_exit, as our
trainer does: their gradients are set aside and concatenated once, after the window's last
backward (Trainer's `sync_gradients` step) and before clipping, the norm and the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers import trainer as hf_trainer

from tngram.common import TngramError
from tngram.hf.attach import memory_modules
from tngram.hf.classes import MEMORY_ATTR
from tngram.hf.table_update import (
    check_memory_update,
    has_sparse_grads,
    settle_memory_tables,
    settled_memory_tables,
    split_tables,
)
from tngram.kernels.sparse_rows import accumulate_at_exit
from tngram.optim.memory_update import clip_grad_norm


def memory_param_groups_for_trainer(
    model: nn.Module,
    args: TrainingArguments,
    table_lr: float | None = None,
    decay_names: set[str] | None = None,
) -> list[dict[str, Any]]:
    """The four param groups of the recipe (empty ones left out); trainable parameters only,
    each once. decay_names: the names Trainer decays (default: Trainer's rule)."""
    lr = float(args.learning_rate)
    table_lr = lr if table_lr is None else float(table_lr)
    if not table_lr > 0:
        raise TngramError(f"table_lr must be > 0, got {table_lr!r}")
    if decay_names is None:
        # Trainer's rule (an instance method that does not read self: called with None)
        get_names: Any = Trainer.get_decay_parameter_names
        decay_names = set(get_names(None, model))
    mems = list(memory_modules(model).values())
    tables = {id(p) for m in mems for p in getattr(m, "table_parameters", list)()}
    controls = {id(p) for m in mems for p in getattr(m, "control_parameters", list)()}
    groups: dict[str, dict[str, Any]] = {
        "memory_table": {"params": [], "names": [], "lr": table_lr, "weight_decay": 0.0},
        "memory_control": {"params": [], "names": [], "lr": lr, "weight_decay": 0.0},
        "decay": {"params": [], "names": [], "lr": lr, "weight_decay": float(args.weight_decay)},
        "no_decay": {"params": [], "names": [], "lr": lr, "weight_decay": 0.0},
    }
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        key = (
            "memory_table"
            if id(p) in tables
            else "memory_control"
            if id(p) in controls
            else "decay"
            if name in decay_names
            else "no_decay"
        )
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    # the table group last: Trainer logs the first group's lr as `learning_rate`, which is then
    # the args' lr whatever the memory_update (dense puts every group in one optimiser, sparse /
    # rowwise the tables in their own after the rest); MemoryTrainer logs memory_table_lr beside
    order = ("decay", "no_decay", "memory_control", "memory_table")
    return [{**groups[k], "group": k} for k in order if groups[k]["params"]]


def memory_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    table_lr: float | None = None,
    decay_names: set[str] | None = None,
    memory_update: str = "dense",
    memory_catchup: bool = False,
) -> torch.optim.Optimizer:
    """The optimiser Trainer would build from `args`, with the recipe's groups: pass it as
    `Trainer(..., optimizers=(memory_optimizer(model, args, table_lr), None))`.

    memory_update: "dense" (Trainer's optimiser on the tables too), "sparse" (LazyAdam on
    row-sparse table gradients) or "rowwise" (RowwiseAdam), with betas and eps from `args`
    (tngram.hf.table_update) need MemoryTrainer, and are refused here: a plain Trainer takes
    the gradient norm with torch's clip_grad_norm_ at every step (max_grad_norm=0 included),
    which fails on row-sparse gradients. MemoryTrainer computes it, and clips, with them.
    memory_catchup: with sparse / rowwise, lazy rows catch up on the moves dense Adam would have
    made while they were not read (our trainer's optim.memory_catchup)."""
    check_memory_update(memory_update, memory_catchup)
    if memory_update != "dense":
        raise TngramError(
            f"memory_update={memory_update!r} gives the tables row-sparse gradients, whose norm "
            "a plain Trainer cannot take (torch's clip_grad_norm_, at every step, even with "
            "max_grad_norm=0): use MemoryTrainer(..., memory_update=...), which takes the norm "
            "and clips with them"
        )
    return _memory_optimizer(model, args, table_lr, decay_names, memory_update, memory_catchup)


def _memory_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    table_lr: float | None,
    decay_names: set[str] | None,
    memory_update: str,
    memory_catchup: bool,
) -> torch.optim.Optimizer:
    """memory_optimizer without the clipping check (MemoryTrainer clips row-sparse gradients)."""
    check_memory_update(memory_update, memory_catchup)
    if not memory_modules(model):
        raise TngramError("memory_optimizer: the model has no n-gram memory (tngram.hf.add_memory)")
    # it reads only `args` here; the model may be a peft wrapper (an nn.Module)
    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, cast(PreTrainedModel, model))
    opt_kwargs = {k: v for k, v in opt_kwargs.items() if k not in ("lr", "weight_decay")}
    groups = memory_param_groups_for_trainer(model, args, table_lr, decay_names)

    def make_main(gs: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return opt_cls(gs, lr=float(args.learning_rate), **opt_kwargs)

    betas = (float(args.adam_beta1), float(args.adam_beta2))
    eps = float(args.adam_epsilon)
    return split_tables(model, groups, memory_update, betas, eps, make_main, memory_catchup)


@contextlib.contextmanager
def _memory_as_adapter(model: Any) -> Any:
    """Within the block, Trainer's check that a quantized model has trainable (peft) adapters
    passes a model whose memory is its only trainable part."""
    if not getattr(model, "is_quantized", False) or not memory_modules(model):
        yield
        return
    for name, p in model.named_parameters():
        if p.requires_grad and MEMORY_ATTR not in name.split("."):
            raise TngramError(
                f"MemoryTrainer: {name} would train, but the base is quantized: only its memory "
                "can (add_memory / load_memory with trainable='memory')"
            )
    check = hf_trainer.validate_quantization_for_training
    hf_trainer.validate_quantization_for_training = lambda m: None
    try:
        yield
    finally:
        hf_trainer.validate_quantization_for_training = check


class MemoryTrainer(Trainer):
    """`Trainer` whose default optimiser follows the recipe (memory tables and factors without
    weight decay, at `memory_table_lr`, default the args' learning rate), with the tables'
    `memory_update` ("dense" | "sparse" | "rowwise", see memory_optimizer) and
    `memory_catchup`; its gradient clipping takes row-sparse gradients. With catch-up, rows owed
    moves are settled for evaluate() / predict() (weights restored after) and at the end of
    train(), as our trainer does. Row-sparse gradients of accumulated micro-steps are added up
    once per optimiser step (module docstring). On a quantized base (bitsandbytes), which
    Trainer refuses without peft adapters, the memory is the adapter: it trains with the
    backbone frozen (add_memory trainable="memory"); a trainable backbone is refused."""

    def __init__(
        self,
        *args: Any,
        memory_table_lr: float | None = None,
        memory_update: str = "dense",
        memory_catchup: bool = False,
        **kwargs: Any,
    ) -> None:
        check_memory_update(memory_update, memory_catchup)
        self.memory_table_lr = memory_table_lr
        self.memory_update = memory_update
        self.memory_catchup = memory_catchup
        self._window: contextlib.ExitStack | None = None  # open accumulate_at_exit()
        with _memory_as_adapter(kwargs.get("model", args[0] if args else None)):
            super().__init__(*args, **kwargs)
        self.optimizer: torch.optim.Optimizer | None  # Trainer's (built by create_optimizer)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = super().train(*args, **kwargs)
        finally:
            self._close_window()  # never leave the deferral on past train()
        settle_memory_tables(self.optimizer)  # catch-up: rows owed moves get them
        return out

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """Trainer's micro-step, inside the optimiser step's accumulate_at_exit window: opened
        by the window's first micro-step, closed after the one Trainer syncs on (its last)."""
        if self._window is None:
            self._window = contextlib.ExitStack()
            self._window.enter_context(accumulate_at_exit())
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self._close_window()
            raise
        if self.accelerator.sync_gradients:
            self._close_window()
        return loss

    def _close_window(self) -> None:
        """The window's set-aside gradients become each table's p.grad (no-op when closed)."""
        window, self._window = self._window, None
        if window is not None:
            window.close()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log; where it logs `learning_rate` (the args' lr on its schedule: the first
        param group's), the tables' lr on the same schedule is logged beside as memory_table_lr."""
        if "learning_rate" in logs and self.optimizer is not None:
            groups = self.optimizer.param_groups
            tables = [g for g in groups if g.get("group") == "memory_table"]
            if tables and tables[0] is not groups[0]:
                # Trainer's schedules scale every group's initial lr by one factor
                scale = float(tables[0].get("initial_lr", tables[0]["lr"])) / float(
                    groups[0].get("initial_lr", groups[0]["lr"])
                )
                logs = {**logs, "memory_table_lr": float(logs["learning_rate"]) * scale}
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with settled_memory_tables(self.optimizer):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with settled_memory_tables(self.optimizer):
            return super().predict(*args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        self._close_window()  # already closed by the last micro-step; never clip without it
        if not has_sparse_grads(model):
            return super()._clip_grad_norm(model)
        return clip_grad_norm(model.parameters(), float(self.args.max_grad_norm))

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        self._close_window()  # Trainer calls this before every optimiser step
        if grad_norm is None and has_sparse_grads(model):
            grad_norm = clip_grad_norm(model.parameters(), float("inf"))  # the norm, no clip
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            assert opt_model is not None  # Trainer has its model by the time it builds one
            self.optimizer = _memory_optimizer(
                opt_model,
                self.args,
                self.memory_table_lr,
                set(self.get_decay_parameter_names(opt_model)),
                self.memory_update,
                self.memory_catchup,
            )
        return self.optimizer
