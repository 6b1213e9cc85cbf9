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

The spec and its checks are in tngram.hf.spec, the hooks in tngram.hf.hooks (both re-exported
here).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.hf.classes import (
    CONFIG_KEY,
    MEMORY_ATTR,
    TngramConfigMixin,
    TngramModelMixin,
    base_class,
)
from tngram.hf.families import find_decoder_layers, refuse_non_attention_cache
from tngram.hf.hooks import (  # noqa: F401  (re-exported)
    CACHE_NAMES,
    BackboneVersions,
    embedding_hook,
    install_call_hooks,
    layer_pre_hook,
    MemoryState,
    wrap_prepare_inputs,
    owner_refs,
)
from tngram.hf.peft_compat import memory_copies, refuse_peft
from tngram.hf.placement import check_memory_config, check_table_device, place_tables
from tngram.hf.size_check import warn_if_large
from tngram.hf.spec import (  # noqa: F401  (re-exported)
    DIGEST_KEY,
    SPEC_KEYS,
    base_model,
    embedding_rows,
    family_of,
    hidden_size_of,
    is_int,
    layer_ids,
    check_digest,
    check_spec,
    memory_spec,
    spec_digest,
)
from tngram.memory import memory_config_classes, memory_config_to_dict
from tngram.model.gpt import memory_seed as _memory_seed
from tngram.readback.tensors import check_finite_module

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TRAINABLE = ("all", "memory")


def add_memory(
    model: nn.Module,
    memory_config: Any,
    layers: Sequence[int] | None = None,
    *,
    layers_attr: str | None = None,
    memory_seed: int = 0,
    vocab_size: int | None = None,
    trainable: str = "all",
    table_device: str | None = None,
    name: str = "default",
) -> nn.Module:
    """Add an n-gram memory to a decoder-only transformers model, in place; returns the model.

    memory_config: TNGramConfig / EngramConfig (block memories, one per layer in `layers`) or
        OverEncodingConfig (one, at the input embedding; `layers` is ignored).
        An EngramConfig without table_init_std draws its tables N(0, initializer_range^2) of
        the base config (transformers' init of a new weight) instead of the reference's N(0, 1).
    layers: decoder-layer indices (negative counts from the end); default (1,) (or (0,) for a
        one-layer model). Each memory reads the residual stream entering its layer and adds its
        output there, before attention (as our GPT does).
    layers_attr: dotted path of the nn.ModuleList of decoder layers under model.base_model, for
        families outside tngram.hf.families.DECODER_LAYERS whose list is not `layers`.
    memory_seed: memory init seed (the model's own RNG stream is not touched).
    vocab_size: optional check: must equal the model's embedding rows.
    trainable: "all" (parameters keep their requires_grad) or "memory" (only the memory's
        parameters train: the backbone is frozen; the one choice on a quantized base).
    table_device: None (the memory's tables follow the model) or "cpu": the lookup tables
        stay in host memory when the model is moved, and a call moves only the rows it reads
        to the model's device (tngram.hf.placement); kept in the spec, so save/load keep it.
    name: the memory's name: a model keeps several, one running (set_memory switches); adding
        one under a new name sets the running one aside, an existing name is refused.

    A PeftModel, or a model already holding PEFT adapter layers, is refused (tngram.hf.peft_compat
    says which order works); a memory larger than the model gets a MemorySizeWarning with a
    smaller size (tngram.hf.size_check). The model's class becomes Tngram<Class> and its config
    a Tngram<Config> copy carrying the spec (`model.config.tngram_memory`); the config object
    you built the model from is not edited.
    """
    from tngram.hf import register

    register()
    refuse_peft(model)
    check_table_device(table_device)
    if trainable not in TRAINABLE:
        raise TngramError(f"trainable must be one of {list(TRAINABLE)}, got {trainable!r}")
    if trainable == "all" and getattr(model, "is_quantized", False):
        raise TngramError(
            "trainable='all' on a quantized base: its quantized weights cannot train; pass "
            "trainable='memory' (the memory trains, the backbone stays frozen)"
        )
    base = base_model(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise TngramError("add_memory supports decoder-only models; this one is encoder-decoder")
    refuse_non_attention_cache(config)
    check_memory_name(model, name)
    if type(memory_config) not in memory_config_classes().values():
        raise TngramError(
            "memory_config must be a memory config (TNGramConfig, EngramConfig, "
            f"OverEncodingConfig, ...), got {type(memory_config).__name__}"
        )
    if not is_int(memory_seed) or not 0 <= memory_seed < 2**63:
        raise TngramError(f"memory_seed must be an int in [0, 2^63), got {memory_seed!r}")
    if layers_attr is not None and not isinstance(layers_attr, str):
        raise TngramError(f"layers_attr must be a dotted path (str), got {layers_attr!r}")
    rows = embedding_rows(base)
    if vocab_size is not None and vocab_size != rows:
        raise TngramError(
            f"vocab mismatch: vocab_size={vocab_size} but the model's input "
            f"embedding has {rows} rows; build the memory for the model's vocabulary"
        )
    path, layer_list = find_decoder_layers(base, family_of(config), layers_attr)
    if memory_config.injection == "embedding":
        ids: tuple[int, ...] = ()
    else:
        n = len(layer_list)
        ids = layer_ids(
            [1 if n > 1 else 0] if layers is None else layers,
            n,
            f"layers (decoder layers at base_model.{path})",
        )
    warn_if_large(model, memory_config, hidden_size_of(base.config), rows, ids)
    memory_config = with_base_init(memory_config, config)
    spec = {
        "memory": memory_config_to_dict(memory_config),
        "layers": list(ids),
        "layers_attr": path,
        "memory_seed": int(memory_seed),
        "vocab_size": rows,
    }
    if table_device is not None:
        check_memory_config(memory_config)
        spec["table_device"] = table_device
    spec[DIGEST_KEY] = spec_digest(spec)  # checked when the saved spec is loaded again
    set_memory(model, None)
    convert_to_memory_class(model, spec)
    attach_from_spec(model, spec, name=name)
    return set_trainable(model, trainable)


def with_base_init(memory_config: Any, config: Any) -> Any:
    """An Engram config whose table_init_std is None gets the base's `initializer_range` (the
    std transformers draws a new weight with; engram-peft's 0.02), so that its tables start as
    small as the base's weights; a config that sets it, or a base without one, is kept."""
    std = getattr(config, "initializer_range", None)
    if getattr(memory_config, "table_init_std", 0) is not None or type(std) is not float:
        return memory_config
    return dataclasses.replace(memory_config, table_init_std=std) if std > 0 else memory_config


def record_backbone(model: nn.Module) -> None:
    """Note the backbone's parameters as they are now (hooks.BackboneVersions): save_memory
    refuses a backbone changed after this, whose changes it would drop."""
    state = getattr(base_model(model), "_tngram_state", None)
    if state is not None:
        state.backbone = BackboneVersions(model)


def set_trainable(model: nn.Module, trainable: str) -> nn.Module:
    """trainable="memory": only the memory's parameters require grad; "all": every parameter
    keeps its requires_grad. Returns the model."""
    if trainable not in TRAINABLE:
        raise TngramError(f"trainable must be one of {list(TRAINABLE)}, got {trainable!r}")
    if trainable == "memory":
        for name, p in model.named_parameters():
            p.requires_grad_(MEMORY_ATTR in name.split("."))
    return model


def _swap_config(model: nn.Module, new: Any) -> None:
    old = model.config
    for m in model.modules():
        if m.__dict__.get("config") is old:
            m.config = new


def convert_to_memory_class(model: nn.Module, spec: dict[str, Any]) -> None:
    """Make `model` a memory class with a memory config (a copy) carrying `spec`."""
    from tngram.hf.classes import config_class_for, model_class_for

    cfg_cls = config_class_for(type(model.config))
    model_cls = model_class_for(type(model), cfg_cls)
    new = copy.deepcopy(model.config)
    new.__class__ = cfg_cls
    setattr(new, CONFIG_KEY, spec)
    _swap_config(model, new)
    model.__class__ = model_cls


# ---- building the memories and installing the hooks ---------------------------------------


def _float_or_none(ref: Tensor) -> torch.dtype | None:
    return ref.dtype if ref.is_floating_point() else None


def _build(
    cfg: Any,
    d_model: int,
    vocab: int,
    layer_id: int,
    layer_ids: tuple[int, ...],
    seed: int,
    ref: Tensor | None,
) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_memory_seed(seed, layer_id))
        mod = cfg.build(d_model=d_model, vocab_size=vocab, layer_id=layer_id, layer_ids=layer_ids)
    if ref is not None:
        mod.to(ref.device, _float_or_none(ref))
    for m in mod.modules():
        # hash constants are saved with the weights (and checked against the spec on load):
        # from_pretrained re-creates non-persistent buffers empty, so they would be garbage
        m._non_persistent_buffers_set.clear()
        m._is_hf_initialized = True  # transformers' _init_weights must not re-initialise it
    return mod


def _memory_layers(
    base: nn.Module, cfg: Any, ids: tuple[int, ...], layer_list: nn.ModuleList
) -> list[tuple[int, nn.Module]]:
    """(layer id, module that owns the memory) pairs: the embedding memory lives on base."""
    if cfg.injection == "embedding":
        return [(0, base)]
    return [(i, layer_list[i]) for i in ids]


def attach_from_spec(
    model: nn.Module,
    spec: dict[str, Any],
    name: str = "default",
    built: dict[int, nn.Module] | None = None,
) -> None:
    """Build the memories of `spec` into `model` (the outermost model), or attach `built` (a
    memory set_memory set aside: {layer id: module}), and install the hooks."""
    base = base_model(model)
    cfg, ids, layer_list = check_spec(spec, base)
    d_model, seed, vocab = (
        hidden_size_of(base.config),
        int(spec["memory_seed"]),
        int(spec["vocab_size"]),
    )
    ref = next(base.parameters())
    state = MemoryState(spec)
    state.name = name
    for i, owner in _memory_layers(base, cfg, ids, layer_list):
        if built is None:
            owner.add_module(MEMORY_ATTR, _build(cfg, d_model, vocab, i, ids or (0,), seed, ref))
        else:
            owner.add_module(MEMORY_ATTR, built[i].to(ref.device, _float_or_none(ref)))
    # e.g. TN-gram share_factors: one A_1..A_N (tngram.memory.base.MemoryConfig.link_layers)
    owners = dict(_memory_layers(base, cfg, ids, layer_list))
    cfg.link_layers([getattr(owner, MEMORY_ATTR) for owner in owners.values()])
    layer_of = {id(getattr(owner, MEMORY_ATTR)): owner for owner in owners.values()}
    for i, owner in owners.items():  # the hooks keep the links through peft's copies (relink)
        for src in owner_refs(getattr(owner, MEMORY_ATTR)).values():
            state.links[f"layer{i}"] = layer_of[id(src)]
    if cfg.injection == "embedding":
        emb: nn.Module = cast("PreTrainedModel", base).get_input_embeddings()  # transformers'
        # nn.Module.__setattr__ is annotated Tensor | Module; it stores any other value as is
        emb._tngram_state = state  # type: ignore[assignment]
        state.handles.append(emb.register_forward_hook(embedding_hook))
    else:
        for i in ids:
            layer = layer_list[i]
            layer._tngram_state = state  # type: ignore[assignment]  # (as emb's above)
            state.handles.append(
                layer.register_forward_pre_hook(
                    functools.partial(layer_pre_hook, f"layer{i}"), with_kwargs=True
                )
            )
    place_tables(model, spec.get("table_device"))
    install_call_hooks(base, state)
    if base is not model:
        install_call_hooks(model, state)
        wrap_prepare_inputs(model)
    state.backbone = BackboneVersions(model)  # again after from_pretrained loads the weights


def memory_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: memory module} of a model with add_memory (empty without)."""
    return {n: m for n, m in model.named_modules() if n.endswith(MEMORY_ATTR)}


# ---- several named memories: one runs, the others are kept aside ---------------------------
# A kept memory is its spec, modules and backbone record (hooks.BackboneVersions), held in the
# outermost model's __dict__: outside forward, parameters(), state_dict and save_pretrained.

KEPT = "_tngram_kept"


def _kept(model: nn.Module) -> dict[str, tuple[dict[str, Any], dict[int, nn.Module], Any]]:
    return model.__dict__.setdefault(KEPT, {})


def memory_names(model: nn.Module) -> dict[str, Any]:
    """{"active": the running memory's name (None: none runs), "kept": the others, sorted}."""
    state = getattr(base_model(model), "_tngram_state", None)
    return {"active": None if state is None else state.name, "kept": sorted(_kept(model))}


def check_memory_name(model: nn.Module, name: Any) -> str:
    """`name` must be a non-empty str that no memory of `model` has."""
    if not isinstance(name, str) or not name:
        raise TngramError(f"name must be a non-empty str, got {name!r}")
    if name == memory_names(model)["active"] or name in _kept(model):
        raise TngramError(
            f"this model already has an n-gram memory named {name!r} "
            f"(tngram.hf.remove_memory(model, {name!r}) first, or pass another name=)"
        )
    return name


def set_memory(model: nn.Module, name: str | None) -> nn.Module:
    """Run the memory named `name` (None: none, the plain base); the running one is set aside
    with its weights and optimiser-visible state unchanged, to run again when set. Only the
    running memory is in forward, parameters() (so in an optimiser), save_memory and
    disable_memory. A cache filled while another memory ran is refused. Returns the model."""
    refuse_peft(model)
    names = memory_names(model)
    if name == names["active"]:
        return model
    if name is not None and name not in names["kept"]:
        raise TngramError(f"set_memory: no memory named {name!r} (memories: {names})")
    state = getattr(base_model(model), "_tngram_state", None)
    if state is not None and state.disabled:
        raise TngramError("set_memory inside a disable_memory block: leave the block first")
    spec = memory_spec(model)
    if state is not None and spec is not None:
        cfg, ids, layer_list = check_spec(spec, base_model(model))
        owners = _memory_layers(base_model(model), cfg, ids, layer_list)
        modules = {i: getattr(owner, MEMORY_ATTR) for i, owner in owners}
        remove_memory(model)
        _kept(model)[state.name] = (spec, modules, state.backbone)
    if name is not None:
        spec, modules, backbone = _kept(model).pop(name)
        convert_to_memory_class(model, spec)
        attach_from_spec(model, spec, name, modules)
        getattr(base_model(model), "_tngram_state").backbone = backbone
    return model


def remove_memory(model: nn.Module, name: str | None = None) -> nn.Module:
    """Undo add_memory: hooks, memory modules and the spec go; the model and its config are of
    the family's own classes again. `name`: the memory of that name, running or kept (None: the
    running one). Returns the model."""
    if name is not None and name != memory_names(model)["active"]:
        if _kept(model).pop(name, None) is None:
            raise TngramError(f"remove_memory: no memory named {name!r} ({memory_names(model)})")
        return model
    base = base_model(model)
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


def check_constants(model: nn.Module, where: str) -> None:
    """Every memory buffer (hash multipliers, primes, moduli, offsets) equals what the spec
    builds: a spec edited after training (e.g. Engram's memory.seed) would hash differently."""
    spec = memory_spec(model)
    if spec is None:  # check_loaded calls this only for a model with a memory
        raise TngramError(f"{where}: config.json has no {CONFIG_KEY}")
    base = base_model(model)
    cfg, ids, layer_list = check_spec(spec, base)
    d_model, seed, vocab = (
        hidden_size_of(base.config),
        int(spec["memory_seed"]),
        int(spec["vocab_size"]),
    )
    for i, owner in _memory_layers(base, cfg, ids, layer_list):
        with torch.device("cpu"):
            fresh = dict(_build(cfg, d_model, vocab, i, ids or (0,), seed, None).named_buffers())
        for name, buf in fresh.items():
            # each copy a peft wrapper keeps (transformers' load_adapter has run in from_pretrained
            # of an adapter folder), or the memory itself
            for mem in memory_copies(getattr(owner, MEMORY_ATTR)):
                got = dict(mem.named_buffers()).get(name)
                if (
                    got is not None
                    and got.shape == buf.shape
                    and torch.equal(got.detach().cpu().to(buf.dtype), buf)
                ):
                    continue
                raise TngramError(
                    f"{where}: the saved memory constant {MEMORY_ATTR}.{name} of "
                    f"layer {i} does not match config.json {CONFIG_KEY} (was the "
                    "memory spec edited after saving, e.g. memory.seed?); refusing "
                    "a memory that would hash differently from its trained tables"
                )


def check_loaded(model: nn.Module, info: dict[str, Any], path: Any) -> None:
    """After from_pretrained: the memory weights match the spec (none missing, unexpected or
    re-initialised), else one TngramError (the model would run on uninitialised memory)."""
    where = f"{path}" if path is not None else "from_pretrained"
    spec = memory_spec(model)
    if spec is None:
        return
    bad = {}
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = [k if isinstance(k, str) else k[0] for k in (info.get(kind) or [])]
        keys = [k for k in keys if MEMORY_ATTR in k]
        if keys:
            bad[kind.replace("_keys", "")] = sorted(keys)[:3] + (["..."] if len(keys) > 3 else [])
    if bad:
        raise TngramError(
            f"{where}: the memory weights do not match config.json {CONFIG_KEY} "
            f"(layers {spec['layers']}): {bad}; the spec was edited or "
            "the weights belong to another memory"
        )
    check_constants(model, where)
    check_finite_module(model, where)  # NaN in the weights never loads silently
    place_tables(model, spec.get("table_device"))  # device_map placed them without _apply
    check_digest(spec, f"{where}/config.json {CONFIG_KEY}" if path is not None else where)
    record_backbone(model)  # the weights as loaded


def install_transformers_patches() -> None:
    """Once (idempotent): CONFIG_MAPPING resolves "tngram_<family>" (tngram.hf.classes), and a
    family class loading a folder saved with a memory (LlamaForCausalLM.from_pretrained on a
    tngram_llama folder) raises instead of silently dropping the memory."""
    import transformers

    from tngram.hf import classes

    classes.install()
    PreTrainedModel: Any = transformers.PreTrainedModel  # its from_pretrained is replaced below
    if getattr(PreTrainedModel.from_pretrained, "_tngram_patched", False):
        return
    orig = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(orig)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        out = orig(cls, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if (
            not isinstance(model, TngramModelMixin)
            and getattr(getattr(model, "config", None), CONFIG_KEY, None) is not None
        ):
            raise TngramError(
                f"{args[0] if args else 'this folder'} holds a model with an n-gram memory "
                f"(config.json {CONFIG_KEY}) but {cls.__name__} has none: load it with "
                "AutoModelForCausalLM.from_pretrained (or AutoModel) after `import tngram.hf`"
            )
        return out

    setattr(from_pretrained, "_tngram_patched", True)  # a function's own attribute
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


# the memory classes (tngram.hf.classes) build and check through these two
TngramModelMixin._tngram_build = attach_from_spec
TngramModelMixin._tngram_check = check_loaded
