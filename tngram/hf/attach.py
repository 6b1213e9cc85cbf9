"""add_memory: put a TN-gram, Engram or Over-Encoding memory into a Hugging Face causal LM.

    base = model.base_model                        (LlamaModel, GPT2Model, GPTNeoXModel, ...)
    block memory (TN-gram, Engram) at layer i:     layers[i].ngram_memory; a forward pre-hook on
                                                   layers[i] makes its input h + memory(h, ids)
    embedding memory (Over-Encoding):              base.ngram_memory; a forward hook on the input
                                                   embedding replaces its output by OE(emb, ids)
    token ids:                                     a forward pre-hook on `base` (and on the top
                                                   model) reads input_ids, attention_mask and
                                                   past_key_values of each call

Keys of the backbone do not change (a base checkpoint still loads; only memory keys are new).
The model becomes a `Tngram<Family>` class with a `Tngram<Family>Config` whose model_type is
`tngram_<family>` and whose field `tngram_memory` is the memory spec (tngram.hf.classes): the
spec lives on model.config, save_pretrained writes it, from_pretrained rebuilds the memory and
refuses weights that do not match the spec, and a process without tngram refuses the folder.
Decode state lives in the call's transformers Cache (tngram.hf.cache_state); left padding comes
from the 2-D attention_mask (padded positions do not enter the n-gram windows or conv state);
no 2-D mask means no padding.

The hooks trace under torch.compile(fullgraph=True): the call's argument positions are looked
up once per class, and the token-id range is read only outside compilation
(tngram.memory.ngrams.check_ids_in_forward, as in our GPT).

Per-call context lives on the model from the pre-hook to the forward's end: one forward at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.hf.cache_state import check_and_advance, memory_states
from tngram.hf.classes import CONFIG_KEY, MEMORY_ATTR, TngramConfigMixin, TngramModelMixin, base_class
from tngram.hf.families import find_decoder_layers
from tngram.memory import memory_config_classes, memory_config_from_dict, memory_config_to_dict
from tngram.memory.ngrams import check_ids_in_forward
from tngram.model.gpt import memory_seed as _memory_seed

SPEC_KEYS = ("memory", "layers", "layers_attr", "memory_seed", "vocab_size")
_CALL_ARGS = ("input_ids", "attention_mask", "past_key_values", "cache", "use_cache")
CACHE_NAMES = ("cache", "past_key_values")   # transformers >= 5.24 calls it `cache`


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


def _family(config: Any) -> str | None:
    cls = type(config)
    if issubclass(cls, TngramConfigMixin):
        return cls.base_model_type
    return getattr(config, "model_type", None)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_ids(layers: Any, n: int, what: str) -> tuple[int, ...]:
    """Distinct decoder-layer indices in [0, n) from ints in [-n, n); one error otherwise."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, list, tuple)):
        raise TngramError(f"{what} must be a list of decoder-layer indices (ints), got {layers!r}")
    if not all(_is_int(i) for i in layers):
        raise TngramError(f"{what} must hold ints, got {list(layers)!r}")
    ids = tuple(i + n if i < 0 else i for i in layers)
    if not ids or any(not 0 <= i < n for i in ids) or len(set(ids)) != len(ids):
        raise TngramError(f"{what} {list(layers)} must be distinct decoder-layer indices in "
                          f"[-{n}, {n}) (the model has {n} decoder layers)")
    return ids


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
        families outside tngram.hf.families.DECODER_LAYERS whose list is not `layers`.
    memory_seed: memory init seed (the model's own RNG stream is not touched).
    vocab_size: optional check: must equal the model's embedding rows.

    The model's class becomes Tngram<Class> and its config a Tngram<Config> copy carrying the
    spec (`model.config.tngram_memory`); the config object you built the model from is not edited.
    """
    from tngram.hf import register

    register()
    base = _base(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise TngramError("add_memory supports decoder-only models; this one is encoder-decoder")
    if memory_spec(model) is not None or getattr(base, "_tngram_state", None) is not None:
        raise TngramError("this model already has an n-gram memory (tngram.hf.remove_memory first)")
    if type(memory_config) not in memory_config_classes().values():
        raise TngramError("memory_config must be a memory config (TNGramConfig, EngramConfig, "
                          f"OverEncodingConfig, ...), got {type(memory_config).__name__}")
    if not _is_int(memory_seed) or not 0 <= memory_seed < 2 ** 63:
        raise TngramError(f"memory_seed must be an int in [0, 2^63), got {memory_seed!r}")
    if layers_attr is not None and not isinstance(layers_attr, str):
        raise TngramError(f"layers_attr must be a dotted path (str), got {layers_attr!r}")
    rows = _embedding_rows(base)
    if vocab_size is not None and vocab_size != rows:
        raise TngramError(f"vocab mismatch: vocab_size={vocab_size} but the model's input "
                          f"embedding has {rows} rows; build the memory for the model's vocabulary")
    path, layer_list = find_decoder_layers(base, _family(config), layers_attr)
    if memory_config.injection == "embedding":
        ids: tuple[int, ...] = ()
    else:
        n = len(layer_list)
        ids = _layer_ids([1 if n > 1 else 0] if layers is None else layers, n,
                         f"layers (decoder layers at base_model.{path})")
    spec = {"memory": memory_config_to_dict(memory_config), "layers": list(ids),
            "layers_attr": path, "memory_seed": int(memory_seed), "vocab_size": rows}
    _convert(model, spec)
    attach_from_spec(model, spec)
    return model


def _swap_config(model: nn.Module, new: Any) -> None:
    old = model.config
    for m in model.modules():
        if m.__dict__.get("config") is old:
            m.config = new


def _convert(model: nn.Module, spec: dict[str, Any]) -> None:
    """Make `model` a memory class with a memory config (a copy) carrying `spec`."""
    from tngram.hf.classes import config_class_for, model_class_for

    cfg_cls = config_class_for(type(model.config))
    model_cls = model_class_for(type(model), cfg_cls)
    new = copy.deepcopy(model.config)
    new.__class__ = cfg_cls
    setattr(new, CONFIG_KEY, spec)
    _swap_config(model, new)
    model.__class__ = model_cls


# ---- the spec (config.tngram_memory): checked before anything is built ---------------------

def _check_memory_fields(memory: Any, where: str) -> Any:
    """The memory config of a spec's `memory` dict; JSON types checked against the fields'."""
    if not isinstance(memory, dict):
        raise TngramError(f"{where}.memory must be an object, got {type(memory).__name__}")
    classes = memory_config_classes()
    kind = memory.get("kind")
    if kind not in classes:
        raise TngramError(f"{where}.memory.kind must be one of {sorted(classes)}, got {kind!r}")
    for f in dataclasses.fields(classes[kind]):
        if f.name not in memory:
            continue
        v, default = memory[f.name], f.default
        if default is dataclasses.MISSING or default is None:
            continue
        key = f"{where}.memory.{f.name}"
        if isinstance(default, bool):
            ok = isinstance(v, bool)
        elif isinstance(default, int):
            ok = _is_int(v)
        elif isinstance(default, float):
            ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
        elif isinstance(default, str):
            ok = isinstance(v, str)
        elif isinstance(default, tuple):
            ok = isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)
        else:
            ok = True
        if not ok:
            tname = type(default).__name__
            raise TngramError(f"{key} must be {'an' if tname[0] in 'aeiou' else 'a'} {tname} "
                              f"like its default {default!r}, got {v!r}")
    try:
        return memory_config_from_dict(memory)
    except TngramError as e:
        raise TngramError(f"{where}.memory: {e}") from None


def check_spec(spec: Any, base: nn.Module, where: str = "config.tngram_memory") -> tuple[Any, tuple[int, ...], nn.ModuleList]:
    """(memory config, layer ids, decoder-layer list) of a spec, or one TngramError naming the
    field (types, ranges, duplicates, the model's layer count and vocabulary)."""
    if not isinstance(spec, dict):
        raise TngramError(f"{where} must be an object, got {type(spec).__name__}")
    missing = [k for k in SPEC_KEYS if k not in spec]
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if missing or unknown:
        raise TngramError(f"{where} must have exactly the keys {list(SPEC_KEYS)}; "
                          f"missing {missing}, unknown {unknown}")
    cfg = _check_memory_fields(spec["memory"], where)
    seed, vocab, attr = spec["memory_seed"], spec["vocab_size"], spec["layers_attr"]
    if not _is_int(seed) or not 0 <= seed < 2 ** 63:
        raise TngramError(f"{where}.memory_seed must be an int in [0, 2^63), got {seed!r}")
    if not _is_int(vocab) or vocab < 1:
        raise TngramError(f"{where}.vocab_size must be a positive int, got {vocab!r}")
    if not isinstance(attr, str) or not attr:
        raise TngramError(f"{where}.layers_attr must be a dotted path (str), got {attr!r}")
    rows = _embedding_rows(base)
    if rows != vocab:
        raise TngramError(f"vocab mismatch: {where}.vocab_size is {vocab} but the input "
                          f"embedding has {rows} rows")
    _, layer_list = find_decoder_layers(base, _family(base.config), attr)
    if cfg.injection == "embedding":
        if spec["layers"] != []:
            raise TngramError(f"{where}.layers must be [] for an embedding memory "
                              f"({cfg.kind}), got {spec['layers']!r}")
        return cfg, (), layer_list
    ids = _layer_ids(spec["layers"], len(layer_list), f"{where}.layers")
    if list(ids) != list(spec["layers"]):
        raise TngramError(f"{where}.layers must be non-negative, got {spec['layers']!r}")
    return cfg, ids, layer_list


# ---- building the memories and installing the hooks ---------------------------------------

def _build(cfg: Any, d_model: int, vocab: int, layer_id: int, layer_ids: tuple[int, ...],
           seed: int, ref: Tensor | None) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_memory_seed(seed, layer_id))
        mod = cfg.build(d_model=d_model, vocab_size=vocab, layer_id=layer_id, layer_ids=layer_ids)
    if ref is not None:
        mod.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    for m in mod.modules():
        # hash constants are saved with the weights (and checked against the spec on load):
        # from_pretrained re-creates non-persistent buffers empty, so they would be garbage
        m._non_persistent_buffers_set.clear()
        m._is_hf_initialized = True   # transformers' _init_weights must not re-initialise it
    return mod


def _memory_layers(base: nn.Module, cfg: Any, ids: tuple[int, ...],
                   layer_list: nn.ModuleList) -> list[tuple[int, nn.Module]]:
    """(layer id, module that owns the memory) pairs: the embedding memory lives on base."""
    if cfg.injection == "embedding":
        return [(0, base)]
    return [(i, layer_list[i]) for i in ids]


def attach_from_spec(model: nn.Module, spec: dict[str, Any]) -> None:
    """Build the memories of `spec` into `model` (the outermost model) and install the hooks."""
    base = _base(model)
    cfg, ids, layer_list = check_spec(spec, base)
    d_model, seed, vocab = _hidden_size(base.config), int(spec["memory_seed"]), int(spec["vocab_size"])
    ref = next(base.parameters())
    state = _State(spec)
    for i, owner in _memory_layers(base, cfg, ids, layer_list):
        owner.add_module(MEMORY_ATTR, _build(cfg, d_model, vocab, i, ids or (0,), seed, ref))
    link = getattr(cfg, "link_layers", None)   # e.g. TN-gram share_factors: one A_1..A_N
    if link is not None:
        link([getattr(owner, MEMORY_ATTR) for _, owner in _memory_layers(base, cfg, ids, layer_list)])
    if cfg.injection == "embedding":
        emb = base.get_input_embeddings()
        emb._tngram_state = state
        state.handles.append(emb.register_forward_hook(_embedding_hook))
    else:
        for i in ids:
            layer = layer_list[i]
            layer._tngram_state = state
            state.handles.append(layer.register_forward_pre_hook(
                functools.partial(_layer_pre_hook, f"layer{i}"), with_kwargs=True))
    _install_call_hooks(base, state)
    if base is not model:
        _install_call_hooks(model, state)
        _wrap_prepare_inputs(model)


@functools.lru_cache(maxsize=64)
def _call_positions(cls: type) -> tuple[tuple[str, int], ...]:
    """(name, positional index) of the call arguments the hooks read, for cls.forward."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]   # without self
    out = []
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name in _CALL_ARGS:
            out.append((p.name, i))
    return tuple(out)


def _install_call_hooks(module: nn.Module, state: _State) -> None:
    """Hooks reading input_ids / attention_mask / cache of each call of `module` (the base
    model, and the top model too: some heads, e.g. OPT's, call an inner decoder directly)."""
    module._tngram_state = state
    module._tngram_call = dict(_call_positions(type(module)))
    params = inspect.signature(type(module).forward).parameters
    module._tngram_cache_name = next((n for n in CACHE_NAMES if n in params), None)
    state.handles.append(module.register_forward_pre_hook(_base_pre_hook, with_kwargs=True))
    state.handles.append(module.register_forward_hook(_base_post_hook, always_call=True))


def memory_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: memory module} of a model with add_memory (empty without)."""
    return {n: m for n, m in model.named_modules() if n.endswith(MEMORY_ATTR)}


def remove_memory(model: nn.Module) -> nn.Module:
    """Undo add_memory: hooks, memory modules and the spec go; the model and its config are of
    the family's own classes again. Returns the model."""
    base = _base(model)
    state = getattr(base, "_tngram_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for m in list(model.modules()):
        if getattr(m, "_tngram_state", None) is state:
            del m._tngram_state
            m.__dict__.pop("_tngram_call", None)
            m.__dict__.pop("_tngram_cache_name", None)
            m.__dict__.pop("_tngram_replay", None)
            if MEMORY_ATTR in m._modules:
                del m._modules[MEMORY_ATTR]
    model.__dict__.pop("prepare_inputs_for_generation", None)
    if isinstance(model.config, TngramConfigMixin):
        plain = copy.deepcopy(model.config)
        plain.__class__ = base_class(type(plain))
        plain.__dict__.pop(CONFIG_KEY, None)
        _swap_config(model, plain)
    model.__class__ = base_class(type(model))
    return model


# ---- hooks ---------------------------------------------------------------------------------

def _call_arg(module: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = module._tngram_call.get(name)
    return args[i] if i is not None and i < len(args) else None


def _valid_mask(mask: Any, ids: Tensor, state: _State) -> Tensor | None:
    """(B, T) bool mask of real tokens from the call's attention mask, or None (no padding).

    A 4-D (or per-layer dict) mask carries no padding we can read: generate() records its 2-D
    mask in prepare_inputs_for_generation; without one (transformers drops an all-ones mask)
    there is no padding."""
    B, T = ids.shape
    if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
        mask = state.pending_mask
    if mask is None:
        return None
    if mask.shape[0] != B or mask.shape[1] < T:
        raise TngramError(f"attention_mask of shape {tuple(mask.shape)} does not cover input_ids "
                          f"of shape {(B, T)}")
    valid = mask[:, mask.shape[1] - T:].to(device=ids.device).bool()
    if torch.compiler.is_compiling():
        return valid          # no data-dependent branch in a graph (an all-True mask is exact)
    return None if bool(valid.all()) else valid


def _base_pre_hook(base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _State = base._tngram_state
    if state.ctx is not None:      # an outer hooked module (the top model) already read the call
        return None
    ids = _call_arg(base, args, kwargs, "input_ids")
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
    check_ids_in_forward(ids, vocab)
    changed = False
    cache = _call_arg(base, args, kwargs, "past_key_values")
    if cache is None:
        cache = _call_arg(base, args, kwargs, "cache")
    use_cache = _call_arg(base, args, kwargs, "use_cache")
    if use_cache is None:
        use_cache = getattr(base.config, "use_cache", False)
    if cache is None and use_cache and not base.training:
        # the model would create its cache after this hook and the memory state would be lost
        # (not in training: no decoding follows, and activation checkpointing drops the cache)
        name = base._tngram_cache_name
        if name is None:
            raise TngramError(f"{type(base).__name__}.forward takes no past_key_values; call it "
                              "with use_cache=False")
        from transformers import DynamicCache

        cache = DynamicCache(config=base.config)
        pos = base._tngram_call.get(name)
        if pos is not None and pos < len(args):   # passed positionally (as None)
            args = (*args[:pos], cache, *args[pos + 1:])
        else:
            kwargs = {**kwargs, name: cache}
        changed = True
    states = None
    if cache is not None:
        states = memory_states(cache)
        check_and_advance(cache, ids.shape[1])
    state.ctx = {"ids": ids, "valid": _valid_mask(_call_arg(base, args, kwargs, "attention_mask"), ids, state),
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


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _layer_pre_hook(key: str, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    ctx = layer._tngram_state.ctx
    if ctx is None and "_tngram_replay" in layer.__dict__ and _in_backward():
        # activation checkpointing that wraps the layer's __call__ (transformers < 5.23)
        # recomputes it in backward, after the model's forward: replay that forward's ids
        ctx = layer.__dict__["_tngram_replay"]
    else:
        ctx = _context(layer)
        if layer.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            layer._tngram_replay = {"ids": ctx["ids"], "valid": ctx["valid"], "states": None}
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


# ---- generate(): keep the 2-D mask before it becomes 4-D; refuse inputs_embeds --------------

def _wrap_prepare_inputs(model: nn.Module) -> None:
    orig = getattr(type(model), "prepare_inputs_for_generation", None)
    if orig is None:
        return

    @functools.wraps(orig)   # keeps the signature generate() inspects (inputs_embeds, kwargs)
    def prepare_inputs_for_generation(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inputs_embeds") is not None:
            raise TngramError("generate(inputs_embeds=...) is not supported with an n-gram memory: "
                              "the memory needs the prompt's token ids; pass input_ids")
        state = getattr(self.base_model, "_tngram_state", None)
        if state is not None:
            mask = kwargs.get("attention_mask")
            state.pending_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        return orig(self, *args, **kwargs)

    # a bound method on the instance: deepcopy rebinds it to the copy
    model.prepare_inputs_for_generation = types.MethodType(prepare_inputs_for_generation, model)


# ---- the spec on the model; loading checks -------------------------------------------------

def memory_spec(model: nn.Module) -> dict[str, Any] | None:
    """The memory spec of a model with a memory (model.config.tngram_memory), else None."""
    config = getattr(model, "config", None)
    return getattr(config, CONFIG_KEY, None) if isinstance(config, TngramConfigMixin) else None


def _check_constants(model: nn.Module, where: str) -> None:
    """Every memory buffer (hash multipliers, primes, moduli, offsets) equals what the spec
    builds: a spec edited after training (e.g. Engram's memory.seed) would hash differently."""
    spec = memory_spec(model)
    base = _base(model)
    cfg, ids, layer_list = check_spec(spec, base)
    d_model, seed, vocab = _hidden_size(base.config), int(spec["memory_seed"]), int(spec["vocab_size"])
    for i, owner in _memory_layers(base, cfg, ids, layer_list):
        loaded = dict(getattr(owner, MEMORY_ATTR).named_buffers())
        with torch.device("cpu"):
            fresh = dict(_build(cfg, d_model, vocab, i, ids or (0,), seed, None).named_buffers())
        for name, buf in fresh.items():
            got = loaded.get(name)
            if got is None or got.shape != buf.shape or not torch.equal(got.detach().cpu().to(buf.dtype), buf):
                raise TngramError(f"{where}: the saved memory constant {MEMORY_ATTR}.{name} of "
                                  f"layer {i} does not match config.json {CONFIG_KEY} (was the "
                                  "memory spec edited after saving, e.g. memory.seed?); refusing "
                                  "a memory that would hash differently from its trained tables")


def check_loaded(model: nn.Module, info: dict[str, Any], path: Any) -> None:
    """After from_pretrained: the memory weights match the spec (none missing, unexpected or
    re-initialised), else one TngramError (the model would run on uninitialised memory)."""
    where = f"{path}" if path is not None else "from_pretrained"
    if memory_spec(model) is None:
        return
    bad = {}
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = [k if isinstance(k, str) else k[0] for k in (info.get(kind) or [])]
        keys = [k for k in keys if MEMORY_ATTR in k]
        if keys:
            bad[kind.replace("_keys", "")] = sorted(keys)[:3] + (["..."] if len(keys) > 3 else [])
    if bad:
        raise TngramError(f"{where}: the memory weights do not match config.json {CONFIG_KEY} "
                          f"(layers {memory_spec(model)['layers']}): {bad}; the spec was edited or "
                          "the weights belong to another memory")
    _check_constants(model, where)


def install_transformers_patches() -> None:
    """Once (idempotent): CONFIG_MAPPING resolves "tngram_<family>" (tngram.hf.classes), and a
    family class loading a folder saved with a memory (LlamaForCausalLM.from_pretrained on a
    tngram_llama folder) raises instead of silently dropping the memory."""
    import sys

    from tngram.hf import classes

    classes.install()
    if "transformers.modeling_utils" in sys.modules:   # called from the import hook: no re-entry
        PreTrainedModel = sys.modules["transformers.modeling_utils"].PreTrainedModel
    else:
        from transformers import PreTrainedModel
    if getattr(PreTrainedModel.from_pretrained, "_tngram_patched", False):
        return
    orig = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(orig)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        out = orig(cls, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if not isinstance(model, TngramModelMixin) and \
                getattr(getattr(model, "config", None), CONFIG_KEY, None) is not None:
            raise TngramError(
                f"{args[0] if args else 'this folder'} holds a model with an n-gram memory "
                f"(config.json {CONFIG_KEY}) but {cls.__name__} has none: load it with "
                "AutoModelForCausalLM.from_pretrained (or AutoModel) after `import tngram`")
        return out

    from_pretrained._tngram_patched = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


# the memory classes (tngram.hf.classes) build and check through these two
TngramModelMixin._tngram_build = attach_from_spec   # type: ignore[assignment]
TngramModelMixin._tngram_check = check_loaded       # type: ignore[assignment]
