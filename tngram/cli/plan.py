"""`tngram plan RECIPE --gpus G --gpu-mem GB`: memory and time of a recipe on G GPUs, from its
shapes.

Parameter counts come from the model built on the meta device. Activations: one sequence's
forward runs on the CPU (a few seconds at L18) with a saved-tensors hook summing the bytes
autograd keeps for the backward (each storage counted once): the activation memory of the code
as it is, not of a formula. Not on the meta device: there SDPA takes its math path, which saves
the T x T attention probabilities; CPU and GPU use fused attention kernels that save only the
output and the log-sum-exp. Per GPU (DDP: every GPU holds a full replica):

  weights fp32 4P, gradients fp32 4P, DDP gradient buckets 4P (G > 1 only),
  Adam state 8 x (Adam params: embeddings, scalars), Muon momentum 4 x (matrix params),
  memory tables/factors by optim.memory_update (what the trainer's table optimiser allocates):
  dense (the default) and sparse 8 x, rowwise 4 + 4/width x (width = a table's row length:
  Engram head_dim, Over-Encoding slice width, TN-gram cp_rank)   -> static bytes
  (--set optim.memory_update=rowwise plans the recipe with it. Under sparse/rowwise the tables
  are also left out of DDP's buckets, which then hold 4 x the other params; their gradients are
  row-sparse, the rows a micro-batch read, but the gradients line counts them dense, an upper
  bound.)
  activations per sequence: traced in fp32 or (bf16) with the model cast to bf16, which is
  what autocast saves for the matmul inputs (its fp32 norms make the real figure a little
  higher: see the margin)
  with activation checkpointing per block (the trainer does not implement it; listed for
  planning): the blocks' inputs (L x T x D) + the largest single block's activations (the
  one being recomputed) + everything outside the blocks (embedding, head, loss)

usable memory = gpu_mem x (1 - margin) - 1 GiB (CUDA context, cuBLAS/NCCL workspaces);
micro-batch = the largest divisor of the sequences one GPU needs per step whose activations
fit; gradient accumulation = global batch / (G x micro x T).
FLOPs per step = 6 x matmul params x tokens + 12 L d T x tokens (lookups and elementwise
work excluded); step time = FLOPs / (G x peak x MFU). --card names the GPU: its datasheet's
dense bf16 peak and its memory. The MFU default is what `tngram train` reached on the one card
measured so far, an H200, by this FLOP count: 0.233 compiled (run.compile=auto, the CUDA
default), 0.105 eager (run.compile=false); on any other card it is an assumption, and the plan
says so.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from tngram.cli.argtypes import float_range
from tngram.cli.common import add_set_argument

MAX_GPUS = 1 << 20  # far beyond any cluster: a bound, so the arithmetic stays finite

# name: (dense bf16 tensor-core peak in TFLOP/s from the vendor's datasheet, memory in GB)
CARDS = {
    "A100": (312.0, 80.0),  # A100 SXM4 80 GB
    "A100-40GB": (312.0, 40.0),
    "H100": (989.4, 80.0),  # H100 SXM5 (1,979 with 2:4 sparsity)
    "H100-PCIe": (756.0, 80.0),
    "H200": (989.4, 141.0),  # the H100's compute with 141 GB
    "L40S": (362.05, 48.0),
    "RTX4090": (165.2, 24.0),  # bf16 with fp32 accumulate
}
DEFAULT_CARD = "A100"  # the paper's (App. E: 4 x A100 80 GB)
# `tngram train` paper-l9-{raw,engram,tngram} on one H200 (research/results/gpu-h200-*.json): the
# median MFU of its compiled runs and of its eager runs
MEASURED_ON, MFU_COMPILED, MFU_EAGER = "H200", 0.233, 0.105


def card_named(name: str) -> str:
    """The CARDS key for `name` (case and dashes aside); TngramError listing them."""
    from tngram.common import TngramError

    plain = {k.lower().replace("-", ""): k for k in CARDS}
    key = plain.get(name.lower().replace("-", "").replace(" ", ""))
    if key is None:
        raise TngramError(
            f"--card {name!r}: not a card we know; choose one of {', '.join(CARDS)}, or give "
            f"--peak-tflops and --gpu-mem"
        )
    return key


GIB = 2**30


@contextmanager
def _count_saved(model: nn.Module) -> Iterator[dict[str, int]]:
    """Sum the bytes of tensors saved for backward, per top-level part ("block i" or "other")."""
    seen: set[tuple[int, int]] = set()
    where = {"part": "other"}
    totals: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or t.requires_grad and t.is_leaf:
            return t  # weights are counted as weights
        key = t.untyped_storage()._cdata  # the StorageImpl: views share it
        if key not in seen:
            seen.add(key)
            totals[where["part"]] = totals.get(where["part"], 0) + t.untyped_storage().nbytes()
        return t

    hooks = []
    for i, b in enumerate(getattr(model, "blocks", [])):
        hooks.append(b.register_forward_pre_hook(lambda m, a, i=i: where.update(part=f"block {i}")))
        hooks.append(b.register_forward_hook(lambda m, a, o: where.update(part="other")))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield totals
    finally:
        for h in hooks:
            h.remove()


def activation_bytes(
    model_cfg: Any, seqs: int = 1, dtype: str = "bf16", device: str = "cpu"
) -> dict[str, Any]:
    """Saved-for-backward bytes of one forward of `seqs` sequences ({"total", "per_part"})."""
    from tngram.model.gpt import GPT

    with torch.device(device):
        model = GPT(model_cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    T, V = model_cfg.sequence_len, model_cfg.vocab_size
    ids = torch.randint(0, V, (seqs, T), generator=torch.Generator().manual_seed(0)).to(device)
    with _count_saved(model) as parts:
        loss = model(ids, ids)
    del loss
    return {"total": sum(parts.values()), "per_part": parts}


def state_bytes(model: nn.Module, optim_cfg: Any) -> dict[str, int]:
    """Optimiser state of `model` (meta device is fine) as the trainer allocates it under
    `optim_cfg` ({"adam_state", "muon_state", "memory_table_state", "memory_table_params"}):
    the memory tables under optim.memory_update, the rest under their group's optimiser."""
    from tngram.optim.groups import build_param_groups, memory_table_params
    from tngram.optim.memory_update import param_state_bytes

    tables = {id(p) for p in memory_table_params(model)}
    out = {"adam_state": 0, "muon_state": 0, "memory_table_state": 0, "memory_table_params": 0}
    for g in build_param_groups(model, optim_cfg):
        for p in g["params"]:
            table = id(p) in tables
            b = param_state_bytes(
                g["optimizer"], p.shape, optim_cfg.memory_update, table, optim_cfg.memory_catchup
            )
            out["memory_table_state" if table else f"{g['optimizer']}_state"] += b
            out["memory_table_params"] += p.numel() if table else 0
    return out


def speed(
    cfg: Any,
    gpus: int = 1,
    card: str = DEFAULT_CARD,
    mfu: float | None = None,
    peak_tflops: float | None = None,
) -> dict[str, Any]:
    """FLOPs per optimiser step of `cfg` (a TrainConfig) and its time on `gpus` cards named
    `card`, at `mfu` (default: the measured one, MFU_COMPILED or MFU_EAGER by run.compile)."""
    from tngram.model.flops import train_flops
    from tngram.model.gpt import GPT

    card = card_named(card)
    peak = CARDS[card][0] if peak_tflops is None else peak_tflops
    source = "given"
    if mfu is None:
        compiled = cfg.run.compile is not False
        mfu = MFU_COMPILED if compiled else MFU_EAGER
        on = "measured" if card == MEASURED_ON else f"assumed: measured on an {MEASURED_ON}"
        source = f"{on}, `tngram train` {'compiled' if compiled else 'eager'}"
    m = cfg.model
    with torch.device("meta"):
        model = GPT(m)
    tokens = cfg.data.global_batch_tokens // m.sequence_len * m.sequence_len
    flops = float(train_flops(model, m.n_layer, m.n_embd, m.sequence_len, tokens))
    step_s = flops / (gpus * peak * 1e12 * mfu)
    return {
        "card": card,
        "flops_per_step": flops,
        "peak_tflops": peak,
        "mfu": mfu,
        "mfu_source": source,
        "step_seconds": step_s,
        "tokens_per_s": tokens / step_s,
    }


def plan(
    recipe: str,
    gpus: int,
    gpu_mem_gb: float | None = None,
    dtype: str = "bf16",
    mfu: float | None = None,
    peak_tflops: float | None = None,
    margin: float = 0.1,
    overrides: list[str] | tuple[str, ...] = (),
    card: str = DEFAULT_CARD,
) -> dict[str, Any]:
    """The plan of `recipe` on `gpus` cards named `card` (CARDS); gpu_mem_gb, peak_tflops and
    mfu replace the card's values and the measured MFU."""
    from tngram.common import TngramError
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.train.recipes import get_recipe, resolve_config

    card = card_named(card)
    cfg = resolve_config(recipe, list(overrides)) if overrides else get_recipe(recipe)
    gpu_mem_gb = CARDS[card][1] if gpu_mem_gb is None else gpu_mem_gb
    if not 1 <= gpus <= MAX_GPUS:
        raise TngramError(f"--gpus must be an int in [1, {MAX_GPUS}], got {gpus}")
    if gpu_mem_gb <= 1:
        raise TngramError(f"--gpu-mem must be > 1 (GB per GPU), got {gpu_mem_gb}")
    if mfu is not None and not 0 < mfu <= 1:
        raise TngramError(f"--mfu must lie in (0, 1], got {mfu}")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise TngramError(f"--peak-tflops must be a finite number > 0, got {peak_tflops}")
    if not math.isfinite(gpu_mem_gb):
        raise TngramError(f"--gpu-mem must be finite, got {gpu_mem_gb}")
    m = cfg.model
    with torch.device("meta"):
        model = GPT(m)
    P = model.num_params()
    groups = build_param_groups(model, cfg.optim)
    adam_p = sum(p.numel() for g in groups if g["optimizer"] == "adam" for p in g["params"])
    muon_p = sum(p.numel() for g in groups if g["optimizer"] == "muon" for p in g["params"])
    st = state_bytes(model, cfg.optim)
    bucketed = P - (st["memory_table_params"] if cfg.optim.memory_update != "dense" else 0)
    static = {
        "weights": 4 * P,
        "gradients": 4 * P,
        "ddp_buckets": 4 * bucketed if gpus > 1 else 0,
        "adam_state": st["adam_state"],
        "muon_state": st["muon_state"],
        "memory_table_state": st["memory_table_state"],
    }
    static_total = sum(static.values())
    act = activation_bytes(m, 1, dtype)
    per_seq = act["total"]
    blocks = {k: v for k, v in act["per_part"].items() if k.startswith("block")}
    elt = 2 if dtype == "bf16" else 4
    ckpt = (
        m.n_layer * m.sequence_len * m.n_embd * elt
        + max(blocks.values(), default=0)
        + act["per_part"].get("other", 0)
    )
    T = m.sequence_len
    seqs_per_step = cfg.data.global_batch_tokens // T
    if seqs_per_step % gpus:
        raise TngramError(
            f"--gpus {gpus}: one optimiser step holds {seqs_per_step} sequences "
            f"(data.global_batch_tokens / model.sequence_len), which {gpus} GPUs cannot share "
            f"(the trainer needs sequences = GPUs x micro-batch x accumulation); use a divisor "
            f"of {seqs_per_step} GPUs or --set data.global_batch_tokens=..."
        )
    need = math.ceil(seqs_per_step / gpus)  # sequences per GPU per optimiser step
    usable = gpu_mem_gb * 1e9 * (1 - margin) - GIB - static_total

    def fit(per: float) -> dict[str, Any]:
        most = max(0, min(need, int(usable // per))) if usable > 0 else 0
        # the trainer needs global batch = G x micro x accum x T: a divisor of the per-GPU share
        micro = max((d for d in range(1, most + 1) if need % d == 0), default=0)
        accum = need // micro if micro else None
        return {
            "activation_bytes_per_seq": per,
            "micro_batch_seqs": micro,
            "grad_accum": accum,
            "fits": micro > 0,
            "peak_bytes": static_total + GIB + micro * per if micro else None,
        }

    pace = speed(cfg, gpus, card, mfu, peak_tflops)
    return {
        "recipe": recipe,
        "gpus": gpus,
        "gpu_mem_gb": gpu_mem_gb,
        "dtype": dtype,
        "params": P,
        "memory_params": model.memory_params(),
        "adam_params": adam_p,
        "muon_params": muon_p,
        "memory_table_params": st["memory_table_params"],
        "memory_update": cfg.optim.memory_update,
        "static_bytes": static,
        "static_total_bytes": static_total,
        "usable_bytes": usable,
        "margin": margin,
        "global_batch_tokens": cfg.data.global_batch_tokens,
        "seqs_per_step": seqs_per_step,
        "seqs_per_gpu_per_step": need,
        "recipe_micro_batch_seqs": cfg.data.micro_batch_seqs,
        "no_checkpointing": fit(per_seq),
        "block_checkpointing": fit(ckpt),
        "activation_parts": act["per_part"],
        **pace,
        "steps": cfg.schedule.steps,
        "train_hours": pace["step_seconds"] * cfg.schedule.steps / 3600,
    }


def report(r: dict[str, Any]) -> str:
    g = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    st = r["static_bytes"]
    lines = [
        f"tngram plan {r['recipe']}: {r['gpus']} x {r['card']} ({r['gpu_mem_gb']:g} GB, "
        f"{r['peak_tflops']:g} TFLOP/s bf16 dense), {r['dtype']}",
        f"parameters       {r['params']:,} (memory {r['memory_params']:,}; Adam "
        f"{r['adam_params'] - r['memory_table_params']:,} + memory tables "
        f"{r['memory_table_params']:,}, "
        f"Muon {r['muon_params']:,})",
        f"per GPU static   {g(r['static_total_bytes'])} = weights {g(st['weights'])} + grads "
        f"{g(st['gradients'])} + DDP buckets {g(st['ddp_buckets'])} + Adam {g(st['adam_state'])} "
        f"+ Muon {g(st['muon_state'])} + memory tables {g(st['memory_table_state'])} "
        f"({r['memory_table_params']:,} params, optim.memory_update={r['memory_update']})",
        f"usable for activations {g(max(0.0, r['usable_bytes']))} ({r['margin']:.0%} margin, 1 GiB "
        f"CUDA context/workspaces)",
        f"global batch     {r['global_batch_tokens']:,} tokens = {r['seqs_per_step']} sequences; "
        f"{r['seqs_per_gpu_per_step']} per GPU per step (recipe micro-batch "
        f"{r['recipe_micro_batch_seqs']})",
    ]
    for key, label in (
        ("no_checkpointing", "no checkpointing"),
        ("block_checkpointing", "block checkpointing (not in the trainer)"),
    ):
        f = r[key]
        if f["fits"]:
            lines.append(
                f"{label:42s} {g(f['activation_bytes_per_seq'])}/sequence -> micro-batch "
                f"{f['micro_batch_seqs']}, grad accum {f['grad_accum']}, peak ~{g(f['peak_bytes'])}"
            )
        else:
            lines.append(f"{label:42s} {g(f['activation_bytes_per_seq'])}/sequence -> does NOT fit")
    lines.append(
        f"FLOPs per step   {r['flops_per_step']:.3e} -> {r['step_seconds']:.2f} s/step at "
        f"MFU {r['mfu']:.1%} ({r['mfu_source']}) of {r['peak_tflops']:g} TFLOP/s per GPU; "
        f"{r['steps']} steps ~ {r['train_hours']:.2f} h, {r['tokens_per_s']:,.0f} tokens/s"
    )
    return "\n".join(lines)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="memory, micro-batch, accumulation and step time of a recipe on GPUs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", help="a named recipe (see `tngram recipes`)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (DDP, one process each)")
    p.add_argument(
        "--card",
        default=DEFAULT_CARD,
        metavar="NAME",
        help=f"the GPU: {', '.join(CARDS)} (its bf16 peak and memory)",
    )
    p.add_argument(
        "--gpu-mem",
        type=float_range(1.0, 1e6, lo_open=True),
        default=None,
        help="memory per GPU in GB (default: the card's)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activation precision")
    p.add_argument(
        "--mfu",
        type=float_range(0.0, 1.0, lo_open=True),
        default=None,
        help=f"model FLOP utilisation, in (0, 1] (default: `tngram train`'s on an "
        f"{MEASURED_ON}: {MFU_COMPILED} compiled, {MFU_EAGER} with run.compile=false)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float_range(0.0, 1e6, lo_open=True),
        default=None,
        help="peak per GPU in TFLOP/s (default: the card's dense bf16 peak)",
    )
    add_set_argument(
        p,
        help="override one config key of the recipe, as for `tngram train` "
        "(repeatable), e.g. --set optim.memory_update=rowwise: the memory tables' "
        "optimiser state drops from 8 to 4 + 4/width bytes per parameter",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    r = plan(
        args.recipe,
        args.gpus,
        args.gpu_mem,
        args.dtype,
        args.mfu,
        args.peak_tflops,
        overrides=args.overrides,
        card=args.card,
    )
    print(json.dumps(r, indent=1) if args.json else report(r))
    return 0
