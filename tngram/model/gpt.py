"""parameter-golf's baseline GPT (openai/parameter-golf train_gpt.py), with pluggable n-gram memory.

    h = RMSNorm(Embed(ids) [+ Over-Encoding]);  x0 = h
    encoder blocks 0..L/2-1 push skips; decoder blocks pop them (U-Net, learned skip weights)
    block: x = m0*x + m1*x0 ; [x = x + memory(x, ids)] ; x += a*Attn(norm x) ; x += s*MLP(norm x)
    logits = 30 * tanh((RMSNorm(x) @ E^T) / 30)                                  (tied head)

Attention: GQA (8 query / 4 KV heads at d 512), per-head QK RMSNorm, RoPE base 10,000 in the
reference's rotate-half convention, learnable per-head q gain (init 1.5), causal SDPA. MLP:
relu^2 with expansion 2 (or an explicit hidden width `mlp_hidden`, for backbones shrunk to pay for a
memory). All norms are weightless RMSNorm, all linears bias-free, the output
projections of attention and MLP are zero-initialised, the tied embedding is N(0, 0.005^2).
The 9-layer d-512 vocab-1024 default has exactly 17,059,912 parameters.

Memory (TN-gram, Engram) sits in the blocks listed in `memory_layers`, reading the residual
stream after the resid mix and adding its output before attention, as DeepSeek's reference adds
Engram before attention. Over-Encoding (injection "embedding") replaces the input embedding.
Memory modules are built under their own RNG seed, so the backbone's initial weights are
identical with and without memory for the same global seed.

Dimension letters: B batch, T time, D model width, H heads, K kv heads, E head dim, V vocab.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory import memory_config_from_dict, memory_config_to_dict
from tngram.memory.ngrams import check_ids_in_forward

CONTROL_NAMES = ("attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weights")


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    vocab_size: int = 1024
    n_layer: int = 9
    n_embd: int = 512
    n_head: int = 8
    n_kv_head: int = 4
    mlp_mult: int = 2
    mlp_hidden: int = 0  # the MLP's hidden width; 0 -> mlp_mult * n_embd (iso-parameter backbones)
    rope_base: float = 10000.0
    logit_softcap: float = 30.0
    qk_gain_init: float = 1.5
    tied_embed_init_std: float = 0.005
    sequence_len: int = 1024  # longest sequence the model accepts
    memory: Any = None  # TNGramConfig | EngramConfig | OverEncodingConfig | None
    memory_layers: tuple[int, ...] = (1, 7)
    memory_seed: int = 0

    def validate(self) -> None:
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise TngramError(
                f"n_embd ({self.n_embd}) must divide by n_head ({self.n_head}) "
                f"and n_head by n_kv_head ({self.n_kv_head})"
            )
        if (self.n_embd // self.n_head) % 2:
            raise TngramError("head dim must be even for RoPE")
        if self.mlp_hidden < 0:
            raise TngramError(
                f"model.mlp_hidden must be >= 0 (0: mlp_mult * n_embd), got {self.mlp_hidden}"
            )
        if self.memory is not None and self.memory.injection == "block":
            bad = [i for i in self.memory_layers if not 0 <= i < self.n_layer]
            if bad or not self.memory_layers:
                raise TngramError(
                    f"memory_layers {tuple(self.memory_layers)} must be non-empty "
                    f"block indices in [0, {self.n_layer})"
                )
            if len(set(self.memory_layers)) != len(self.memory_layers):
                raise TngramError(f"memory_layers {tuple(self.memory_layers)} has duplicates")

    def mlp_width(self) -> int:
        """The MLP's hidden width: mlp_hidden, or mlp_mult * n_embd when mlp_hidden is 0."""
        return self.mlp_hidden or self.mlp_mult * self.n_embd

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.mlp_hidden:  # written only when set: existing config.json files unchanged
            del d["mlp_hidden"]
        d["memory"] = memory_config_to_dict(self.memory)
        d["memory_layers"] = list(self.memory_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        d = dict(d)
        d["memory"] = memory_config_from_dict(d.get("memory"))
        d["memory_layers"] = tuple(d.get("memory_layers", (1, 7)))
        return cls(**d)


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def rope_tables(T: int, head_dim: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, head_dim/2), angles t * base^(-2i/head_dim)."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    )
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE as in parameter-golf: (x1, x2) -> (x1 cos + x2 sin, -x1 sin + x2 cos).

    x: (B, H, T, E); cos, sin: (T, E/2).
    """
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, kv_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.q_gain = nn.Parameter(torch.full((cfg.n_head,), cfg.qk_gain_init))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: dict | None = None) -> Tensor:
        """x (B, T, D) -> (B, T, D). With `cache` (incremental decoding) the keys/values of earlier
        positions are read from cache["k"], cache["v"] (B, K, T_past, E) and extended in place."""
        B, T, D = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, E)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, E)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, E)
        q, k = rms_norm(q), rms_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q * self.q_gain.to(q.dtype).view(1, -1, 1, 1)
        mask, causal = None, True
        if cache is not None and "k" in cache:
            past = cache["k"].shape[2]
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            # query i (absolute position past + i) sees keys 0..past + i
            mask = torch.arange(past + T, device=x.device) <= (
                past + torch.arange(T, device=x.device)
            ).unsqueeze(1)
            causal = False
        if cache is not None:
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.n_kv_head != self.n_head
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_width(), bias=False)
        self.proj = nn.Linear(cfg.mlp_width(), cfg.n_embd, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, memory: nn.Module | None = None) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.attn_scale = nn.Parameter(torch.ones(cfg.n_embd))
        self.mlp_scale = nn.Parameter(torch.ones(cfg.n_embd))
        self.resid_mix = nn.Parameter(
            torch.stack([torch.ones(cfg.n_embd), torch.zeros(cfg.n_embd)])
        )
        self.memory = memory

    def forward(
        self,
        x: Tensor,
        x0: Tensor,
        ids: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: dict | None = None,
    ) -> Tensor:
        mix = self.resid_mix.to(x.dtype)
        x = mix[0] * x + mix[1] * x0
        if self.memory is not None:
            if cache is None:
                x = x + self.memory(x, ids)
            else:
                x = x + self.memory(x, ids, cache=cache.setdefault("memory", {}))
        attn_cache = None if cache is None else cache.setdefault("attn", {})
        x = x + self.attn_scale.to(x.dtype) * self.attn(rms_norm(x), cos, sin, attn_cache)
        return x + self.mlp_scale.to(x.dtype) * self.mlp(rms_norm(x))


def memory_seed(base: int, layer_id: int) -> int:
    """Seed for one memory module's init, independent of the backbone's RNG stream."""
    digest = hashlib.sha256(f"tngram-memory:{base}:{layer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        nn.init.normal_(self.tok_emb.weight, std=cfg.tied_embed_init_std)
        mem = cfg.memory
        block_mem = mem is not None and mem.injection == "block"
        blocks = []
        for i in range(cfg.n_layer):
            blocks.append(Block(cfg))  # backbone first: its RNG stream never sees memory init
        self.blocks = nn.ModuleList(blocks)
        self.n_enc = cfg.n_layer // 2
        self.skip_weights = nn.Parameter(
            torch.ones(min(self.n_enc, cfg.n_layer - self.n_enc), cfg.n_embd)
        )
        self.embed_memory = None
        if mem is not None:
            layers = tuple(cfg.memory_layers) if block_mem else (0,)
            for i in layers:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(memory_seed(cfg.memory_seed, i))
                    module = mem.build(
                        d_model=cfg.n_embd, vocab_size=cfg.vocab_size, layer_id=i, layer_ids=layers
                    )
                if block_mem:
                    self.blocks[i].memory = module
                else:
                    self.embed_memory = module
            if block_mem:  # e.g. TN-gram share_factors: one A_1..A_N (MemoryConfig.link_layers)
                mem.link_layers([self.blocks[i].memory for i in layers])

    # ---- bookkeeping
    def control_parameters(self) -> list[nn.Parameter]:
        """The backbone's control parameters (CONTROL_NAMES: gains, mixes, skip weights), some
        2-D but none a matrix acting on activations: Adam at the scalar lr (tngram.optim.groups).
        Memory modules declare their own."""
        return [p for n, p in self.named_parameters() if n.rsplit(".", 1)[-1] in CONTROL_NAMES]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def memory_params(self) -> int:
        n = sum(
            p.numel()
            for b in cast("list[Block]", self.blocks)  # ModuleList iterates as nn.Module
            if b.memory is not None
            for p in b.memory.parameters()
        )
        if self.embed_memory is not None:
            n += sum(p.numel() for p in self.embed_memory.parameters())
        return n

    # ---- forward
    def hidden(self, ids: Tensor, cache: dict | None = None) -> Tensor:
        """ids (B, T) -> final normalised hidden states (B, T, D).

        cache: None for a full forward; a dict (start with {}) for incremental decoding, where
        `ids` are the tokens after those already fed; attention keys/values, the memory modules'
        n-gram window and conv state, and the position are kept in it.
        """
        cfg = self.config
        if ids.dim() != 2:
            raise TngramError(f"input_ids must have shape (B, T), got {tuple(ids.shape)}")
        B, T = ids.shape
        pos = 0 if cache is None else cache.get("pos", 0)
        if pos + T > cfg.sequence_len:
            raise TngramError(
                f"sequence length {pos + T} exceeds the model's sequence_len {cfg.sequence_len}"
            )
        check_ids_in_forward(ids, cfg.vocab_size)
        caches = (
            [None] * cfg.n_layer
            if cache is None
            else cache.setdefault("blocks", [{} for _ in range(cfg.n_layer)])
        )
        x = self.tok_emb(ids)  # (B, T, D)
        if self.embed_memory is not None:
            x = (
                self.embed_memory(x, ids)
                if cache is None
                else self.embed_memory(x, ids, cache=cache.setdefault("embed_memory", {}))
            )
        x = rms_norm(x)
        x0 = x
        cos, sin = rope_tables(pos + T, cfg.n_embd // cfg.n_head, cfg.rope_base, ids.device)
        cos, sin = cos[pos:], sin[pos:]
        skips = []
        for i in range(self.n_enc):
            x = self.blocks[i](x, x0, ids, cos, sin, caches[i])
            skips.append(x)
        for j in range(cfg.n_layer - self.n_enc):
            if skips:
                x = x + self.skip_weights[j].to(x.dtype) * skips.pop()
            x = self.blocks[self.n_enc + j](x, x0, ids, cos, sin, caches[self.n_enc + j])
        if cache is not None:
            cache["pos"] = pos + T
        return rms_norm(x)

    def logits(self, h: Tensor) -> Tensor:
        z = F.linear(h, self.tok_emb.weight.to(h.dtype))  # (B, T, V)
        c = self.config.logit_softcap
        return c * torch.tanh(z / c)

    def forward(
        self,
        ids: Tensor,
        targets: Tensor | None = None,
        reduction: str = "mean",
        cache: dict | None = None,
    ) -> Tensor:
        """Logits (B, T, V) when targets is None, else the cross-entropy (fp32). See `hidden` for
        cache."""
        logits = self.logits(self.hidden(ids, cache))
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction
        )


def param_counts(cfg: GPTConfig) -> dict[str, int]:
    """total / memory / delta (total minus the same GPT without memory) parameter counts of
    GPT(cfg), built on the meta device (nothing is allocated or initialised)."""
    with torch.device("meta"):
        model = GPT(cfg)
        raw = GPT(replace(cfg, memory=None))
    total = model.num_params()
    return {
        "total_params": total,
        "memory_params": model.memory_params(),
        "delta_params": total - raw.num_params(),
    }
