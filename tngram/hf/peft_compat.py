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
`import tngram.hf` installs it (tngram.hf.register, which imports peft when it is installed),
with two more: transformers' own `load_adapter` keeps an adapter's memory weights or refuses
(install_adapter_loading_check), and an adapter saved without task_type names a class
AutoPeftModel can import (loadable_class). Tables shared across layers stay shared through
modules_to_save copies by the hooks (tngram.hf.hooks.relink, using running_memory here).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

from torch import nn

from tngram.common import TngramError
from tngram.hf.classes import MEMORY_ATTR

ORDER = (
    "add the memory to the base model first, then wrap it: add_memory(model, ...); "
    'get_peft_model(model, LoraConfig(..., modules_to_save=["ngram_memory"])) '
    "(or keep the memory apart with tngram.hf.save_memory)"
)


def memory_copies(mod: nn.Module) -> list[nn.Module]:
    """The modules at one position: the module itself, or, for a peft wrapper
    (modules_to_save), its original and each adapter's copy."""
    copies, original = mod._modules.get("modules_to_save"), mod._modules.get("original_module")
    if isinstance(copies, nn.ModuleDict) and original is not None:
        return [original, *copies.values()]
    return [mod]


def running_memory(mod: nn.Module) -> nn.Module:
    """The module a call runs at one position: the module itself, or what a peft wrapper
    (modules_to_save) calls: the active adapter's copy, or its original when adapters are
    disabled or none of its copies is active."""
    copies, original = mod._modules.get("modules_to_save"), mod._modules.get("original_module")
    if not isinstance(copies, nn.ModuleDict) or original is None:
        return mod
    active = cast("list[str]", getattr(mod, "active_adapters", None) or [])
    if getattr(mod, "disable_adapters", False) or not active or active[0] not in copies:
        return original
    return copies[active[0]]


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
    _patch_saved_base_class(module.PeftModel)


def loadable_class(cls: type) -> type:
    """The class an adapter's config should name to rebuild a model of class `cls`: for a memory
    class (made at run time in tngram.hf.classes, so no module holds it by name) the Auto class
    that maps its config to it (AutoModelForCausalLM / AutoModel), else the family's class."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto import modeling_auto

    from tngram.hf.classes import base_class

    family = base_class(cls)
    if family is cls:
        return cls
    for auto, mapping in (
        (AutoModelForCausalLM, "MODEL_FOR_CAUSAL_LM_MAPPING"),
        (AutoModel, "MODEL_MAPPING"),
    ):
        try:
            if getattr(modeling_auto, mapping)[getattr(cls, "config_class")] is cls:
                return auto
        except (KeyError, AttributeError):
            continue
    return family


def _patch_saved_base_class(peft_model_cls: Any) -> None:
    """PeftModel.save_pretrained without a task_type records the model's class for
    AutoPeftModel (its `auto_mapping`): name one that can be imported (loadable_class)."""
    orig = peft_model_cls._get_base_model_class
    if getattr(orig, "_tngram_patched", False):
        return

    def _get_base_model_class(self: Any, *args: Any, **kwargs: Any) -> type:
        return loadable_class(orig(self, *args, **kwargs))

    patched: Any = functools.wraps(orig)(_get_base_model_class)
    patched._tngram_patched = True
    peft_model_cls._get_base_model_class = patched


def install_adapter_loading_check() -> None:
    """transformers' own adapter loading (`model.load_adapter(dir)`, and
    `AutoModelForCausalLM.from_pretrained(adapter_dir)`, which calls it) keeps the memory
    weights an adapter holds or refuses in one line: before loading, an adapter with memory
    weights and a model without the memory (check_adapter_keys, for a local folder or a given
    state dict); after, any memory key the load left unexpected or missing (the adapter is
    removed again)."""
    from transformers.integrations import peft as integration

    mixin: Any = integration.PeftAdapterMixin
    orig = mixin.load_adapter
    if getattr(orig, "_tngram_patched", False):
        return

    def load_adapter(self: Any, *args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("peft_model_id", args[0] if args else None)
        state = kwargs.get("adapter_state_dict", args[3] if len(args) > 3 else None)
        keys = _local_adapter_keys(source) if state is None else list(state)
        where = f"the PEFT adapter {source}" if source is not None else "the PEFT adapter"
        if keys is not None:
            check_adapter_keys(self, keys, where)
        info = orig(self, *args, **kwargs)
        lost = sorted(
            str(k)
            for kind in ("unexpected_keys", "missing_keys")
            for k in (getattr(info, kind, None) or ())
            if MEMORY_ATTR in str(k).split(".")
        )
        if lost:
            name = kwargs.get("adapter_name", args[1] if len(args) > 1 else None) or "default"
            try:
                self.delete_adapter(name)
            except Exception:  # noqa: BLE001  (best effort: the error below is what matters)
                pass
            check_adapter_keys(self, lost, where)
            raise TngramError(
                f"{where}: its n-gram memory weights do not match this model's memory ({lost[0]} "
                "unexpected or missing): add the memory with the spec the adapter was trained "
                "with before loading it"
            )
        return info

    patched: Any = functools.wraps(orig)(load_adapter)
    patched._tngram_patched = True
    mixin.load_adapter = patched


def _local_adapter_keys(source: Any) -> list[str] | None:
    """The tensor names of a local adapter folder's adapter_model.safetensors (None if there is
    none: a hub id, a .bin adapter; the check after loading covers those)."""
    import os
    from pathlib import Path

    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source) / "adapter_model.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())
