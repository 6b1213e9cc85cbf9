"""Where the decoder layers of a Hugging Face causal LM live, per model family.

`DECODER_LAYERS[config.model_type]` is the dotted path, under the base model
(`model.base_model`: LlamaModel, GPT2Model, ...), of the nn.ModuleList of decoder layers. A family
outside the table whose base model has a non-empty `layers` ModuleList (qwen3, mixtral, gemma,
phi, olmo2, ... -- the usual transformers layout) uses it; any other takes an explicit
`layers_attr` (same meaning), so an unknown architecture gets one error saying what to pass
instead of a guessed layer list.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tngram.common import TngramError

DECODER_LAYERS = {
    "llama": "layers",
    "qwen2": "layers",
    "mistral": "layers",
    "gpt2": "h",
    "gpt_neox": "layers",
}


AUTO_LAYERS = "layers"  # the plain transformers layout, used for families outside the table


def decoder_layers_attr(
    model_type: str | None, layers_attr: str | None = None, base: nn.Module | None = None
) -> str:
    """The dotted path of the decoder-layer list: `layers_attr` if given, else the family's,
    else `layers` when `base` has a non-empty nn.ModuleList there."""
    if layers_attr:
        return layers_attr
    if model_type in DECODER_LAYERS:
        return DECODER_LAYERS[model_type]
    auto = getattr(base, AUTO_LAYERS, None) if base is not None else None
    if isinstance(auto, nn.ModuleList) and len(auto) > 0:
        return AUTO_LAYERS
    raise TngramError(
        f"tngram.hf does not know where the decoder layers of model_type {model_type!r} are "
        f"(known: {', '.join(sorted(DECODER_LAYERS))}, or any with base_model.layers); pass "
        f"layers_attr='...', the dotted path "
        "of the nn.ModuleList of decoder layers under model.base_model (e.g. 'layers' or 'h')"
    )


def find_decoder_layers(
    base: nn.Module, model_type: str | None, layers_attr: str | None = None
) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the decoder layers of a base model; one clear error otherwise."""
    path = decoder_layers_attr(model_type, layers_attr, base)
    try:
        layers = base.get_submodule(path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TngramError(
            f"{type(base).__name__} has no non-empty nn.ModuleList at {path!r}; pass "
            "layers_attr naming the list of decoder layers under model.base_model"
        )
    return path, layers


def refuse_non_attention_cache(config: Any) -> None:
    """One TngramError for a family whose cache is not an attention cache (Mamba and other
    linear-attention / state-space models): the memory counts the tokens its cache holds
    (Cache.get_seq_length), which such a cache cannot say. Checked on an empty DynamicCache
    built from the config (no tensors)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config DynamicCache cannot read: the forward will tell
        return
    try:
        cache.get_seq_length()
    except ValueError:
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise TngramError(
            f"add_memory: model_type {getattr(config, 'model_type', None)!r} keeps no attention "
            f"cache (its cache layers are {', '.join(kinds) or 'not attention layers'}: Mamba / "
            "linear attention); the n-gram memory keeps its decode state beside an attention "
            "cache, so these models are not supported"
        ) from None
