"""Analytic training FLOPs of a GPT (with or without a memory): what `tngram plan` and the
benches count as a step's work."""

from __future__ import annotations

from typing import cast

from torch import nn


def matmul_params(model: nn.Module) -> int:
    """nn.Linear weights + the tied head (tok_emb used as the output matmul)."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tok_emb = cast(nn.Embedding, model.tok_emb)  # a GPT's input embedding (the tied head)
    return n + tok_emb.weight.numel()


def train_flops(model: nn.Module, n_layer: int, n_embd: int, seq: int, tokens: int) -> float:
    """Analytic FLOPs of a training step over `tokens` tokens (forward + backward): 6 x matmul
    params x tokens + 12 x L x d x T x tokens (attention: 12 x layers x width x
    sequence per token, as in the PaLM / nanoGPT MFU count)."""
    return float(6 * matmul_params(model) * tokens + 12 * n_layer * n_embd * seq * tokens)
