"""STEM-style token-indexed up-projection (arXiv 2601.10639): an FFN whose up-projection is a
table row chosen by the current token id, the gate and down-projection dense.

One layer (a SwiGLU FFN with W_up x replaced by U[x_t]):

    u = RMSNorm(h)                          (B, T, D)
    y = W_down( SiLU(W_gate u) * U[x_t] )   (B, T, D)   U (V, F), W_gate (F, D), W_down (D, F)

How it fits the memory contract (injection "block"): the module is an extra FFN branch whose
output is added to the residual stream of its block before attention, like the other block
memories; the block's own relu^2 MLP stays. STEM's "replace the up-projection" is obtained at
equal total parameters by paying for the table with the backbone: the iso-parameter backbone
(research.experiments.pareto.iso_backbone) shrinks every block's MLP width so that
backbone + memory has the raw GPT's parameters. SiLU gating follows STEM's SwiGLU FFN (the
backbone's MLP is relu^2 without a gate). W_down is zero-initialised (flag), so the memory starts
as a no-op, as Engram's value projection; U is N(0, 1) as an nn.Embedding. U trains as a lookup
table (row-sparse under optim.memory_update=sparse|rowwise), W_gate and W_down as matrices.

Letters: B batch, T time, D model width, F hidden width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from tngram.memory.base import MemoryConfig, MemoryModule, RowSparse
from tngram.memory.token_tables import check_inputs, gather_rows


@dataclass(kw_only=True, frozen=True)
class StemConfig(MemoryConfig):
    """hidden: F, the FFN width (0 -> 2 * d_model, the backbone MLP's width at mlp_mult 2)."""

    kind: ClassVar[str] = "stem"
    injection: ClassVar[str] = "block"
    row_sparse: ClassVar[bool] = True

    hidden: int = 0
    zero_init_down: bool = True

    def width(self, d_model: int) -> int:
        return self.hidden or 2 * d_model

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """U (V x F) + W_gate (F x D) + W_down (D x F)."""
        f = self.width(d_model)
        return vocab_size * f + 2 * d_model * f

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "Stem":
        return Stem(self, d_model=d_model, vocab_size=vocab_size)


class Stem(RowSparse, MemoryModule, nn.Module):
    """forward(h (B, T, D), input_ids (B, T)) -> (B, T, D)."""

    def __init__(self, config: StemConfig, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.config, self.d_model, self.vocab_size = config, d_model, vocab_size
        f = config.width(d_model)
        self.up = nn.Embedding(vocab_size, f)  # U: the token-indexed up-projection
        self.gate = nn.Linear(d_model, f, bias=False)
        self.down = nn.Linear(f, d_model, bias=False)
        if config.zero_init_down:
            nn.init.zeros_(self.down.weight)

    def table_parameters(self) -> list[nn.Parameter]:
        return [cast(nn.Parameter, self.up.weight)]

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h (B, T, D), input_ids (B, T) -> (B, T, D); per position, so `cache` and `valid` need
        no state."""
        check_inputs("STEM memory", h, input_ids, self.d_model, self.vocab_size)
        u = self.gate(F.rms_norm(h, (h.size(-1),)))  # (B, T, F)
        up = gather_rows(self.up.weight, input_ids.long(), self.sparse_grad)  # (B, T, F)
        return self.down(F.silu(u) * up.to(u.dtype))
