"""add_memory: put a TN-gram, Engram or Over-Encoding memory into a Hugging Face causal LM.

    base = model.base_model                        (LlamaModel, GPT2Model, GPTNeoXModel, ...)
    block memory (TN-gram, Engram) at layer i:     layers[i].ngram_memory; a forward pre-hook on
                                                   layers[i] makes its input h + memory(h, ids)
    embedding memory (Over-Encoding):              base.ngram_memory; a forward hook on the input
                                                   embedding replaces its output by OE(emb, ids)
    token ids:                                     a forward pre-hook on `base` reads input_ids,
                                                   attention_mask and past_key_values of each call

Keys of the backbone do not change (a base checkpoint still loads; only memory keys are new).
Decode state lives in the call's transformers Cache (tngram.hf.cache_state); left padding comes
from the 2-D attention_mask (padded positions do not enter the n-gram windows or conv state).
The memory spec belongs to the model (not to its config object, which the caller may reuse
to build other models): save_pretrained writes it into config.json as `tngram_memory`, and a
model built from a config carrying that key (from_pretrained included) gets its memory back
once tngram is imported (tngram._hf_hook patches PreTrainedModel.post_init / save_pretrained).

Per-call context lives on the model between the pre-hook and the end of the forward: one
forward at a time per model (not thread-safe).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.hf.cache_state import check_and_advance, memory_states
from tngram.hf.families import find_decoder_layers
from tngram.memory import memory_config_from_dict, memory_config_to_dict
from tngram.memory.ngrams import check_token_ids
from tngram.model.gpt import memory_seed as _memory_seed

MEMORY_ATTR = "ngram_memory"     # child name of the memory module (decoder layer or base model)
CONFIG_KEY = "tngram_memory"     # config attribute / config.json key holding the spec


class _State:
    """Shared by a base model, its memory layers and its embedding (a plain object, so deepcopy
    keeps the sharing); `ctx` is the current call's ids / padding mask / cache state."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.ctx: dict[str, Any] | None = None
        self.pending_mask: Tensor | None = None   # 2-D mask recorded by prepare_inputs_for_generation
        self.handles: list = []


def _hidden_size(config: Any) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            return v
    raise TngramError(f"cannot find the hidden size in {type(config).__name__} "
                      "(hidden_size / n_embd / d_model)")


def _base(model: nn.Module) -> nn.Module:
    if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise TngramError(f"add_memory expects a transformers PreTrainedModel, got {type(model).__name__}")
    return getattr(model, "base_model", model)


def _embedding_rows(base: nn.Module) -> int:
    emb = base.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        raise TngramError(f"the input embedding of {type(base).__name__} is not an nn.Embedding")
    return rows


def add_memory(model: nn.Module, memory_config: Any, layers: Sequence[int] | None = None, *,
               layers_attr: str | None = None, memory_seed: int = 0,
               vocab_size: int | None = None) -> nn.Module:
    """Add an n-gram memory to a decoder-only transformers model, in place; returns the model.

    memory_config: TNGramConfig / EngramConfig (block memories, one per layer in `layers`) or
        OverEncodingConfig (one, at the input embedding; `layers` is ignored).
    layers: decoder-layer indices (negative counts from the end); default (1,) (or (0,) for a
        one-layer model). Each memory reads the residual stream entering its layer and adds its
        output there, before attention (as our GPT does).
    layers_attr: dotted path of the nn.ModuleList of decoder layers under model.base_model, for
        families outside tngram.hf.families.DECODER_LAYERS.
    memory_seed: memory init seed (the model's own RNG stream is not touched).
    vocab_size: optional check: must equal the model's embedding rows.
    """
    from tngram.hf import register

    register()
    base = _base(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise TngramError("add_memory supports decoder-only models; this one is encoder-decoder")
    if getattr(base, "_tngram_state", None) is not None:
        raise TngramError("this model already has an n-gram memory (tngram.hf.remove_memory first)")
    rows = _embedding_rows(base)
    if vocab_size is not None and vocab_size != rows:
        raise TngramError(f"vocab mismatch: vocab_size={vocab_size} but the model's input "
                          f"embedding has {rows} rows; build the memory for the model's vocabulary")
    path, layer_list = find_decoder_layers(base, getattr(config, "model_type", None), layers_attr)
    if getattr(memory_config, "injection", None) == "embedding":
        ids: tuple[int, ...] = ()
    else:
        n = len(layer_list)
        raw = (1 if n > 1 else 0,) if layers is None else tuple(int(i) for i in layers)
        ids = tuple(i + n if i < 0 else i for i in raw)
        if not ids or any(not 0 <= i < n for i in ids) or len(set(ids)) != len(ids):
            raise TngramError(f"layers {raw} must be distinct decoder-layer indices in [-{n}, {n}) "
                              f"(the model has {n} layers at base_model.{path})")
    spec = {"memory": memory_config_to_dict(memory_config), "layers": list(ids),
            "layers_attr": path, "memory_seed": int(memory_seed), "vocab_size": rows}
    _attach(base, spec)
    if base is not model:
        _install_call_hooks(model, base._tngram_state)
        _wrap_prepare_inputs(model)
    return model


def _build(cfg: Any, d_model: int, vocab: int, layer_id: int, layer_ids: tuple[int, ...],
           seed: int, ref: Tensor) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_memory_seed(seed, layer_id))
        mod = cfg.build(d_model=d_model, vocab_size=vocab, layer_id=layer_id, layer_ids=layer_ids)
    mod.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    for m in mod.modules():
        # hash constants are saved with the weights: from_pretrained re-creates non-persistent
        # buffers empty (on the meta device), so they would come back as garbage
        m._non_persistent_buffers_set.clear()
        m._is_hf_initialized = True   # transformers' _init_weights must not re-initialise it
    return mod


def _attach(base: nn.Module, spec: dict[str, Any]) -> None:
    """Build the memories of `spec` into a base model and install the hooks."""
    cfg = memory_config_from_dict(spec["memory"])
    _, layer_list = find_decoder_layers(base, getattr(base.config, "model_type", None),
                                        spec.get("layers_attr"))
    vocab = int(spec["vocab_size"])
    rows = _embedding_rows(base)
    if rows != vocab:
        raise TngramError(f"vocab mismatch: config.{CONFIG_KEY} was built for {vocab} tokens but "
                          f"the input embedding has {rows} rows")
    d_model, seed = _hidden_size(base.config), int(spec.get("memory_seed", 0))
    ref = next(base.parameters())
    state = _State(spec)
    ids = tuple(spec["layers"])
    if cfg.injection == "embedding":
        base.add_module(MEMORY_ATTR, _build(cfg, d_model, vocab, 0, (0,), seed, ref))
        emb = base.get_input_embeddings()
        emb._tngram_state = state
        state.handles.append(emb.register_forward_hook(_embedding_hook))
    else:
        for i in ids:
            layer = layer_list[i]
            layer.add_module(MEMORY_ATTR, _build(cfg, d_model, vocab, i, ids, seed, ref))
            layer._tngram_state = state
            state.handles.append(layer.register_forward_pre_hook(
                functools.partial(_layer_pre_hook, f"layer{i}"), with_kwargs=True))
    _install_call_hooks(base, state)


def _install_call_hooks(module: nn.Module, state: _State) -> None:
    """Hooks reading input_ids / attention_mask / cache of each call of `module` (the base
    model, and the top model too: some heads, e.g. OPT's, call an inner decoder directly)."""
    module._tngram_state = state
    state.handles.append(module.register_forward_pre_hook(_base_pre_hook, with_kwargs=True))
    state.handles.append(module.register_forward_hook(_base_post_hook, always_call=True))


def memory_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: memory module} of a model with add_memory (empty without)."""
    return {n: m for n, m in model.named_modules() if n.endswith(MEMORY_ATTR)}


def remove_memory(model: nn.Module) -> nn.Module:
    """Undo add_memory: hooks, memory modules and the config entry go; returns the model."""
    base = _base(model)
    state = getattr(base, "_tngram_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for m in list(model.modules()):
        if getattr(m, "_tngram_state", None) is state:
            del m._tngram_state
            if MEMORY_ATTR in m._modules:
                del m._modules[MEMORY_ATTR]
    model.__dict__.pop("prepare_inputs_for_generation", None)
    return model


# ---- hooks ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _signature(cls: type) -> inspect.Signature:
    sig = inspect.signature(cls.forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])   # without self


def _valid_mask(mask: Any, ids: Tensor, state: _State) -> Tensor | None:
    """(B, T) bool mask of real tokens from the call's attention mask, or None (no padding)."""
    B, T = ids.shape
    if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
        mask = state.pending_mask   # 4-D / per-layer masks (static caches): generate's 2-D one
        if mask is None:
            raise TngramError("the n-gram memory needs a 2-D attention_mask (batch, past + new "
                              "tokens) to know which positions are padding; got a 4-D mask")
    if mask is None:
        return None
    if mask.shape[0] != B or mask.shape[1] < T:
        raise TngramError(f"attention_mask of shape {tuple(mask.shape)} does not cover input_ids "
                          f"of shape {(B, T)}")
    valid = mask[:, mask.shape[1] - T:].to(device=ids.device).bool()
    return None if bool(valid.all()) else valid


def _base_pre_hook(base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _State = base._tngram_state
    if state.ctx is not None:      # an outer hooked module (the top model) already read the call
        return None
    sig = _signature(type(base))
    bound = sig.bind_partial(*args, **kwargs)
    a = bound.arguments
    extra = next((a.get(p.name) or {} for p in sig.parameters.values()
                  if p.kind is inspect.Parameter.VAR_KEYWORD), {})
    ids = a.get("input_ids")
    if ids is None:
        raise TngramError("the n-gram memory needs token ids: call the model with input_ids "
                          "(inputs_embeds alone carries no ids; generate(inputs_embeds=...) is "
                          "not supported with a memory)")
    if ids.dim() != 2:
        raise TngramError(f"input_ids must have shape (batch, seq), got {tuple(ids.shape)}")
    vocab = int(state.spec["vocab_size"])
    rows = _embedding_rows(base)
    if rows != vocab:
        raise TngramError(f"vocab mismatch: the memory was built for {vocab} tokens but the input "
                          f"embedding now has {rows} rows (resize_token_embeddings after "
                          "add_memory?); add the memory after resizing")
    check_token_ids(ids, vocab)
    changed = False
    cache = a.get("past_key_values")
    use_cache = a.get("use_cache", extra.get("use_cache"))
    if use_cache is None:
        use_cache = getattr(base.config, "use_cache", False)
    if cache is None and use_cache and not (base.training and getattr(base, "gradient_checkpointing", False)):
        # the model would create its cache after this hook and the memory state would be lost
        if "past_key_values" not in sig.parameters:
            raise TngramError(f"{type(base).__name__}.forward takes no past_key_values; call it "
                              "with use_cache=False")
        from transformers import DynamicCache

        cache = DynamicCache(config=base.config)
        pos = list(sig.parameters).index("past_key_values")
        if pos < len(args):   # passed positionally (as None)
            args = (*args[:pos], cache, *args[pos + 1:])
        else:
            kwargs = {**kwargs, "past_key_values": cache}
        changed = True
    states = None
    if cache is not None:
        states = memory_states(cache)
        check_and_advance(cache, ids.shape[1])
    state.ctx = {"ids": ids, "valid": _valid_mask(a.get("attention_mask"), ids, state),
                 "states": states, "owner": base,
                 "base": getattr(base, "base_model", base)}
    return (args, kwargs) if changed else None


def _base_post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    state: _State = module._tngram_state
    if state.ctx is not None and state.ctx["owner"] is module:
        state.ctx = None
        state.pending_mask = None


def _context(module: nn.Module) -> dict[str, Any]:
    ctx = module._tngram_state.ctx
    if ctx is None:
        raise TngramError("a layer with an n-gram memory ran outside its model's forward, so the "
                          "token ids are unknown; call the model (or model.base_model) itself")
    return ctx


def _layer_pre_hook(key: str, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    ctx = _context(layer)
    h = args[0] if args else kwargs["hidden_states"]
    ids = ctx["ids"]
    if h.shape[:2] != ids.shape:
        raise TngramError(f"decoder layer input {tuple(h.shape)} does not match input_ids "
                          f"{tuple(ids.shape)}; this architecture needs its own integration")
    mem_state = None if ctx["states"] is None else ctx["states"].setdefault(key, {"keep_history": True})
    h = h + getattr(layer, MEMORY_ATTR)(h, ids, cache=mem_state, valid=ctx["valid"])
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _embedding_hook(emb: nn.Module, args: tuple, output: Tensor) -> Tensor:
    ctx = emb._tngram_state.ctx
    if ctx is None or output.shape[:2] != ctx["ids"].shape:
        return output   # a call outside the model's forward (e.g. computing inputs_embeds)
    mem_state = None if ctx["states"] is None else ctx["states"].setdefault("embed", {"keep_history": True})
    return getattr(ctx["base"], MEMORY_ATTR)(output, ctx["ids"], cache=mem_state, valid=ctx["valid"])


# ---- generate() with static caches: keep the 2-D mask before it becomes 4-D -----------------

def _prepare_inputs_recording_mask(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = getattr(self.base_model, "_tngram_state", None)
    if state is not None:
        mask = kwargs.get("attention_mask")
        state.pending_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
    return type(self).prepare_inputs_for_generation(self, *args, **kwargs)


def _wrap_prepare_inputs(model: nn.Module) -> None:
    if hasattr(type(model), "prepare_inputs_for_generation"):
        # a bound method on the instance: deepcopy rebinds it to the copy
        model.prepare_inputs_for_generation = types.MethodType(_prepare_inputs_recording_mask, model)


# ---- transformers patch: rebuild the memory of models whose config carries a spec -----------

def memory_spec(model: nn.Module) -> dict[str, Any] | None:
    """The memory spec of a model with add_memory (what save_pretrained writes), else None."""
    state = getattr(getattr(model, "base_model", model), "_tngram_state", None)
    return None if state is None else state.spec


def _after_post_init(model: nn.Module) -> None:
    base = getattr(model, "base_model", model)
    if base is model:
        spec = getattr(getattr(model, "config", None), CONFIG_KEY, None)
        if spec and getattr(model, "_tngram_state", None) is None:
            _attach(model, spec)
            delattr(model.config, CONFIG_KEY)   # from now on the spec lives with the model
    elif getattr(base, "_tngram_state", None) is not None and \
            getattr(model, "_tngram_state", None) is None:
        _install_call_hooks(model, base._tngram_state)
        _wrap_prepare_inputs(model)


def install_transformers_patches() -> None:
    """Wrap PreTrainedModel.post_init (models built from a config with a memory spec --
    LlamaForCausalLM(config), from_pretrained, AutoModel... -- get their memory) and
    save_pretrained (writes the spec into config.json). Once; idempotent."""
    import sys

    if "transformers.modeling_utils" in sys.modules:   # called from the import hook: no re-entry
        PreTrainedModel = sys.modules["transformers.modeling_utils"].PreTrainedModel
    else:
        from transformers import PreTrainedModel
    if getattr(PreTrainedModel.post_init, "_tngram_patched", False):
        return
    orig_post_init, orig_save = PreTrainedModel.post_init, PreTrainedModel.save_pretrained

    @functools.wraps(orig_post_init)
    def post_init(self: Any) -> None:
        orig_post_init(self)
        _after_post_init(self)

    @functools.wraps(orig_save)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        spec = memory_spec(self)
        if spec is None:
            return orig_save(self, *args, **kwargs)
        setattr(self.config, CONFIG_KEY, spec)
        try:
            return orig_save(self, *args, **kwargs)
        finally:
            delattr(self.config, CONFIG_KEY)

    post_init._tngram_patched = True
    PreTrainedModel.post_init = post_init
    PreTrainedModel.save_pretrained = save_pretrained
