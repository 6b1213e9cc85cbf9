"""Product-key memory (Lample et al. 2019, "Large Memory Layers with Product Keys"), optionally
with values shared by every memory layer (Meta's Memory+, arXiv 2412.09764).

One layer, per head j = 1..H (dimension letters below):

    q      = W_q RMSNorm(h)                    (B, T, H, Kd)      query network
    q1, q2 = q[..., :Kd/2], q[..., Kd/2:]                         two half-queries
    s1     = q1 . K1_j^T, s2 = q2 . K2_j^T     (B, T, H, n)       two half-key sets of n keys
    (a1, i1) = topk(s1, k), (a2, i2) = topk(s2, k)
    c[a, b]  = a1[a] + a2[b], slot[a, b] = i1[a] * n + i2[b]      the k*k product candidates
    (c*, slot*) = topk(c, k);  w = softmax(c*)                    the k best of the n^2 slots
    y      = sum_j sum_k w_k V[slot*_k]        (B, T, D)          values: an (n^2, D) table

Because s1 + s2 is a sum, the k best of the k*k candidates are the k best of all n^2 slots
(the test checks this against a brute-force top-k over every slot). The output is added to the
residual stream (injection "block") like Engram's; values are width D, so there is no output
projection (as in Lample et al.).

Choices, stated: the paper's query BatchNorm is replaced by an RMSNorm of the input (BatchNorm
statistics mix positions and batch rows, which would break causality); keys and values are
initialised as in the paper (keys U(-1/sqrt(Kd/2), +), values N(0, 1/D)). The keys are control
parameters (Adam at the scalar lr), W_q a matrix (Muon), the values the lookup table (row-sparse
under optim.memory_update=sparse|rowwise). `shared_values=True`: the first memory layer owns the
value table and the others read it (Memory+); each layer keeps its own query network and keys.

Letters: B batch, T time, D model width, H heads, Kd key_dim, n n_keys, k topk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory.base import MemoryConfig, MemoryModule, RowSparse, SharesParameters
from tngram.memory.token_tables import check_inputs, gather_rows


@dataclass(kw_only=True, frozen=True)
class ProductKeyConfig(MemoryConfig):
    """Product-key memory: n_keys^2 value slots of width d_model per layer (or shared)."""

    kind: ClassVar[str] = "pkm"
    injection: ClassVar[str] = "block"
    row_sparse: ClassVar[bool] = True
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "n_keys": (1, 1 << 16),
        "key_dim": (2, 1 << 14),
        "topk": (1, 1 << 10),
        "n_heads": (1, 64),
    }

    n_keys: int = 128  # keys per half: n_keys^2 slots
    key_dim: int = 64  # query width per head (two halves of key_dim / 2)
    topk: int = 8  # k: best keys per half and slots read per head
    n_heads: int = 2
    shared_values: bool = False  # one value table for every memory layer (Memory+)

    def check_fields(self) -> None:
        if self.key_dim % 2:
            raise TngramError(f"model.memory.key_dim must be even (two halves), got {self.key_dim}")
        if self.topk > self.n_keys:
            raise TngramError(
                f"model.memory.topk ({self.topk}) must be <= model.memory.n_keys ({self.n_keys})"
            )

    def link_layers(self, modules: list[nn.Module]) -> None:
        """shared_values: the first module owns the value table, the others read it."""
        if self.shared_values:
            pk = [cast("ProductKeyMemory", m) for m in modules]  # what this config builds
            for m in pk[1:]:
                m.share_parameter("values", pk[0], "shared_values")

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """W_q (D x H*Kd) + keys (H x 2 x n x Kd/2) + values (n^2 x D, once when shared)."""
        layer_ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
        shared_elsewhere = self.shared_values and layer_id != layer_ids[0]
        H, Kd, n = self.n_heads, self.key_dim, self.n_keys
        values = 0 if shared_elsewhere else n * n * d_model
        return d_model * H * Kd + H * n * Kd + values

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "ProductKeyMemory":
        return ProductKeyMemory(self, d_model=d_model, vocab_size=vocab_size)


class ProductKeyMemory(RowSparse, MemoryModule, SharesParameters):
    """forward(h (B, T, D), input_ids (B, T)) -> (B, T, D)."""

    def __init__(self, config: ProductKeyConfig, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        c = config
        self.config, self.d_model, self.vocab_size = c, d_model, vocab_size
        self.n_keys, self.topk, self.n_heads, self.key_dim = c.n_keys, c.topk, c.n_heads, c.key_dim
        half = c.key_dim // 2
        self.query = nn.Linear(d_model, c.n_heads * c.key_dim, bias=False)
        bound = 1.0 / math.sqrt(half)
        self.keys = nn.Parameter(torch.empty(c.n_heads, 2, c.n_keys, half).uniform_(-bound, bound))
        self.values = nn.Parameter(torch.randn(c.n_keys * c.n_keys, d_model) / math.sqrt(d_model))

    def extra_repr(self) -> str:
        return f"n_keys={self.n_keys}, topk={self.topk}, heads={self.n_heads}, Kd={self.key_dim}"

    def table_parameters(self) -> list[nn.Parameter]:
        return [self.values] if "values" in self._parameters else []

    def control_parameters(self) -> list[nn.Parameter]:
        return [self.keys]

    # ---- lookup ----------------------------------------------------------------------------
    def slots(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h (B, T, D) -> (weights (B, T, H, k) softmax over the k best slots, slots (B, T, H, k)
        in [0, n^2))."""
        B, T, _ = h.shape
        H, n, k = self.n_heads, self.n_keys, self.topk
        q = self.query(F.rms_norm(h, (h.size(-1),))).view(B, T, H, 2, self.key_dim // 2)
        s = torch.einsum("bthcd,hcnd->bthcn", q, self.keys.to(q.dtype))  # (B, T, H, 2, n)
        a, i = s.topk(k, dim=-1)  # (B, T, H, 2, k) each
        cand = a[..., 0, :, None] + a[..., 1, None, :]  # (B, T, H, k, k)
        slot = i[..., 0, :, None] * n + i[..., 1, None, :]  # (B, T, H, k, k)
        best, j = cand.flatten(-2).topk(k, dim=-1)  # (B, T, H, k)
        return best.float().softmax(-1).to(h.dtype), slot.flatten(-2).gather(-1, j)

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h (B, T, D), input_ids (B, T) -> (B, T, D). Reads only h at each position, so the
        decode cache (`cache`) and the padding mask (`valid`) need no state."""
        check_inputs("product-key memory", h, input_ids, self.d_model, self.vocab_size)
        w, slot = self.slots(h)  # (B, T, H, k) each
        v = gather_rows(self.values, slot, self.sparse_grad)  # (B, T, H, k, D)
        return torch.einsum("bthk,bthkd->btd", w, v.to(h.dtype))
