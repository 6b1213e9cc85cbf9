"""The hooks that hand each call's token ids, padding mask and cache state to the memories.

    token ids:        a forward pre-hook on `base` (and on the top model) reads input_ids,
                      attention_mask and past_key_values of each call into `MemoryState.ctx`
    block memory:     a forward pre-hook on layers[i] makes its input h + memory(h, ids)
    embedding memory: a forward hook on the input embedding replaces its output by OE(emb, ids)
    generate():       prepare_inputs_for_generation keeps the 2-D mask before it becomes 4-D

The hooks trace under torch.compile(fullgraph=True): the call's argument positions are looked
up once per class, and the token-id range is read only outside compilation
(tngram.memory.ngrams.check_ids_in_forward, as in our GPT).
Per-call context lives on the model from the pre-hook to the forward's end: one forward at a time.
"""

from __future__ import annotations

import functools
import inspect
import secrets
import types
from typing import Any

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.hf.cache_state import (
    check_and_advance,
    memory_cache_class,
    memory_states,
    prepare_compiled_install,
)
from tngram.hf.classes import MEMORY_ATTR
from tngram.hf.peft_compat import running_memory
from tngram.hf.spec import embedding_rows
from tngram.memory.ngrams import check_ids_in_forward

_CALL_ARGS = ("input_ids", "attention_mask", "past_key_values", "cache", "use_cache")
CACHE_NAMES = ("cache", "past_key_values")  # transformers >= 5.24 calls it `cache`


class MemoryState:
    """Shared by a base model, its memory layers and its embedding (a plain object, so deepcopy
    keeps the sharing); `ctx` is the current call's ids / padding mask / cache state;
    `disabled` (tngram.hf.adapter.disable_memory): every hook passes its call through."""

    disabled: bool = False

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.ctx: dict[str, Any] | None = None
        self.pending_mask: Tensor | None = (
            None  # 2-D mask recorded by prepare_inputs_for_generation
        )
        self.handles: list = []
        # layer key -> the layer whose memory owns the tables this layer's memory reads
        # (TN-gram variant share_factors, product keys shared_values; see relink)
        self.links: dict[str, nn.Module] = {}
        self.backbone: BackboneVersions | None = None  # set when the memory is added or loaded
        self.name = "default"  # attach.set_memory: the running one of several named memories
        # the memory a cache's state belongs to (a str: a deepcopy keeps it); a new one at each
        # attach, so a cache filled before set_memory / add_memory is refused
        self.token = secrets.token_hex(8)


class BackboneVersions:
    """A model's parameters outside the memory as they were when the memory was added or loaded:
    each one's version counter (torch bumps it at each in-place change, as an optimiser step
    makes) and up to SAMPLE of its values. save_memory writes the memory alone, so it refuses a
    model whose backbone changed since (a counter moved and the values with it; a
    load_state_dict of the same weights is no change): loaded onto the base, the memory would
    not give this model. Not seen: changes through `.data` (peft's merge_and_unload writes so),
    a parameter replaced by another object (a move to the meta device). A deepcopy starts from
    its source's state."""

    SAMPLE = 256

    def __init__(self, model: nn.Module) -> None:
        self.changed_before: str | None = None  # a change made before a deepcopy
        self.params = {
            id(p): (n, p, p._version, self._values(p))
            for n, p in model.named_parameters()
            if MEMORY_ATTR not in n.split(".") and p.device.type != "meta"
        }

    @classmethod
    def _values(cls, p: Tensor) -> Tensor:
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // cls.SAMPLE)
        return flat[::step][: cls.SAMPLE].clone()

    def _moved(self, p: Tensor, version: int, values: Tensor) -> bool:
        if p._version == version or p.device.type == "meta":
            return False
        now = self._values(p)
        return now.shape != values.shape or not torch.equal(now, values.to(now))

    def changed(self, model: nn.Module) -> str | None:
        """The name of a parameter that changed since (None if none did)."""
        if self.changed_before is not None:
            return self.changed_before
        for name, p in model.named_parameters():
            seen = self.params.get(id(p))
            if seen is not None and seen[1] is p and self._moved(p, seen[2], seen[3]):
                return name
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> BackboneVersions:
        import copy

        new = object.__new__(BackboneVersions)
        first = next((n for n, p, v, s in self.params.values() if self._moved(p, v, s)), None)
        new.changed_before = self.changed_before or first
        copies = [(n, copy.deepcopy(p, memo), s) for n, p, _, s in self.params.values()]
        new.params = {id(c): (n, c, c._version, s.clone()) for n, c, s in copies}
        return new


@functools.lru_cache(maxsize=64)
def _call_positions(cls: type) -> tuple[tuple[str, int], ...]:
    """(name, positional index) of the call arguments the hooks read, for cls.forward."""
    forward = getattr(cls, "forward")  # an nn.Module class's
    params = list(inspect.signature(forward).parameters.values())[1:]  # without self
    out = []
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name in _CALL_ARGS:
            out.append((p.name, i))
    return tuple(out)


def install_call_hooks(module: nn.Module, state: MemoryState) -> None:
    """Hooks reading input_ids / attention_mask / cache of each call of `module` (the base
    model, and the top model too: some heads, e.g. OPT's, call an inner decoder directly)."""
    from transformers import DynamicCache

    memory_cache_class(DynamicCache)  # made here, outside any compiled region
    prepare_compiled_install()
    # the hooks' attributes on the module: nn.Module.__setattr__ is annotated Tensor | Module, and
    # stores any other value as a plain attribute (read back with _attr)
    cls: type = type(module)
    module._tngram_state = state  # type: ignore[assignment]
    module._tngram_call = dict(_call_positions(cls))  # type: ignore[assignment]
    params = inspect.signature(type(module).forward).parameters
    cache_name = next((n for n in CACHE_NAMES if n in params), None)
    module._tngram_cache_name = cache_name  # type: ignore[assignment]
    state.handles.append(module.register_forward_pre_hook(_base_pre_hook, with_kwargs=True))
    state.handles.append(module.register_forward_hook(_base_post_hook, always_call=True))


# ---- hooks ---------------------------------------------------------------------------------


def _attr(module: nn.Module, name: str) -> Any:
    """A hooks' attribute of `module` (nn.Module.__getattr__ is typed for tensors and modules)."""
    return getattr(module, name)


def _state(module: nn.Module) -> MemoryState:
    return _attr(module, "_tngram_state")


def _call_arg(module: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = _attr(module, "_tngram_call").get(name)
    return args[i] if i is not None and i < len(args) else None


def _valid_mask(mask: Any, ids: Tensor, state: MemoryState, past: int = 0) -> Tensor | None:
    """(B, T) bool mask of real tokens from the call's attention mask, or None (no padding).

    The 2-D mask's columns are absolute positions: the call's tokens are columns
    [past, past + T), past = tokens already in the cache. That is its last T columns when the
    mask is exactly as long as past + T (the usual case); some families (Bloom, with a static
    cache) pass a mask as long as the whole cache, whose last columns are not this call's.
    A mask shorter than past + T (at least T long) is read by its last T columns.

    A 4-D (or per-layer dict) mask carries no padding we can read: generate() records its 2-D
    mask in prepare_inputs_for_generation; without one (transformers drops an all-ones mask)
    there is no padding."""
    B, T = ids.shape
    if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
        mask = state.pending_mask
    if mask is None:
        return None
    if mask.shape[0] != B or mask.shape[1] < T:
        raise TngramError(
            f"attention_mask of shape {tuple(mask.shape)} does not cover input_ids "
            f"of shape {(B, T)}"
        )
    start = past if mask.shape[1] >= past + T else mask.shape[1] - T
    valid = mask[:, start : start + T].to(device=ids.device).bool()
    if torch.compiler.is_compiling():
        return valid  # no data-dependent branch in a graph (an all-True mask is exact)
    return None if bool(valid.all()) else valid


def _base_pre_hook(base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state = _state(base)
    if state.ctx is not None or state.disabled:  # an outer hooked module already read the call
        return None
    ids = _call_arg(base, args, kwargs, "input_ids")
    if ids is None:
        raise TngramError(
            "the n-gram memory needs token ids: call the model with input_ids "
            "(inputs_embeds alone carries no ids; generate(inputs_embeds=...) is "
            "not supported with a memory)"
        )
    if ids.dim() != 2:
        raise TngramError(f"input_ids must have shape (batch, seq), got {tuple(ids.shape)}")
    vocab = int(state.spec["vocab_size"])
    rows = embedding_rows(base)
    if rows != vocab:
        raise TngramError(
            f"vocab mismatch: the memory was built for {vocab} tokens but the input "
            f"embedding now has {rows} rows (resize_token_embeddings after "
            "add_memory?); add the memory after resizing"
        )
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
            raise TngramError(
                f"{type(base).__name__}.forward takes no past_key_values; call it "
                "with use_cache=False"
            )
        from transformers import DynamicCache

        cache = memory_cache_class(DynamicCache)(config=base.config)
        pos = _attr(base, "_tngram_call").get(name)
        if pos is not None and pos < len(args):  # passed positionally (as None)
            args = (*args[:pos], cache, *args[pos + 1 :])
        else:
            kwargs = {**kwargs, name: cache}
        changed = True
    states, past = None, 0
    if cache is not None:
        states = memory_states(cache)
        past = int(cache._tngram_seen)
        check_and_advance(cache, ids.shape[1], state.token)
    state.ctx = {
        "ids": ids,
        "valid": _valid_mask(_call_arg(base, args, kwargs, "attention_mask"), ids, state, past),
        "states": states,
        "owner": base,
        "base": getattr(base, "base_model", base),
    }
    return (args, kwargs) if changed else None


def _base_post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    state = _state(module)
    if state.ctx is not None and state.ctx["owner"] is module:
        state.ctx = None
        state.pending_mask = None


def _context(module: nn.Module) -> dict[str, Any]:
    ctx = _state(module).ctx
    if ctx is None:
        raise TngramError(
            "a layer with an n-gram memory ran outside its model's forward, so the "
            "token ids are unknown; call the model (or model.base_model) itself"
        )
    return ctx


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def layer_pre_hook(
    key: str, layer: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    if _state(layer).disabled:
        return None
    ctx = _state(layer).ctx
    if ctx is None and "_tngram_replay" in layer.__dict__ and _in_backward():
        # activation checkpointing that wraps the layer's __call__ (transformers < 5.23)
        # recomputes it in backward, after the model's forward: replay that forward's ids
        ctx = layer.__dict__["_tngram_replay"]
    else:
        ctx = _context(layer)
        if layer.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            replay = {"ids": ctx["ids"], "valid": ctx["valid"], "states": None}
            layer._tngram_replay = replay  # type: ignore[assignment]  # (see install_call_hooks)
    h = args[0] if args else kwargs["hidden_states"]
    ids = ctx["ids"]
    if h.shape[:2] != ids.shape:
        raise TngramError(
            f"decoder layer input {tuple(h.shape)} does not match input_ids "
            f"{tuple(ids.shape)}; this architecture needs its own integration"
        )
    mem_state = (
        None if ctx["states"] is None else ctx["states"].setdefault(key, {"keep_history": True})
    )
    owner = _state(layer).links.get(key)
    if owner is not None:
        relink(getattr(layer, MEMORY_ATTR), getattr(owner, MEMORY_ATTR))
    h = h + getattr(layer, MEMORY_ATTR)(h, ids, cache=mem_state, valid=ctx["valid"])
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def owner_refs(mem: nn.Module) -> dict[str, nn.Module]:
    """{parameter name: the module owning it} of the tables a memory module reads from another
    layer's (tngram.memory.base.SharesParameters: TN-gram's share_factors, Memory+'s
    shared_values); the dict itself, so relink can repoint it."""
    return mem.__dict__.get("_shared_from", {})


def relink(mem: nn.Module, owner: nn.Module) -> None:
    """Point the memory module that runs at `mem`'s position at the one that runs at `owner`'s.
    peft's modules_to_save copies each layer's memory on its own, so a copy would read a private
    copy of the owner (never trained nor saved); merge_and_unload and switching adapters change
    which modules run. Called before each linked memory's call: the layers then share what the
    model trains and saves."""
    run, own = running_memory(mem), running_memory(owner)
    shared = owner_refs(run)
    for k, was in shared.items():
        if was is not own:
            shared[k] = own


def embedding_hook(emb: nn.Module, args: tuple, output: Tensor) -> Tensor:
    ctx = _state(emb).ctx
    if ctx is None or _state(emb).disabled or output.shape[:2] != ctx["ids"].shape:
        return output  # a call outside the model's forward (e.g. computing inputs_embeds)
    mem_state = (
        None if ctx["states"] is None else ctx["states"].setdefault("embed", {"keep_history": True})
    )
    return getattr(ctx["base"], MEMORY_ATTR)(
        output, ctx["ids"], cache=mem_state, valid=ctx["valid"]
    )


# ---- generate(): keep the 2-D mask before it becomes 4-D; refuse inputs_embeds --------------


def wrap_prepare_inputs(model: nn.Module) -> None:
    orig = getattr(type(model), "prepare_inputs_for_generation", None)
    if orig is None:
        return

    @functools.wraps(orig)  # keeps the signature generate() inspects (inputs_embeds, kwargs)
    def prepare_inputs_for_generation(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inputs_embeds") is not None:
            raise TngramError(
                "generate(inputs_embeds=...) is not supported with an n-gram memory: "
                "the memory needs the prompt's token ids; pass input_ids"
            )
        state = getattr(self.base_model, "_tngram_state", None)
        if state is not None:
            mask = kwargs.get("attention_mask")
            state.pending_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        return orig(self, *args, **kwargs)

    # a bound method on the instance: deepcopy rebinds it to the copy
    bound = types.MethodType(prepare_inputs_for_generation, model)
    model.prepare_inputs_for_generation = bound  # type: ignore[assignment]  # (any value)
