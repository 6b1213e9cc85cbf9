"""Which parameter goes to which optimiser with which learning rate: one declared rule table.

parameter-golf (train_gpt.py) puts block matrices in Muon and the tied embedding and
scalars in Adam; its rule only looks inside `blocks`, so a new 2-D module elsewhere silently gets
no optimiser. Here every parameter must match a rule (else a TngramError names it), and the
memory modules are covered explicitly (docs/TRAINING.md "Parameter groups"):

    group         optimiser  lr                              what
    embed         Adam       tied_embed_lr (0.05)            tok_emb.weight (the tied head too)
    memory_table  Adam       memory_table_lr or tied_emb_lr  every memory's table_parameters():
                                                             TN-gram CP factors, Engram / OE tables
    scalar        Adam       scalar_lr (0.04)                control_parameters() of the GPT and of
                                                             each memory (gains, scales, depthwise
                                                             conv kernels), every 1-D parameter
    muon          Muon       matrix_lr (0.04)                every nn.Linear weight: attention,
                                                             MLP, memory K/V, OE projection

Rules are tried in order; the first match decides. Tables come before matrices, so an embedding
table can never reach Muon. This module imports neither the model nor a memory: the modules
declare their tables and control parameters (`table_parameters()` / `control_parameters()`,
the contract of tngram.memory.base), the rest is decided by the torch module type (nn.Linear)
and the shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn

from tngram.common import TngramError

GROUP_OPTIMIZER = {"embed": "adam", "memory_table": "adam", "scalar": "adam", "muon": "muon"}


class OptimLrs(Protocol):
    """The learning-rate fields build_param_groups reads (tngram.train.config.OptimConfig, a
    frozen dataclass: read-only members)."""

    @property
    def matrix_lr(self) -> float: ...

    @property
    def tied_embed_lr(self) -> float: ...

    @property
    def memory_table_lr(self) -> float | None: ...

    @property
    def scalar_lr(self) -> float: ...


@dataclass(frozen=True)
class ParamRule:
    group: str  # key of GROUP_OPTIMIZER
    what: str  # human description (printed, documented)
    matches: Callable[[str, Tensor, nn.Module], bool]  # (full name, parameter, owning module)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def declared_parameters(model: nn.Module, method: str) -> list[nn.Parameter]:
    """The parameters the model's modules declare through `method` ("table_parameters" or
    "control_parameters", tngram.memory.base.MemoryModule and GPT), each once, in module order."""
    out: dict[int, nn.Parameter] = {}
    for m in model.modules():
        declare = getattr(m, method, None)
        if callable(declare):
            out.update((id(p), p) for p in declare())
    return list(out.values())


def default_rules(model: nn.Module) -> tuple[ParamRule, ...]:
    """The rule table of `model`, in priority order."""
    tables = {id(p) for p in declared_parameters(model, "table_parameters")}
    controls = {id(p) for p in declared_parameters(model, "control_parameters")}
    return (
        ParamRule(
            "embed",
            "token embedding tok_emb.weight (tied head)",
            lambda n, p, m: n == "tok_emb.weight",
        ),
        ParamRule(
            "memory_table",
            "memory lookup tables (each memory's table_parameters(): TN-gram "
            "CP factors, Engram / Over-Encoding tables)",
            lambda n, p, m: id(p) in tables,
        ),
        ParamRule(
            "scalar",
            "control parameters (control_parameters() of the GPT and of each memory: "
            "gains, scales, absorption vectors, depthwise conv kernels)",
            lambda n, p, m: id(p) in controls,
        ),
        ParamRule("scalar", "1-D parameters (biases, gains)", lambda n, p, m: p.dim() < 2),
        ParamRule(
            "muon",
            "nn.Linear weights (attention, MLP, memory K/V, OE projection)",
            lambda n, p, m: isinstance(m, nn.Linear) and _leaf(n) == "weight" and p.dim() == 2,
        ),
    )


def _owner(model: nn.Module, name: str) -> nn.Module:
    path = name.rsplit(".", 1)[0] if "." in name else ""
    return model.get_submodule(path) if path else model


def assign_groups(model: nn.Module, rules: tuple[ParamRule, ...] | None = None) -> dict[str, str]:
    """{parameter name: group} for every trainable parameter; TngramError if one matches no rule."""
    rules = default_rules(model) if rules is None else rules
    out: dict[str, str] = {}
    unmatched = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = _owner(model, name)
        group = next((r.group for r in rules if r.matches(name, p, owner)), None)
        if group is None:
            unmatched.append(f"{name} {tuple(p.shape)}")
        else:
            out[name] = group
    if unmatched:
        raise TngramError(
            "parameters matched no optimiser rule (add a rule in "
            "tngram/optim/groups.py): " + ", ".join(unmatched)
        )
    return out


def group_lrs(optim_cfg: OptimLrs) -> dict[str, float]:
    """Base learning rate of each group (before the schedule's multiplier)."""
    table_lr = optim_cfg.memory_table_lr
    return {
        "embed": optim_cfg.tied_embed_lr,
        "memory_table": optim_cfg.tied_embed_lr if table_lr is None else table_lr,
        "scalar": optim_cfg.scalar_lr,
        "muon": optim_cfg.matrix_lr,
    }


def build_param_groups(
    model: nn.Module, optim_cfg: OptimLrs, rules: tuple[ParamRule, ...] | None = None
) -> list[dict]:
    """Param groups for torch optimisers, in the fixed order embed, memory_table, scalar, muon.

    Each dict: params, names, group, optimizer ("adam" | "muon"), lr and base_lr (equal at build
    time; the trainer sets lr = base_lr * schedule multiplier). Empty groups are left out.
    """
    assignment = assign_groups(model, rules)
    lrs = group_lrs(optim_cfg)
    named = dict(model.named_parameters())
    groups = []
    for group in GROUP_OPTIMIZER:
        names = [n for n, g in assignment.items() if g == group]
        if names:
            groups.append(
                {
                    "params": [named[n] for n in names],
                    "names": names,
                    "group": group,
                    "optimizer": GROUP_OPTIMIZER[group],
                    "lr": lrs[group],
                    "base_lr": lrs[group],
                }
            )
    return groups


def format_param_table(groups: list[dict]) -> str:
    """A printable table: group, optimiser, base lr, number of tensors and of parameters."""
    lines = [f"{'group':13s} {'optimizer':9s} {'lr':>8s} {'tensors':>7s} {'params':>12s}"]
    total_t = total_p = 0
    for g in groups:
        n_t, n_p = len(g["params"]), sum(p.numel() for p in g["params"])
        total_t, total_p = total_t + n_t, total_p + n_p
        lines.append(
            f"{g['group']:13s} {g['optimizer']:9s} {g['base_lr']:8.4g} {n_t:7d} {n_p:12,d}"
        )
    lines.append(f"{'total':13s} {'':9s} {'':>8s} {total_t:7d} {total_p:12,d}")
    return "\n".join(lines)


# ---- any model (e.g. a transformers model with tngram.hf.add_memory) -------------------------


def memory_table_params(model: nn.Module) -> list[nn.Parameter]:
    """The memory lookup tables of any model, as its memory modules declare them
    (`table_parameters()`: TN-gram CP factors, Engram / Over-Encoding n-gram tables)."""
    return declared_parameters(model, "table_parameters")


def split_memory_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(memory tables/factors, every other parameter) of any model, trainable ones only, each
    parameter once (tied weights are listed once), in model.parameters() order.

    For your own trainer: give the first list to Adam at the table learning rate and never to
    Muon (an n-gram table is a lookup table, not a matrix acting on activations); the second
    list is everything else (backbone, memory K/V projections, gates, conv), for your usual rules.
    """
    table_ids = {id(p) for p in memory_table_params(model)}
    tables: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():  # deduplicates shared parameters
        if p.requires_grad:
            (tables if id(p) in table_ids else rest).append(p)
    return tables, rest


def memory_param_groups(
    model: nn.Module, table_lr: float, lr: float | None = None, table_weight_decay: float = 0.0
) -> list[dict]:
    """torch.optim param groups: [memory tables at table_lr (weight decay table_weight_decay,
    default 0), everything else (at `lr` if given, else the optimiser's default)]. Each group
    carries a "group" name ("memory_table" / "rest"); empty groups are left out.

        opt = torch.optim.AdamW(memory_param_groups(model, table_lr=0.05), lr=3e-4)
    """
    tables, rest = split_memory_params(model)
    groups = []
    if tables:
        groups.append(
            {
                "params": tables,
                "lr": table_lr,
                "weight_decay": table_weight_decay,
                "group": "memory_table",
            }
        )
    if rest:
        groups.append({"params": rest, "group": "rest", **({} if lr is None else {"lr": lr})})
    return groups
