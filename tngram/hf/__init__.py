"""Hugging Face `transformers` integration (optional extra: pip install "tngram[hf]").

    import tngram.hf                     # switches the integration on (see register())
    from tngram.hf import add_memory
    add_memory(model, TNGramConfig(max_ngram=3, cp_rank=64), layers=(0, 2))

puts TN-gram, Engram or Over-Encoding into an existing decoder-only model (Llama, Qwen2,
Mistral, GPT-2, GPT-NeoX families, any family whose decoder layers are `base_model.layers`, or
any model given an explicit layer list); generate() stays exact with the KV cache;
save_pretrained / from_pretrained round-trip it; MemoryTrainer / memory_optimizer train it with
Trainer (memory_update dense / sparse / rowwise); save_memory / load_memory ship it as an
adapter apart from its base (tngram.hf.adapter); it composes with peft when added first
(tngram.hf.peft_compat). See docs/HF.md.

`import tngram` alone touches neither transformers nor peft. Importing this package (any
`tngram.hf...` module) imports transformers and runs `register()` once: from then on the Auto
classes open saved memory models and exported runs. The public names below load on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# public name -> module that defines it (loaded on first access)
_LAZY = {
    "add_memory": "tngram.hf.attach",
    "remove_memory": "tngram.hf.attach",
    "set_memory": "tngram.hf.attach",
    "memory_names": "tngram.hf.attach",
    "memory_modules": "tngram.hf.attach",
    "memory_spec": "tngram.hf.attach",
    "set_trainable": "tngram.hf.attach",
    "memory_cache_class": "tngram.hf.cache_state",
    "save_memory": "tngram.hf.adapter",
    "load_memory": "tngram.hf.adapter",
    "disable_memory": "tngram.hf.adapter",
    "trainable_parameters": "tngram.hf.adapter",
    "print_trainable_parameters": "tngram.hf.adapter",
    "split_memory_params": "tngram.optim.groups",
    "memory_param_groups": "tngram.optim.groups",
    "TngramGPTConfig": "tngram.hf.gpt_model",
    "TngramGPTForCausalLM": "tngram.hf.gpt_model",
    "export_run": "tngram.hf.export",
    "memory_optimizer": "tngram.hf.trainer",
    "MemoryTrainer": "tngram.hf.trainer",
    "settle_memory_tables": "tngram.hf.table_update",
}

# modules imported by register(): each registers its own config/model classes with the Auto
# classes at import time (the export of our GPT adds its module here)
_REGISTERING_MODULES: tuple[str, ...] = ("tngram.hf.gpt_model",)

__all__ = sorted(_LAZY) + ["register", "register_auto_classes"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tngram.hf' has no attribute {name!r}")


def register_auto_classes() -> None:
    """Import the modules that register Auto classes (idempotent: imports run once)."""
    for mod in _REGISTERING_MODULES:
        importlib.import_module(mod)


def register() -> None:
    """Teach transformers (and peft, when installed) about tngram; idempotent, and run when this
    package is imported. The model types "tngram_<family>" of models with a memory resolve on
    demand (tngram.hf.classes), a family class loading such a folder raises instead of
    dropping the memory, the modules in _REGISTERING_MODULES register their Auto classes
    ("tngram_gpt" of `tngram export`), and peft's and transformers' adapter loading check
    memory weights (tngram.hf.peft_compat)."""
    from tngram.hf import attach, peft_compat

    attach.install_transformers_patches()
    register_auto_classes()
    peft_compat.install_peft_patches()
    peft_compat.install_adapter_loading_check()


if importlib.util.find_spec("transformers") is None:
    raise ModuleNotFoundError(
        'tngram.hf needs transformers (the hf extra): pip install "tngram[hf]"', name="transformers"
    )
register()
