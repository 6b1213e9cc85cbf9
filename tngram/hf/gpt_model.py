"""Our GPT (every recipe: raw, Engram, TN-gram, Over-Encoding) as a `transformers` causal LM.

    TngramGPTConfig          model_type "tngram_gpt"; `gpt` holds GPTConfig.to_dict() verbatim
                             (memory config included), the usual HF fields mirror it
    TngramGPTForCausalLM     PreTrainedModel + GenerationMixin around tngram.model.gpt.GPT
                             (`.model`), so its state dict is "model." + our keys
    TngramGPTCache           an HF `Cache` holding our incremental-decoding state: attention keys
                             and values AND each memory's n-gram window and conv state, so
                             generate() with the cache computes exactly what full recomputation does

Without padding the forward is our GPT's forward, unchanged: logits equal ours bit for bit on the
same device and dtype. With padding in `attention_mask` (left-padded batches: pipelines, lm-eval
generate_until) or when hidden states / attentions are asked for, `padded_hidden` runs the same
blocks with per-row positions (pads do not count), pad keys masked out and the memories' `valid`
mask (pads enter neither n-gram windows nor conv state): each row computes what it computes alone,
up to the rounding of a masked attention. The head is the input embedding (tied, 30·tanh softcap).
Limits (clear errors, not silent differences): `inputs_embeds` (the memory needs ids) and cropping
the cache (assisted decoding).

`register()` makes AutoConfig / AutoModelForCausalLM resolve "tngram_gpt" without
trust_remote_code; tngram.hf calls it on import.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from tngram.common import TngramError
from tngram.memory.ngrams import check_ids_in_forward
from tngram.model.gpt import GPT, GPTConfig, apply_rope, rms_norm, rope_tables

MODEL_TYPE = "tngram_gpt"
# the cache's name in model outputs and generate's model inputs: `cache` from transformers 5.24
_CACHE_FIELD = (
    "cache"
    if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    else "past_key_values"
)


class TngramGPTConfig(PreTrainedConfig):
    """HF config of our GPT. `gpt` is the full GPTConfig dict; the other fields are derived."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    gpt: dict | None = None
    cp_ranks: list | None = None  # TN-gram modules' CP ranks after adaptive pruning (model order)
    # sha256 of gpt and cp_ranks (tngram.hf.gpt_folder): from_pretrained refuses an edited config
    gpt_digest: str | None = None
    vocab_size: int = 1024
    hidden_size: int = 512
    num_hidden_layers: int = 9
    num_attention_heads: int = 8
    max_position_embeddings: int = 1024
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True  # the head is tok_emb (softcapped): no lm_head tensor
    use_cache: bool = True

    @classmethod
    def from_gpt_config(cls, cfg: GPTConfig, **kw: Any) -> "TngramGPTConfig":
        from tngram.hf.gpt_folder import gpt_digest

        gpt = cfg.to_dict()
        kw.setdefault("gpt_digest", gpt_digest(gpt, kw.get("cp_ranks")))
        return cls(
            gpt=gpt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.n_embd,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            max_position_embeddings=cfg.sequence_len,
            **kw,
        )

    def gpt_config(self) -> GPTConfig:
        if not self.gpt:
            raise TngramError(
                "TngramGPTConfig.gpt is empty: build the config with "
                "TngramGPTConfig.from_gpt_config(GPTConfig(...))"
            )
        return GPTConfig.from_dict(self.gpt)


# ---- the cache


def _map_tensors(state: Any, fn) -> Any:
    """Apply fn to every tensor in a nested dict/list cache state (new containers)."""
    if torch.is_tensor(state):
        return fn(state)
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_tensors(v, fn) for v in state]
    return state


class TngramGPTCache(Cache):
    """Our GPT's decoding state (tngram.model.gpt.GPT.hidden's `cache` dict) inside an HF Cache.

    Every tensor in it has the batch as dim 0, so beam search's reorder and batch expansion are
    one index_select / repeat_interleave over all of them: attention K/V, the memories' last
    N-1 token ids and their short-conv inputs move together.
    """

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.state: dict[str, Any] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.state.get("pos", 0))

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return "pos" in self.state

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        blocks = self.state.get("blocks") or [{}]
        k = blocks[0].get("attn", {}).get("k")
        return 0 if k is None else int(k.shape[0])

    def reset(self) -> None:
        self.state = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = _map_tensors(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.state = _map_tensors(self.state, lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _map_tensors(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 or (
            tokens_to_remove > 0 and tokens_to_remove >= self.get_seq_length()
        ):
            return
        raise TngramError(
            "TngramGPTCache cannot be cropped: the n-gram memories' conv state of "
            "earlier positions is not kept (assisted / speculative decoding is unsupported)"
        )

    def __repr__(self) -> str:
        return f"TngramGPTCache(seq_length={self.get_seq_length()})"


# ---- the model


def _attention(
    attn: Any,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: dict | None,
    mask: Tensor,
    want_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """tngram.model.gpt.Attention.forward with a boolean (B, 1, T, past + T) mask and per-row
    rope tables cos/sin (B, 1, T, E/2); optionally also returns the attention weights."""
    B, T, D = x.shape
    q = attn.c_q(x).view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)
    k = attn.c_k(x).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
    v = attn.c_v(x).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
    q, k = rms_norm(q), rms_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = q * attn.q_gain.to(q.dtype).view(1, -1, 1, 1)
    if cache is not None and "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    if cache is not None:
        cache["k"], cache["v"] = k, v
    if not want_weights:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=attn.n_kv_head != attn.n_head
        )
        return attn.proj(y.transpose(1, 2).reshape(B, T, D)), None
    rep = attn.n_head // attn.n_kv_head
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_dim)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    y = weights @ v
    return attn.proj(y.transpose(1, 2).reshape(B, T, D)), weights


def padding_positions(
    ids: Tensor, cache: dict | None, mask: Tensor | None, past: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(new_valid (B, T), keys_valid (B, past + T), rowpos (B,), positions (B, T)) of a padded
    batch: which new tokens are real, which keys are, tokens seen per row before this call, and
    each new token's position counting its row's real tokens only."""
    B, T = ids.shape
    dev = ids.device
    if mask is None:
        new_valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    else:
        if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] not in (T, past + T):
            raise TngramError(
                f"attention_mask of shape {tuple(mask.shape)} does not match "
                f"input_ids {(B, T)} after {past} cached tokens"
            )
        new_valid = mask[:, -T:].to(device=dev, dtype=torch.bool)
    old_valid = (
        torch.ones(B, past, dtype=torch.bool, device=dev)
        if cache is None or "valid" not in cache
        else cache["valid"]
    )
    keys_valid = torch.cat([old_valid, new_valid], dim=1)  # (B, past + T)
    rowpos = (
        torch.full((B,), past, dtype=torch.long, device=dev)
        if cache is None or "rowpos" not in cache
        else cache["rowpos"]
    )
    positions = (rowpos[:, None] + new_valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
    return new_valid, keys_valid, rowpos, positions


def padded_causal_mask(keys_valid: Tensor, past: int, T: int) -> Tensor:
    """(B, 1, T, past + T): a query sees the earlier real keys and itself (so a pad query's
    softmax row is never empty)."""
    dev = keys_valid.device
    q_abs = past + torch.arange(T, device=dev)
    k_abs = torch.arange(past + T, device=dev)
    causal = k_abs[None, :] <= q_abs[:, None]  # (T, past + T)
    mask = (causal[None] & keys_valid[:, None, :]) | (k_abs[None, None, :] == q_abs[None, :, None])
    return mask[:, None]


def padded_hidden(
    gpt: GPT,
    ids: Tensor,
    cache: dict | None,
    mask: Tensor | None,
    want_hidden: bool = False,
    want_attn: bool = False,
) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
    """GPT.hidden with a 2-D padding mask: (final hidden states, hidden states per layer or None,
    attention weights per layer or None).

    mask: (B, past + T) or (B, T) of 1 = token, 0 = padding (None: no padding). A row's
    positions count its tokens only, pad keys are masked out (a pad query sees itself only, so
    no row of the softmax is empty), and the memories get the `valid` mask. The cache dict is
    GPT.hidden's plus "valid" (B, past + T) and "rowpos" (B,): tokens seen per row."""
    cfg = gpt.config
    if ids.dim() != 2:
        raise TngramError(f"input_ids must have shape (B, T), got {tuple(ids.shape)}")
    B, T = ids.shape
    dev = ids.device
    past = 0 if cache is None else cache.get("pos", 0)
    check_ids_in_forward(ids, cfg.vocab_size)
    new_valid, keys_valid, rowpos, positions = padding_positions(ids, cache, mask, past)
    top = int(positions.max()) + 1 if T else 0
    if top > cfg.sequence_len:
        raise TngramError(
            f"sequence length {top} exceeds the model's sequence_len {cfg.sequence_len}"
        )
    cos, sin = rope_tables(max(top, 1), cfg.n_embd // cfg.n_head, cfg.rope_base, dev)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # (B, 1, T, E/2)
    attn_mask = padded_causal_mask(keys_valid, past, T)  # (B, 1, T, past + T)
    valid = None if bool(new_valid.all()) else new_valid
    caches = (
        [None] * cfg.n_layer
        if cache is None
        else cache.setdefault("blocks", [{} for _ in range(cfg.n_layer)])
    )
    x = gpt.tok_emb(ids)
    if gpt.embed_memory is not None:
        x = (
            gpt.embed_memory(x, ids, valid=valid)
            if cache is None
            else gpt.embed_memory(x, ids, cache=cache.setdefault("embed_memory", {}), valid=valid)
        )
    x = rms_norm(x)
    x0 = x
    hidden: list[Tensor] = [x0]
    attns: list[Tensor] = []

    def block(i: int, x: Tensor) -> Tensor:
        blk: Any = gpt.blocks[i]  # a Block (a ModuleList's items are typed Module)
        c = caches[i]
        mix = blk.resid_mix.to(x.dtype)
        x = mix[0] * x + mix[1] * x0
        if blk.memory is not None:
            x = x + (
                blk.memory(x, ids, valid=valid)
                if c is None
                else blk.memory(x, ids, cache=c.setdefault("memory", {}), valid=valid)
            )
        y, w = _attention(
            blk.attn,
            rms_norm(x),
            cos,
            sin,
            None if c is None else c.setdefault("attn", {}),
            attn_mask,
            want_attn,
        )
        if w is not None:
            attns.append(w)
        x = x + blk.attn_scale.to(x.dtype) * y
        x = x + blk.mlp_scale.to(x.dtype) * blk.mlp(rms_norm(x))
        hidden.append(x)
        return x

    skips = []
    for i in range(gpt.n_enc):
        x = block(i, x)
        skips.append(x)
    for j in range(cfg.n_layer - gpt.n_enc):
        if skips:
            x = x + gpt.skip_weights[j].to(x.dtype) * skips.pop()
        x = block(gpt.n_enc + j, x)
    if cache is not None:
        cache["pos"] = past + T
        cache["valid"] = keys_valid
        cache["rowpos"] = rowpos + new_valid.long().sum(1)
    out = rms_norm(x)
    hidden[-1] = out
    return out, (tuple(hidden) if want_hidden else None), (tuple(attns) if want_attn else None)


class TngramGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TngramGPTConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True  # assisted generation needs cropping: refused by generate
    _supports_sdpa = True

    def __init__(self, config: TngramGPTConfig) -> None:
        config.tie_word_embeddings = True  # folders exported before said False; the head is tied
        super().__init__(config)
        self.model = GPT(config.gpt_config())
        if config.cp_ranks:  # a pruned (adaptive-rank) run: build at its final ranks
            from tngram.memory.cp_rank import shrink_to_ranks

            shrink_to_ranks(self.model, list(config.cp_ranks))
        self.post_init()

    # our modules initialise themselves in __init__ (the recipes' inits): nothing to redo here
    def _init_weights(self, module: torch.nn.Module) -> None:
        pass

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward creates a TngramGPTCache when use_cache

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_emb

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        if not isinstance(value, torch.nn.Embedding):  # our GPT reads tok_emb as an embedding
            raise TngramError(f"the input embedding must be an nn.Embedding, got {type(value)}")
        self.model.tok_emb = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.tok_emb  # the head is tok_emb (tied; logits 30·tanh(h Eᵀ / 30))

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' from_pretrained, with the folder checked before a model is built and
        the weights after they are read (tngram.hf.gpt_folder): one line naming the file and
        the field for a config edited after export, a path outside the folder, a missing or
        unexpected weight."""
        from tngram.hf.gpt_folder import (
            HUB_KWARGS,
            check_folder_config,
            check_loaded_weights,
            pin_tokenizer_path,
            require_digest,
            verify_weights_digest,
        )
        from tngram.readback.tensors import check_finite_module

        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        where = f"{source}/config.json" if isinstance(source, (str, os.PathLike)) else "config"
        config = kwargs.pop("config", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
            name = config or source
            if not isinstance(name, (str, os.PathLike)):
                raise TngramError("from_pretrained needs a folder or a hub repository name")
            config = cls.config_class.from_pretrained(name, **hub)
        check_folder_config(config, where)
        saved_name = pin_tokenizer_path(config, source, where, kwargs)
        verify_weights_digest(config, source, where, kwargs)  # before transformers reads them
        from safetensors import SafetensorError

        from tngram.readback import BadRecordError

        weights = where.replace("config.json", "model.safetensors")
        want_info = kwargs.pop("output_loading_info", False)
        try:
            loaded: Any = super().from_pretrained(
                *args, config=config, output_loading_info=True, **kwargs
            )
        except SafetensorError as e:  # safetensors' own message names no file
            raise BadRecordError(
                f"{weights}: corrupt or truncated safetensors file ({e})"
            ) from None
        model, info = loaded
        check_loaded_weights(info, weights)
        check_finite_module(model, weights)
        require_digest(config, where)
        if saved_name is not None:  # the config keeps the folder's own name, never a full path
            model.config.gpt["memory"]["tokenizer_path"] = saved_name
        model.recompute_buffers()
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' save_pretrained; config.json then records the payload sha256 of each
        weights file (tngram.hf.gpt_folder.record_weights_digest), which from_pretrained checks."""
        from tngram.hf.gpt_folder import record_weights_digest

        out = super().save_pretrained(save_directory, *args, **kwargs)
        record_weights_digest(save_directory)
        return out

    @torch.no_grad()
    def recompute_buffers(self) -> None:
        """Rebuild every buffer of the memory modules (hash primes/multipliers, OE moduli...).

        They are deterministic functions of the config; from_pretrained creates the model on the
        meta device and leaves non-persistent buffers uninitialised, so they are recomputed here
        from a freshly built module of the same config.
        """
        cfg = self.model.config
        mem = cfg.memory
        if mem is None:
            return
        block_mem = mem.injection == "block"
        layers = tuple(cfg.memory_layers) if block_mem else (0,)
        for i in layers:
            target = self.model.blocks[i].memory if block_mem else self.model.embed_memory
            assert isinstance(target, torch.nn.Module)  # the GPT built a memory there
            with torch.device("cpu"):
                fresh = mem.build(
                    d_model=cfg.n_embd, vocab_size=cfg.vocab_size, layer_id=i, layer_ids=layers
                )
            own = dict(target.named_buffers())
            for name, buf in fresh.named_buffers():
                if name in own:
                    own[name].data = buf.to(device=own[name].device)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        past_key_values: Any = None,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Any = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Feed only the tokens the cache has not seen (all of them without a cache)."""
        if inputs_embeds is not None:
            raise TngramError(
                "tngram_gpt needs input_ids (its n-gram memory reads token ids); "
                "inputs_embeds is unsupported"
            )
        past_key_values = cache if past_key_values is None else past_key_values
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, past_key_values.get_seq_length() :]
        return {
            "input_ids": input_ids,
            _CACHE_FIELD: past_key_values,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
        }

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: TngramGPTCache | None = None,
        labels: Tensor | None = None,
        cache: TngramGPTCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, V) of our GPT; labels (B, T) give the mean next-token loss (HF shift).
        hidden_states: (embedding, block 1, ..., final normed output); attentions per block."""
        if inputs_embeds is not None or input_ids is None:
            raise TngramError(
                "tngram_gpt needs input_ids (its n-gram memory reads token ids); "
                "inputs_embeds is unsupported"
            )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        past_key_values = cache if past_key_values is None else past_key_values  # >= 5.24: `cache`
        if past_key_values is not None and not isinstance(past_key_values, TngramGPTCache):
            if past_key_values.get_seq_length() > 0:
                raise TngramError(
                    f"tngram_gpt needs its own TngramGPTCache, got {type(past_key_values).__name__}"
                )
            past_key_values = None  # an empty cache of another type: replace it with ours
        if use_cache and past_key_values is None:
            past_key_values = TngramGPTCache()
        state = None if past_key_values is None else past_key_values.state
        want_hidden = bool(
            self.config.output_hidden_states
            if output_hidden_states is None
            else output_hidden_states
        )
        want_attn = bool(
            self.config.output_attentions if output_attentions is None else output_attentions
        )
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        padded = mask is not None and not bool(mask.all())
        hidden = attns = None
        if padded or want_hidden or want_attn or (state is not None and "valid" in state):
            h, hidden, attns = padded_hidden(
                self.model, input_ids, state, mask, want_hidden, want_attn
            )
        else:
            h = self.model.hidden(input_ids, state)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.model.logits(h)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=hidden,
            attentions=attns,
            **{_CACHE_FIELD: past_key_values if use_cache else None},
        )


_REGISTERED = False


def register() -> None:
    """Register "tngram_gpt" with AutoConfig and AutoModelForCausalLM (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    AutoConfig.register(MODEL_TYPE, TngramGPTConfig, exist_ok=True)
    AutoModelForCausalLM.register(TngramGPTConfig, TngramGPTForCausalLM, exist_ok=True)
    _REGISTERED = True


def from_gpt(model: GPT, **config_kw: Any) -> TngramGPTForCausalLM:
    """Wrap a (trained) GPT of ours: same weights, same logits."""
    from tngram.memory.cp_rank import cp_ranks

    ranks = cp_ranks(model)  # [] without TN-gram memory
    start = getattr(model.config.memory, "cp_rank", None)
    config_kw.setdefault("cp_ranks", ranks if any(r != start for r in ranks) else None)
    hf = TngramGPTForCausalLM(TngramGPTConfig.from_gpt_config(model.config, **config_kw))
    hf.model.load_state_dict(model.state_dict(), strict=True)
    device = next(model.parameters()).device
    # transformers' to() wrapper confuses mypy; without transformers installed there is no error
    return hf.to(device).eval()  # type: ignore[arg-type, unused-ignore]


register()  # importing this module (tngram.hf.register() does) makes "tngram_gpt" resolvable
