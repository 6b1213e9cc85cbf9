"""Validation loss and bits-per-byte, exactly as parameter-golf scores a model (train_gpt.py's
eval_val).

The validation stream is cut into non-overlapping windows of `seq_len` tokens (every window starts
with zero context); window w predicts tokens[w*T + 1 : (w+1)*T + 1] from tokens[w*T : (w+1)*T].
Windows are split contiguously across processes. For every target t with previous token p:

    nats  = cross-entropy of t                        (summed in float64)
    bytes = base_bytes[t] + (has_leading_space[t] and not is_boundary[p])

    val_loss = sum(nats) / n_targets
    val_bpb  = sum(nats) / (ln 2 * sum(bytes))        = (val_loss / ln 2) * n_targets / n_bytes

Sums are all-reduced over the default process group when world_size > 1. The byte count comes
from `tngram.data.bpb.target_bytes` with the tokenizer's LUTs (`token_byte_luts`).

The model is only called: `model(ids (B, T), targets (B, T), reduction="none")` must return the
per-target cross-entropy in nats, shape (B*T,) or (B, T) (tngram.model.gpt.GPT does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tngram.common import TngramError
from tngram.data.bpb import target_bytes


def eval_windows(n_tokens: int, seq_len: int, max_tokens: int | None = None) -> int:
    """Number of whole windows of seq_len targets in a stream of n_tokens (+1 for the last
    target)."""
    usable = n_tokens - 1
    if max_tokens is not None:
        usable = min(usable, max_tokens)
    return max(usable, 0) // seq_len


@torch.no_grad()
def evaluate_bpb(
    model: Callable[..., Tensor],
    val_tokens: Tensor,
    seq_len: int,
    luts: Any,
    batch_seqs: int,
    ddp_rank: int = 0,
    world_size: int = 1,
    autocast_dtype: torch.dtype | None = None,
    max_tokens: int | None = None,
    lockstep: bool = False,
) -> dict[str, float | int]:
    """{"val_loss", "val_bpb", "tokens", "bytes"} over the first max_tokens targets (None: all).

    lockstep: every process makes the same number of forward calls (a sharded FSDP model's
    forward is collective); a process with fewer windows repeats window 0 and discards it.

    val_tokens: 1-D int tensor (the validation stream); luts: (base_bytes, has_leading_space,
    is_boundary) from tngram.data.bpb.token_byte_luts. Every process must call this (collective).
    """
    if val_tokens.dim() != 1:
        raise TngramError(f"val_tokens must be 1-D, got shape {tuple(val_tokens.shape)}")
    if seq_len < 1 or batch_seqs < 1:
        raise TngramError(f"seq_len and batch_seqs must be >= 1, got {seq_len}, {batch_seqs}")
    if max_tokens is not None and max_tokens < seq_len:
        raise TngramError(
            f"the validation cap (data.val_tokens / --max-tokens) is {max_tokens} targets, below "
            f"one window of sequence_len {seq_len}; raise it to at least {seq_len}"
        )
    n_windows = eval_windows(val_tokens.numel(), seq_len, max_tokens)
    if n_windows == 0:
        raise TngramError(
            f"validation split has {val_tokens.numel()} tokens, fewer than one window "
            f"of seq_len {seq_len} (+1); use a larger val split or a smaller sequence_len"
        )
    first = n_windows * ddp_rank // world_size
    last = n_windows * (ddp_rank + 1) // world_size
    device = _device_of(model)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    n_targets = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    ctx = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else nullcontext()
    )
    for w0 in range(first, last, batch_seqs):
        w1 = min(w0 + batch_seqs, last)
        chunk = val_tokens[w0 * seq_len : w1 * seq_len + 1].to(device=device, dtype=torch.int64)
        x = chunk[:-1].view(w1 - w0, seq_len)  # (B, T)
        y = chunk[1:].view(w1 - w0, seq_len)  # (B, T)
        with ctx:
            per_token = model(x, y, reduction="none")
        nats += per_token.double().sum()
        n_targets += y.numel()
        n_bytes += target_bytes(x, y, luts).to(device=device, dtype=torch.int64).sum()
    if lockstep and world_size > 1:
        calls = lambda r: (
            -(
                -(n_windows * (r + 1) // world_size - n_windows * r // world_size)  # noqa: E731
                // batch_seqs
            )
        )
        x0 = val_tokens[:seq_len].to(device=device, dtype=torch.int64).view(1, seq_len)
        for _ in range(max(calls(r) for r in range(world_size)) - calls(ddp_rank)):
            with ctx:
                model(x0, x0, reduction="none")
    if world_size > 1:
        for t in (nats, n_targets, n_bytes):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if was_training and hasattr(model, "train"):
        model.train()
    total_nats, tokens, n_b = float(nats), int(n_targets), int(n_bytes)
    if n_b == 0:
        raise TngramError("validation targets cover 0 bytes; the tokenizer LUTs look wrong")
    return {
        "val_loss": total_nats / tokens,
        "val_bpb": total_nats / (math.log(2) * n_b),
        "tokens": tokens,
        "bytes": n_b,
    }


def _device_of(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")
