"""Where the decoder layers of a Hugging Face causal LM live, per model family.

`DECODER_LAYERS[config.model_type]` is the dotted path, under the base model
(`model.base_model`: LlamaModel, GPT2Model, ...), of the nn.ModuleList of decoder layers. A model
outside the table takes an explicit `layers_attr` (same meaning); nothing is guessed, so an
unknown architecture gets one error saying what to pass instead of a silently wrong layer list.
"""

from __future__ import annotations

from torch import nn

from tngram.common import TngramError

DECODER_LAYERS = {
    "llama": "layers",
    "qwen2": "layers",
    "mistral": "layers",
    "gpt2": "h",
    "gpt_neox": "layers",
}


def decoder_layers_attr(model_type: str | None, layers_attr: str | None = None) -> str:
    """The dotted path of the decoder-layer list: `layers_attr` if given, else the family's."""
    if layers_attr:
        return layers_attr
    if model_type in DECODER_LAYERS:
        return DECODER_LAYERS[model_type]
    raise TngramError(
        f"tngram.hf does not know where the decoder layers of model_type {model_type!r} are "
        f"(known: {', '.join(sorted(DECODER_LAYERS))}); pass layers_attr='...', the dotted path "
        "of the nn.ModuleList of decoder layers under model.base_model (e.g. 'layers' or 'h')")


def find_decoder_layers(base: nn.Module, model_type: str | None,
                        layers_attr: str | None = None) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the decoder layers of a base model; one clear error otherwise."""
    path = decoder_layers_attr(model_type, layers_attr)
    try:
        layers = base.get_submodule(path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TngramError(f"{type(base).__name__} has no non-empty nn.ModuleList at {path!r}; pass "
                          "layers_attr naming the list of decoder layers under model.base_model")
    return path, layers
