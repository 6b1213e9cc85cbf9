"""Per-layer token embeddings in the style of Gemma 3n's PLE: a small table per memory layer,
indexed by the token id, projected to the model width and added to the residual stream.

One layer:

    e = E_l[x_t]                                  (B, T, P)   E_l: (V, P), P = ple_dim
    e = GELU_tanh(W_gate RMSNorm(h)) * e          (gated=True: Gemma 3n's per-layer input gate)
    y = W_proj e                                  (B, T, D)

Differences from Gemma 3n, stated: Gemma also mixes a projection of the main embedding into the
per-layer input and normalises y with a learned RMSNorm after the projection; here the per-layer
input is the table row alone and W_proj is zero-initialised instead (a post-norm of a zero output
has no usable gradient), so the memory starts as a no-op like the other block memories. The gated
form has the structure of the STEM branch (tngram.memory.stem) with a GELU gate and a small
width P; ungated, it is a per-layer, projected token embedding. E_l is N(0, 1) as nn.Embedding;
it trains as a lookup table (row-sparse under optim.memory_update=sparse|rowwise).

Letters: B batch, T time, D model width, P ple_dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch.nn.functional as F
from torch import Tensor, nn

from tngram.memory.base import MemoryConfig, MemoryModule, RowSparse
from tngram.memory.token_tables import check_inputs, gather_rows


@dataclass(kw_only=True, frozen=True)
class PerLayerEmbeddingConfig(MemoryConfig):
    """ple_dim: P, the width of each layer's table; gated: multiply by GELU(W_gate RMSNorm(h))."""

    kind: ClassVar[str] = "ple"
    injection: ClassVar[str] = "block"
    row_sparse: ClassVar[bool] = True
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {"ple_dim": (1, 1 << 20)}

    ple_dim: int = 64
    gated: bool = True
    zero_init_proj: bool = True

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """E_l (V x P) + W_proj (D x P) [+ W_gate (P x D)]."""
        P = self.ple_dim
        return vocab_size * P + d_model * P * (2 if self.gated else 1)

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "PerLayerEmbedding":
        return PerLayerEmbedding(self, d_model=d_model, vocab_size=vocab_size)


class PerLayerEmbedding(RowSparse, MemoryModule, nn.Module):
    """forward(h (B, T, D), input_ids (B, T)) -> (B, T, D)."""

    def __init__(self, config: PerLayerEmbeddingConfig, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.config, self.d_model, self.vocab_size = config, d_model, vocab_size
        P = config.ple_dim
        self.table = nn.Embedding(vocab_size, P)
        self.gate = nn.Linear(d_model, P, bias=False) if config.gated else None
        self.proj = nn.Linear(P, d_model, bias=False)
        if config.zero_init_proj:
            nn.init.zeros_(self.proj.weight)

    def table_parameters(self) -> list[nn.Parameter]:
        return [cast(nn.Parameter, self.table.weight)]

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h (B, T, D), input_ids (B, T) -> (B, T, D); per position, so `cache` and `valid` need
        no state."""
        check_inputs("per-layer embedding", h, input_ids, self.d_model, self.vocab_size)
        e = gather_rows(self.table.weight, input_ids.long(), self.sparse_grad).to(h.dtype)
        if self.gate is not None:
            e = F.gelu(self.gate(F.rms_norm(h, (h.size(-1),))), approximate="tanh") * e
        return self.proj(e)
