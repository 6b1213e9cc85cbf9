"""How many aten ops one optimiser step dispatches, by phase: a device-independent proxy for the
kernels it launches.

On a GPU in eager mode every dispatched aten op that computes something is (at least) one kernel
launch, and a step of many small ops is bound by launches and host waits rather than by bytes.
`step_op_counts` runs one full step of a tiny paper-l9-shaped model (forward, backward,
optimizer.step and zero_grad, as `research.bench.gpu_parts.table_step` sets the optimisers up) and
counts, per phase, the aten ops dispatched (a TorchDispatchMode sees every one, on any device) and
those of them that write a table-sized output (an output with at least as many entries as the
smallest memory table: a pass over a whole table, which a row-sparse step must not make).

Views and metadata ops (view, slice, detach, _indices, ...) are counted separately as `views`:
they launch nothing. The step counted is the second one (the first allocates the optimiser
state). CPU tensors take the CPU's code paths, e.g. the torch row update of LazyAdam /
RowwiseAdam in chunks of touched rows (`tngram.optim.lazy_rows`), where CUDA runs one Triton
kernel per table (`tngram.kernels.row_update`).

    python -m research.bench.op_counts      # the table for TN-gram and Engram, dense/sparse/rowwise
    python -m research.bench.op_counts --model tngram --set model.memory.cp_rank=16
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the tiny paper-l9 shapes: two blocks, both with a memory (paper-l9 has memory in blocks 1, 7)
TINY_L9_SETS = (
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.sequence_len=64",
    "model.memory_layers=[0,1]",
)
PHASES = ("forward", "backward", "step")
# ops that only make views or read metadata: no kernel
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "expand",
        "permute",
        "t",
        "transpose",
        "alias",
        "detach",
        "as_strided",
        "split",
        "split_with_sizes",
        "unbind",
        "narrow",
        "_indices",
        "_values",
        "indices",
        "values",
        "is_coalesced",
        "_reshape_alias",
        "unflatten",
        "flatten",
        "_record_function_enter_new",
        "_record_function_exit",
    }
)


class OpCount(TorchDispatchMode):
    """Counts dispatched aten ops by name; `big` counts those with an output of >= `big_numel`
    entries (a table-sized write)."""

    def __init__(self, big_numel: int) -> None:
        super().__init__()
        self.big_numel = big_numel
        self.ops: collections.Counter[str] = collections.Counter()
        self.big: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if _table_sized(name, out, args, self.big_numel):
            self.big[name] += 1
        return out

    def kernels(self) -> int:
        """Ops counted that compute something (VIEW_OPS left out)."""
        return sum(n for k, n in self.ops.items() if k not in VIEW_OPS)

    def table_sized(self) -> int:
        """Of those, the ops that wrote a table-sized output."""
        return sum(n for k, n in self.big.items() if k not in VIEW_OPS)


# in-place ops that write only the rows they index (their result is the whole tensor, a view)
ROW_WRITES = frozenset({"index_copy_", "index_add_", "index_put_", "index_fill_"})


def _table_sized(name: str, out: Any, args: tuple, big: int) -> bool:
    """The op writes >= `big` entries: a fresh output that large, or an in-place op (other than
    the row-indexed ROW_WRITES) on a tensor that large."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    ins = [a for a in args if torch.is_tensor(a)]
    ins += [t for a in args if isinstance(a, (tuple, list)) for t in a if torch.is_tensor(t)]
    for t in outs:
        if not torch.is_tensor(t) or t.numel() < big or t.is_sparse:
            continue
        aliased = any(t.data_ptr() == a.data_ptr() for a in ins if not a.is_sparse)
        if not aliased or name not in ROW_WRITES:
            return True
    return False


def _summary(c: OpCount) -> dict[str, Any]:
    kernels = {k: n for k, n in c.ops.items() if k not in VIEW_OPS}
    return {
        "ops": c.kernels(),
        "views": sum(n for k, n in c.ops.items() if k in VIEW_OPS),
        "table_sized": c.table_sized(),
        "by_op": dict(sorted(kernels.items())),
        "table_sized_by_op": {k: n for k, n in sorted(c.big.items()) if k not in VIEW_OPS},
    }


def step_op_counts(
    model: str = "tngram",
    update: str = "sparse",
    vocab: int = 4096,
    batch: int = 2,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Op counts per phase of the second optimiser step of paper-l9-MODEL at TINY_L9_SETS (plus
    `extra` --set strings), vocabulary `vocab`, `batch` sequences, optim.memory_update=`update`,
    on the CPU in fp32: {"forward"|"backward"|"step": {"ops", "views", "table_sized", "by_op",
    "table_sized_by_op"}, "table_numel": the smallest table's entries}."""
    from research.bench.common import step_optimizers
    from tngram.model.gpt import GPT
    from tngram.optim.groups import memory_table_params
    from tngram.train.recipes import resolve_config

    sets = list(TINY_L9_SETS) + [f"optim.memory_update={update}"] + list(extra)
    cfg = resolve_config(f"paper-l9-{model}", sets, None)
    o, m = cfg.optim, replace(cfg.model, vocab_size=vocab)
    torch.manual_seed(0)
    net = GPT(m)
    opts, _ = step_optimizers(net, o, o.memory_update, o.memory_catchup)
    tables = memory_table_params(net)
    big = min(p.numel() for p in tables) if tables else vocab * m.n_embd
    seq = torch.randint(
        0, vocab, (batch, m.sequence_len + 1), generator=torch.Generator().manual_seed(0)
    )
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    out: dict[str, Any] = {}
    for rep in range(2):  # the first step allocates the optimiser state: count the second
        counts = {p: OpCount(big) for p in PHASES}
        with counts["forward"]:
            loss = net(x, y)
        with counts["backward"]:
            loss.backward()
        with counts["step"]:
            for opt in opts:
                opt.step()
            net.zero_grad(set_to_none=True)
        out = {p: _summary(c) for p, c in counts.items()}
    out["table_numel"] = big
    return out


def op_table(
    models: tuple[str, ...] = ("tngram", "engram"),
    updates: tuple[str, ...] = ("dense", "sparse", "rowwise"),
    vocab: int = 4096,
    extra: tuple[str, ...] = (),
) -> str:
    """A markdown table of `step_op_counts`: ops (table-sized ones in brackets) per phase."""
    lines = [
        f"| paper-l9 tiny, V {vocab} | forward | backward | step | total |",
        "|---|---|---|---|---|",
    ]
    for model in models:
        for update in updates:
            r = step_op_counts(model, update, vocab, extra=extra)
            cells = [f"{r[p]['ops']} ({r[p]['table_sized']})" for p in PHASES]
            total = sum(r[p]["ops"] for p in PHASES)
            lines.append(f"| {model} {update} | " + " | ".join(cells) + f" | {total} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """python -m research.bench.op_counts [--vocab V] [--model M ...] [--set KEY=VALUE ...]:
    print op_table (models tngram and engram unless named; --set applies to each)."""
    ap = argparse.ArgumentParser(prog="python -m research.bench.op_counts")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--model", action="append", choices=("tngram", "engram"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    models = tuple(a.model or ("tngram", "engram"))
    print(op_table(models, vocab=a.vocab, extra=tuple(a.set)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["OpCount", "PHASES", "TINY_L9_SETS", "VIEW_OPS", "op_table", "step_op_counts"]
