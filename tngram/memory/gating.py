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
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tngram.kernels.policy import current_policy, kernel_policy
from tngram.kernels.tngram_c import c_memory_step, c_unavailable_reason, memory_step

GATE_CLAMP = 1e-6  # epsilon inside the signed square root (paper App. D, reference)


def signed_sqrt_gate(alpha: Tensor) -> Tensor:
    """g = sigmoid(sign(alpha) * sqrt(max(|alpha|, 1e-6))). torch.sign(0) = 0, so alpha = 0 ->
    0.5."""
    return torch.sigmoid(torch.sign(alpha) * torch.sqrt(alpha.abs().clamp_min(GATE_CLAMP)))


def causal_depthwise_conv(x: Tensor, weight: Tensor, dilation: int, start: int = 0) -> Tensor:
    """Depthwise causal conv as shifted multiply-adds.

    x: (B, T, C), weight: (C, w). out_t = sum_j weight[:, j] * x_{t - (w-1-j)*dilation}
    (zero before the start), identical to nn.Conv1d(groups=C, padding=(w-1)*dilation) cut to T.
    start: only the outputs of positions [start, T) are computed (B, T - start, C); the first
    `start` rows of x are history (decoding). Each output is the same sum in the same order.
    """
    B, T, C = x.shape
    w = weight.shape[1]
    out = x[:, start:] * weight[:, w - 1]  # shift 0
    for j in range(w - 1):
        shift = (w - 1 - j) * dilation
        if shift >= T:
            continue
        lo = start - shift  # the first output's source row
        src = x[:, lo : T - shift] if lo >= 0 else F.pad(x[:, : T - shift], (0, 0, -lo, 0))
        out = out + src * weight[:, j]
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
        the previous (w-1)*dilation positions is kept in cache["conv"] (zeros before the start;
        every position when cache["keep_history"] is set). valid: optional (B, T) bool mask; the
        conv input is 0 at invalid (padding) positions, as before the start of an unpadded row."""
        B, T, M, D = x.shape
        u = (F.rms_norm(x, (D,), eps=self.norm_eps) * self.norm_weight).reshape(B, T, M * D)
        if valid is not None:
            u = u.masked_fill(~valid.bool().unsqueeze(-1), 0.0)
        if cache is None:
            return F.silu(causal_depthwise_conv(u, self.weight, self.dilation)).view(B, T, M, D)
        win = self.window(cache, u)
        self.remember(cache, win, u)
        ext = torch.cat([win, u], dim=1)  # (B, L + T, M*D)
        out = causal_depthwise_conv(ext, self.weight, self.dilation, start=win.shape[1])
        return F.silu(out).reshape(B, T, M, D)

    def window(self, cache: dict, like: Tensor) -> Tensor:
        """The conv inputs of the L = (w-1)*dilation positions before the next call's first one,
        (B, L, M*D) from cache["conv"] (zeros before the start); `like` gives B, dtype, device."""
        L, C, B = (self.kernel_size - 1) * self.dilation, self.hc_mult * self.d_model, like.shape[0]
        prev = cache.get("conv")
        win = like.new_zeros(B, 0, C) if prev is None else prev[:, max(0, prev.shape[1] - L) :]
        if win.shape[1] < L:
            win = torch.cat([win.new_zeros(B, L - win.shape[1], C), win], 1)
        return win

    def remember(self, cache: dict, win: Tensor, u: Tensor) -> None:
        """Keep the new positions' conv inputs u (B, T, M*D) in cache["conv"]: after the earlier
        ones with cache["keep_history"], else only the last L (win: `window`'s)."""
        prev = cache.get("conv")
        if cache.get("keep_history"):
            cache["conv"] = u if prev is None else torch.cat([prev, u], dim=1)
        else:
            cache["conv"] = torch.cat([win, u], dim=1)[:, u.shape[1] :]


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
        if self.hc_mult == 1:
            keys = self.key_proj[0](e).unsqueeze(2)  # (B, T, 1, D)
        else:
            keys = torch.stack([proj(e) for proj in self.key_proj], dim=2)  # (B, T, M, D)
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

    def c_step(
        self,
        kind: str,
        ids: Tensor,
        start: int,
        lookup: tuple[list, list[int], list[float]],
        h: Tensor,
        cache: dict | None,
        valid: Tensor | None,
    ) -> Tensor | None:
        """A call of a few positions without autograd (a decoding step, a short prompt; with or
        without a cache, eager or compiled: every such call gives the same numbers) in one C
        call: the memory's lookup (`kind` "tngram" or "engram"; `lookup` its tables, ints and
        floats: tngram.kernels.tngram_c.c_memory_step) and this module's K/V, gate and conv: the
        equations of `forward`, summed in another order. ids (B, S): the call's ids after `start`
        history ids. None where it does not apply (the kernel policy's c_step off, more than
        c_step_max_rows positions, not fp32 CPU, several branches, a wrapped projection such as
        PEFT LoRA, autograd, the kernel not built or not self-checked, an id outside the
        vocabulary): the caller runs the torch ops."""
        policy = current_policy()
        if (
            not policy.c_step
            or self.hc_mult != 1
            or h.shape[0] * h.shape[1] > policy.c_step_max_rows
            or not (h.is_cpu and h.dtype == torch.float32)
        ):
            return None
        kp, vp, conv = self.key_proj[0], self.value_proj, self.conv
        if type(kp) is not nn.Linear or type(vp) is not nn.Linear:  # e.g. PEFT LoRA: its forward
            return None
        weights = [kp.weight, kp.bias, vp.weight, vp.bias, self.norm_h, self.norm_k]
        weights += [conv.norm_weight, conv.weight]
        for t in (*weights, *lookup[0]):
            if t is not None and not (t.is_cpu and t.dtype in _C_DTYPES and t.is_contiguous()):
                return None
        if torch.is_grad_enabled() and any(p.requires_grad for p in (h, *self.parameters())):
            return None
        if not c_step_ready():
            return None
        win = conv.window({} if cache is None else cache, h)
        B, T = h.shape[:2]
        args = (kind, ids, start, *lookup, h.reshape(B, T, -1), weights, conv.dilation)
        if torch.compiler.is_compiling():  # the op: the same C step inside the graph
            out = memory_step(*args, conv.norm_eps, win, valid)
        else:
            out = c_memory_step(*args, conv.norm_eps, win, valid)
            if out is None:
                return None
        if cache is not None:
            conv.remember(cache, win, out[1])
        return out[0].view(h.shape)

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


_C_DTYPES = (torch.float32, torch.int64)  # the C step's weights and buffers (ids: any int)
_C_STEP: list[bool] = []  # [whether the C step passed its check], once per process


def c_step_ready() -> bool:
    """Whether the C decoding step (GatedFusion.c_step) loads and matches the torch ops: checked
    once per process on a tiny TN-gram and Engram with random weights, decoded one to three
    positions at a time with a left-padded row, against their uncached torch forward; a failure
    warns once and keeps the torch ops."""
    if not _C_STEP:
        _C_STEP.append(c_unavailable_reason() is None)  # provisional: the check calls c_step
        if _C_STEP[0]:
            with torch.random.fork_rng(devices=[]):  # building the modules draws from torch's RNG
                _C_STEP[0] = _c_step_matches()
    return _C_STEP[0]


# a compiled graph reads the answer as a constant (as tngram.kernels.choice.choose_impl)
c_step_ready._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _c_step_matches() -> bool:
    from tngram.memory.engram import EngramConfig  # (imported here: both modules import this one)
    from tngram.memory.tngram import TNGramConfig

    g, err = torch.Generator().manual_seed(0), 0.0
    for cfg in (
        TNGramConfig(max_ngram=4, cp_rank=5),
        EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=4, pad_id=1),
    ):
        m = cfg.build(d_model=8, vocab_size=11)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            ids, h = torch.randint(0, 11, (2, 7), generator=g), torch.randn(2, 7, 8, generator=g)
            valid = torch.arange(7) >= torch.tensor([[0], [2]])  # row 1 left-padded
            with kernel_policy(c_step=False):
                want = m(h, ids, None, valid)
            cache: dict = {"keep_history": True}
            spans = ((0, 1), (1, 3), (3, 4), (4, 7))
            got = [m(h[:, a:b], ids[:, a:b], cache, valid[:, a:b]) for a, b in spans]
        err = max(err, float((torch.cat(got, dim=1) - want).abs().max()))
    if err <= 1e-5:
        return True
    warnings.warn(
        f"tngram: the C decoding step differs from the torch ops by {err:.2e} on its self-check; "
        "decoding runs the torch ops",
        RuntimeWarning,
        stacklevel=3,
    )
    return False
