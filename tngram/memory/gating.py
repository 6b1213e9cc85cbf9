"""Engram's context-aware gate and short causal conv, shared by every memory (paper App. D).

Both TN-gram and Engram produce a memory vector e_t (width d_mem) per position; everything after
that is this one implementation, so a comparison between them changes only the memory lookup:

    k_t = e_t W_K + b_K            v_t = e_t W_V + b_V                       (per branch m for K)
    alpha_t = RMSNorm(h_t) . RMSNorm(k_t) / sqrt(d)                           (learnable-gain norms)
    g_t = sigmoid(sign(alpha_t) * sqrt(max(|alpha_t|, 1e-6)))                 (signed-sqrt gate)
    v~_t = g_t v_t
    y_t = v~_t + SiLU(Conv1D(RMSNorm(v~))_t)       depthwise, causal, kernel w, dilation delta

DeepSeek's reference supports hc_mult M hyper-connection branches: h is (B, T, M, d); each branch
has its own key projection and gate norms, the value projection is shared, and the conv runs over
the M*d channels. Our dense GPT uses M = 1, where h may also be passed as (B, T, d).

Dimension letters: B batch, T time, M hc branches, D model width, E memory width (d_mem).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tngram.kernels.policy import current_policy

GATE_CLAMP = 1e-6  # epsilon inside the signed square root (paper App. D, reference)


def signed_sqrt_gate(alpha: Tensor) -> Tensor:
    """g = sigmoid(sign(alpha) * sqrt(max(|alpha|, 1e-6))). torch.sign(0) = 0, so alpha = 0 ->
    0.5."""
    return torch.sigmoid(torch.sign(alpha) * torch.sqrt(alpha.abs().clamp_min(GATE_CLAMP)))


def causal_depthwise_conv(x: Tensor, weight: Tensor, dilation: int, start: int = 0) -> Tensor:
    """Depthwise causal conv as shifted multiply-adds, outputs from position `start` on.

    x: (B, T, C), weight: (C, w) -> (B, T - start, C).
    out_t = sum_j weight[:, j] * x_{t - (w-1-j)*dilation} (zero before the start), identical to
    nn.Conv1d(groups=C, padding=(w-1)*dilation) cut to T. Each output is computed by the same
    operations whatever `start` is (a decoded token's equals the full call's).
    """
    T, w = x.shape[1], weight.shape[1]
    out = x[:, start:] * weight[:, w - 1]  # shift 0
    for j in range(w - 1):
        shift = (w - 1 - j) * dilation
        if shift >= T:
            continue
        past = x[:, max(0, start - shift) : T - shift]
        if shift > start:
            past = F.pad(past, (0, 0, shift - start, 0))
        out = out + past * weight[:, j]
    return out


class ShortConv(nn.Module):
    """y = SiLU(Conv1D(RMSNorm(x))): per-branch RMSNorm (eps 1e-5), depthwise causal dilated
    conv."""

    def __init__(
        self,
        d_model: int,
        hc_mult: int = 1,
        kernel_size: int = 4,
        dilation: int = 1,
        norm_eps: float = 1e-5,
        zero_init: bool = True,
    ) -> None:
        super().__init__()
        self.d_model, self.hc_mult = d_model, hc_mult
        self.kernel_size, self.dilation, self.norm_eps = kernel_size, dilation, norm_eps
        self.norm_weight = nn.Parameter(torch.ones(hc_mult, d_model))  # (M, D)
        self.weight = nn.Parameter(torch.zeros(hc_mult * d_model, kernel_size))  # (M*D, w)
        if not zero_init:  # nn.Conv1d's default init, as DeepSeek's demo leaves it
            bound = 1.0 / math.sqrt(kernel_size)
            nn.init.uniform_(self.weight, -bound, bound)

    def control_parameters(self) -> list[nn.Parameter]:
        """The norm gains and the depthwise kernel (2-D, but one filter per channel)."""
        return [self.norm_weight, self.weight]

    def forward(self, x: Tensor, cache: dict | None = None, valid: Tensor | None = None) -> Tensor:
        """x: (B, T, M, D) -> (B, T, M, D). With `cache` (incremental decoding) the conv input of
        the previous (w-1)*dilation positions is kept in cache["conv"] (every position when
        cache["keep_history"] is set) and only the new positions' outputs are computed, each as
        the uncached call computes it. valid: optional (B, T) bool mask; the conv input is 0 at
        invalid (padding) positions, as before the start of an unpadded row."""
        B, T, M, D = x.shape
        u = (F.rms_norm(x, (D,), eps=self.norm_eps) * self.norm_weight).reshape(B, T, M * D)
        if valid is not None:
            u = u.masked_fill(~valid.bool().unsqueeze(-1), 0.0)
        prev = None if cache is None else cache.get("conv")
        ext = u if prev is None else torch.cat([prev, u], dim=1)  # (B, T_kept + T, M*D)
        if cache is not None:  # every position, or the last (w-1)*dilation
            keep = 0 if cache.get("keep_history") else (self.kernel_size - 1) * self.dilation
            cache["conv"] = ext[:, max(0, ext.shape[1] - keep) :] if keep else ext
        out = causal_depthwise_conv(ext, self.weight, self.dilation, start=ext.shape[1] - T)
        return F.silu(out).reshape(B, T, M, D)


class GatedFusion(nn.Module):
    """Memory vector e (B, T, E) + hidden h -> memory output y (same shape as h), App. D."""

    def __init__(
        self,
        d_mem: int,
        d_model: int,
        *,
        hc_mult: int = 1,
        kernel_size: int = 4,
        dilation: int = 1,
        kv_bias: bool = True,
        zero_init_value: bool = True,
        zero_init_conv: bool = True,
    ) -> None:
        super().__init__()
        self.d_mem, self.d_model, self.hc_mult = d_mem, d_model, hc_mult
        self.value_proj = nn.Linear(d_mem, d_model, bias=kv_bias)
        self.key_proj = nn.ModuleList(
            nn.Linear(d_mem, d_model, bias=kv_bias) for _ in range(hc_mult)
        )
        if zero_init_value:  # the memory then starts as an exact no-op (y = 0)
            nn.init.zeros_(self.value_proj.weight)
            if kv_bias:
                nn.init.zeros_(self.value_proj.bias)
        # RMSNorm gains for the hidden state (query side) and the key, one pair per branch;
        # eps is the dtype's machine epsilon like torch.nn.RMSNorm(eps=None) in the reference.
        self.norm_h = nn.Parameter(torch.ones(hc_mult, d_model))  # (M, D)
        self.norm_k = nn.Parameter(torch.ones(hc_mult, d_model))  # (M, D)
        self.conv = ShortConv(d_model, hc_mult, kernel_size, dilation, zero_init=zero_init_conv)

    def control_parameters(self) -> list[nn.Parameter]:
        """Gains and per-channel kernels (Adam at the scalar lr); the K/V projections are
        matrices (Muon)."""
        return [self.norm_h, self.norm_k] + self.conv.control_parameters()

    def keys_values(self, e: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (B, T, M, D) and the shared value (B, T, 1, D) from e (B, T, E).

        With one branch (hc_mult == 1) and the kernel policy's `fuse_kv` (tngram.kernels.policy),
        K and V are one matmul against the concatenated [W_K; W_V] (2D x E): e is read once, and
        the backward forms dL/de with one matmul instead of two plus an add. Same parameters,
        same numbers up to summation order. Only from `fuse_kv_min_rows` (64) rows of e: the
        concatenation copies both weights on every call, which at decode time (1 row per step)
        cost more than the saved matmul (python -m research bench decode,
        research/PERFORMANCE.md "Decode").
        Only when both projections are plain nn.Linear: a wrapped one (a PEFT LoRA layer, a
        subclass) is called, so its own forward (adapter included) holds at every length.
        """
        policy = current_policy()
        kp, vp = self.key_proj[0], self.value_proj
        if (
            self.hc_mult == 1
            and policy.fuse_kv
            and type(kp) is nn.Linear  # a wrapped projection (e.g. PEFT LoRA) runs its own forward
            and type(vp) is nn.Linear
            and e[..., 0].numel() >= policy.fuse_kv_min_rows
        ):
            w = torch.cat([kp.weight, vp.weight], dim=0)  # (2D, E)
            b = None if kp.bias is None else torch.cat([kp.bias, vp.bias])  # (2D,)
            k, v = F.linear(e, w, b).split(self.d_model, dim=-1)  # (B, T, D) each
            return k.unsqueeze(2), v.unsqueeze(2)
        keys = (
            kp(e).unsqueeze(2)
            if self.hc_mult == 1
            else torch.stack([p(e) for p in self.key_proj], 2)
        )
        return keys, self.value_proj(e).unsqueeze(2)  # (B, T, 1, D)

    def gate_from_keys(self, h: Tensor, keys: Tensor) -> Tensor:
        """Scalar gate per (token, branch): h (B, T, M, D), keys (B, T, M, D) -> (B, T, M, 1)."""
        D = self.d_model
        k_hat = F.rms_norm(keys, (D,)) * self.norm_k
        h_hat = F.rms_norm(h, (D,)) * self.norm_h
        alpha = (k_hat * h_hat).sum(-1, keepdim=True) / math.sqrt(D)  # (B, T, M, 1)
        return signed_sqrt_gate(alpha)

    def gates(self, h: Tensor, e: Tensor) -> Tensor:
        """Scalar gate per (token, branch): h (B, T, M, D), e (B, T, E) -> (B, T, M, 1)."""
        return self.gate_from_keys(h, self.keys_values(e)[0])

    def forward(
        self, h: Tensor, e: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """valid: optional (B, T) bool mask; y is 0 at invalid (padding) positions and they do not
        enter the conv state (see ShortConv)."""
        squeeze = h.dim() == 3
        if squeeze:
            h = h.unsqueeze(2)  # (B, T, 1, D)
        if h.shape[2] != self.hc_mult:
            raise ValueError(
                f"hidden has {h.shape[2]} branches, module expects hc_mult={self.hc_mult}"
            )
        keys, v = self.keys_values(e)  # (B,T,M,D), (B,T,1,D)
        g = self.gate_from_keys(h, keys)  # (B, T, M, 1)
        v_gated = g * v  # (B, T, M, D)
        y = v_gated + self.conv(v_gated, cache, valid)
        if valid is not None:
            y = y.masked_fill(~valid.bool()[:, :, None, None], 0.0)
        return y.squeeze(2) if squeeze else y
