"""PEFT and the memory: which order works, and what is refused.

    add_memory(model, ...)  then  get_peft_model(model, LoraConfig(...,
        modules_to_save=["ngram_memory"]))        works: the adapter saves the memory with it
    get_peft_model first, then add_memory on the PeftModel or on its inner model
                                                  refused: PeftModel.save_pretrained would write
                                                  none of the memory (it saves only the modules
                                                  its config names, fixed at get_peft_model)
    PeftModel.from_pretrained(base, adapter) where the adapter holds memory weights and base
        has no memory                             refused (peft would load it silently without)

The last check wraps peft's `set_peft_model_state_dict` as PeftModel.load_adapter calls it;
`import tngram.hf` installs it (tngram.hf.register, which imports peft when it is installed).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from tngram.common import TngramError
from tngram.hf.classes import MEMORY_ATTR

ORDER = (
    "add the memory to the base model first, then wrap it: add_memory(model, ...); "
    'get_peft_model(model, LoraConfig(..., modules_to_save=["ngram_memory"])) '
    "(or keep the memory apart with tngram.hf.save_memory)"
)


def is_peft_model(model: Any) -> bool:
    """A peft PeftModel (or anything with its interface), without importing peft."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _has_tuner_layers(model: nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer_cls = getattr(tuners, "BaseTunerLayer", None)
    if layer_cls is None:
        return False
    return any(isinstance(m, layer_cls) for m in model.modules())


def refuse_peft(model: nn.Module) -> None:
    """One TngramError if add_memory is given a PeftModel or a model already holding adapters."""
    if is_peft_model(model):
        raise TngramError(f"add_memory got a {type(model).__name__}: {ORDER}")
    if _has_tuner_layers(model):
        raise TngramError(
            "this model already holds PEFT adapter layers (get_peft_model ran before "
            f"add_memory), so the adapter would save none of the memory: {ORDER}"
        )


def check_adapter_keys(model: nn.Module, keys: Any, where: str = "the PEFT adapter") -> None:
    """An adapter whose weights include memory tensors needs a base with the memory."""
    tagged = [k for k in keys if MEMORY_ATTR in str(k).split(".")]
    if tagged and not any(n.split(".")[-1] == MEMORY_ATTR for n, _ in model.named_modules()):
        raise TngramError(
            f"{where} holds n-gram memory weights ({tagged[0]}, ...) but the base model has no "
            "memory: add_memory with the same spec (or tngram.hf.load_memory) before loading "
            "the adapter"
        )


def install_peft_patches() -> None:
    """Wrap peft.peft_model.set_peft_model_state_dict with check_adapter_keys (idempotent;
    nothing without peft installed)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return
    import peft.peft_model

    module: Any = peft.peft_model  # peft's module (its attributes untyped)
    orig = getattr(module, "set_peft_model_state_dict", None)
    if orig is None or getattr(orig, "_tngram_patched", False):
        return

    def set_peft_model_state_dict(model: Any, peft_model_state_dict: Any, *a: Any, **kw: Any):
        check_adapter_keys(model, list(peft_model_state_dict))
        return orig(model, peft_model_state_dict, *a, **kw)

    patched: Any = functools.wraps(orig)(set_peft_model_state_dict)  # a function with orig's name
    patched._tngram_patched = True
    module.set_peft_model_state_dict = patched
