"""The `tngram_<family>` model types: a model with an n-gram memory is its own transformers class.

add_memory turns a `LlamaForCausalLM` with a `LlamaConfig` into a `TngramLlamaForCausalLM` with a
`TngramLlamaConfig` (subclasses made here on first use, one per family). The config subclass has
`model_type = "tngram_llama"` and one more field, `tngram_memory` (the memory spec), so

- the spec lives on `model.config` and `save_pretrained` writes it like any other field;
- a saved folder says `"model_type": "tngram_llama"`: in a process that did not import tngram.hf,
  AutoConfig / AutoModelForCausalLM / pipeline refuse it ("model type `tngram_llama` ... does not
  recognize this architecture") instead of loading the backbone without its memory;
- after `import tngram.hf`, `CONFIG_MAPPING["tngram_<family>"]` resolves on demand (the mapping's
  lookup is extended once, see `install`), and the Auto classes map the new config to the
  memory classes: from_pretrained needs neither remote code nor trust_remote_code.

The model subclass builds the memory from `config.tngram_memory` after the family's own
`__init__` (so only the outermost model gets it: nested PreTrainedModels such as OPT's decoder
see a config with a spec but are not memory classes) and checks on `from_pretrained` that the
weights match the spec (tngram.hf.attach.check_loaded).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from tngram.common import TngramError

if TYPE_CHECKING:  # the mixin's super() is the PreTrainedModel family class it is mixed into
    from transformers import PreTrainedModel as _ModelBase
else:
    _ModelBase = object

PREFIX = "tngram_"
CONFIG_KEY = "tngram_memory"
MEMORY_ATTR = "ngram_memory"  # child name of the memory module (decoder layer or base model)

_LOCK = threading.RLock()
_CONFIGS: dict[type, type] = {}  # base config class -> memory config class
_MODELS: dict[type, type] = {}  # base model class -> memory model class
_BASES: dict[type, type] = {}  # memory class -> base class


class TngramConfigMixin:
    """Marker of the memory config classes; `base_model_type` is the family's own model_type."""

    base_model_type: str = ""

    @classmethod
    def get_config_dict(cls, *args: Any, **kwargs: Any) -> Any:
        """The family's; a config.json of the family itself (a base without a memory: peft reads
        its base's config on every save) reads as this class's model type, the same network,
        where transformers would warn that it makes a `tngram_<family>` from a `<family>`."""
        family: Any = super(TngramConfigMixin, cls)  # the family config class after this mixin
        config_dict, rest = family.get_config_dict(*args, **kwargs)
        if isinstance(config_dict, dict) and config_dict.get("model_type") == cls.base_model_type:
            config_dict = {**config_dict, "model_type": getattr(cls, "model_type")}
        return config_dict, rest


class TngramModelMixin(_ModelBase):
    """Builds the memory of `config.tngram_memory` after the family's __init__; checks loads.

    The building and the checks are tngram.hf.attach's `attach_from_spec` / `check_loaded`,
    which attach installs here when it is imported (it imports this module, never the other way
    round; every memory class is made through attach)."""

    _tngram_build: ClassVar[Callable[[Any, dict], None]]
    _tngram_check: ClassVar[Callable[[Any, dict, Any], None]]

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        spec = getattr(config, CONFIG_KEY, None)
        if spec is not None:
            self._tngram_build(spec)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count; with exclude_embeddings every memory lookup table is left out
        like an embedding (transformers alone drops only nn.Embedding weights: Engram's tables
        but not TN-gram's CP factors)."""
        n = super().num_parameters(
            only_trainable=only_trainable, exclude_embeddings=exclude_embeddings
        )
        if not exclude_embeddings:
            return n
        from torch import nn

        embedded = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        seen: set[int] = set()
        for name, mod in self.named_modules():
            if not name.endswith(MEMORY_ATTR):
                continue
            for p in getattr(mod, "table_parameters", list)():
                if id(p) in embedded or id(p) in seen or (only_trainable and not p.requires_grad):
                    continue
                seen.add(id(p))
                n -= p.numel()
        return n

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' from_pretrained; a memory's tokenizer_path must name a file inside the
        folder (tngram.hf.gpt_folder.pin_memory_tokenizer) and each weights file must match its
        payload sha256 (verify_weights_digest) before the memory is built, and the loaded
        weights must match the spec (tngram.hf.attach.check_loaded)."""
        import os

        from tngram.hf.gpt_folder import HUB_KWARGS, pin_memory_tokenizer, verify_weights_digest

        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        config = kwargs.pop("config", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
            where_from = config or source
            if cls.config_class is None or where_from is None:
                raise TngramError(f"{cls.__name__}.from_pretrained: name a folder or a hub repo")
            config = cls.config_class.from_pretrained(where_from, **hub)
        spec = getattr(config, CONFIG_KEY, None)
        mem = spec.get("memory") if isinstance(spec, dict) else None
        where = f"{source}/config.json" if isinstance(source, (str, os.PathLike)) else "config"
        saved = pin_memory_tokenizer(mem, source, where, kwargs, f"{CONFIG_KEY}.memory")
        if spec is not None:
            verify_weights_digest(config, source, where, kwargs)
        want_info = kwargs.pop("output_loading_info", False)
        # with output_loading_info=True transformers returns (model, info), not the model its
        # annotation says
        loaded: Any = super().from_pretrained(
            *args, config=config, output_loading_info=True, **kwargs
        )
        model, info = loaded
        if saved is not None:  # the config keeps the folder's own name, never a full path
            getattr(model.config, CONFIG_KEY)["memory"]["tokenizer_path"] = saved
        model._tngram_check(info, source)
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' save_pretrained; config.json then records each weights file's payload
        sha256 (tngram.hf.gpt_folder.record_weights_digest), which from_pretrained checks."""
        from tngram.hf.gpt_folder import record_weights_digest

        out = super().save_pretrained(save_directory, *args, **kwargs)
        if getattr(self.config, CONFIG_KEY, None) is not None and kwargs.get(
            "is_main_process", True
        ):
            record_weights_digest(save_directory)
        return out


def base_class(cls: type) -> type:
    """The family class under a memory class (the class itself otherwise)."""
    return _BASES.get(cls, cls)


def config_class_for(base: type) -> type:
    """The memory config class of a family's config class (created and registered once)."""
    from transformers import AutoConfig

    base = base_class(base)
    with _LOCK:
        if base not in _CONFIGS:
            model_type = getattr(base, "model_type", "") or ""
            if not model_type:
                raise TngramError(
                    f"{base.__name__} has no model_type; add_memory needs a "
                    "registered transformers config class"
                )
            cls = type(
                f"Tngram{base.__name__}",
                (TngramConfigMixin, base),
                {
                    "__module__": __name__,
                    "__qualname__": f"Tngram{base.__name__}",
                    "model_type": PREFIX + model_type,
                    "base_model_type": model_type,
                    "__annotations__": {CONFIG_KEY: "dict | None"},
                    CONFIG_KEY: None,
                },
            )
            _CONFIGS[base], _BASES[cls] = cls, base
            AutoConfig.register(PREFIX + model_type, cls, exist_ok=True)
            _register_auto_models(base, cls)
        return _CONFIGS[base]


def model_class_for(base: type, config_cls: type | None = None) -> type:
    """The memory model class of a family's model class (created once)."""
    base = base_class(base)
    with _LOCK:
        if base not in _MODELS:
            cfg_cls = config_cls or config_class_for(getattr(base, "config_class"))
            cls = type(
                f"Tngram{base.__name__}",
                (TngramModelMixin, base),
                {
                    "__module__": __name__,
                    "__qualname__": f"Tngram{base.__name__}",
                    "config_class": cfg_cls,
                },
            )
            _MODELS[base], _BASES[cls] = cls, base
        return _MODELS[base]


def _auto_mappings() -> list[Any]:
    from transformers.models.auto import modeling_auto as ma

    return [
        getattr(ma, name)
        for name in ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_MAPPING")
        if hasattr(ma, name)
    ]


def _register_auto_models(base_cfg: type, cfg_cls: type) -> None:
    """Map the memory config to the memory classes of the family's causal LM and base model."""
    for mapping in _auto_mappings():
        try:
            model_cls = mapping[base_cfg]
        except (KeyError, AttributeError, ImportError):
            continue
        if isinstance(model_cls, (list, tuple)):
            model_cls = model_cls[0]
        if base_cfg is not getattr(model_cls, "config_class", base_cfg):
            continue
        mapping.register(cfg_cls, model_class_for(model_cls, cfg_cls), exist_ok=True)


def resolve_model_type(model_type: Any) -> type | None:
    """The memory config class of "tngram_<family>" (registering it), or None."""
    if not (isinstance(model_type, str) and model_type.startswith(PREFIX)):
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = model_type[len(PREFIX) :]
    if family.startswith(PREFIX) or family not in CONFIG_MAPPING:
        return None
    return config_class_for(CONFIG_MAPPING[family])


def install() -> None:
    """Let CONFIG_MAPPING resolve "tngram_<family>" on demand (idempotent). The mapping object's
    class is swapped for a subclass whose lookups try `resolve_model_type` first."""
    from transformers.models.auto import configuration_auto as ca

    mapping = ca.CONFIG_MAPPING
    if getattr(type(mapping), "_tngram_resolving", False):
        return
    base = type(mapping)

    class _Resolving(base):  # type: ignore[misc, valid-type]
        _tngram_resolving = True

        def __getitem__(self, key: str) -> Any:
            if key not in self._extra_content and resolve_model_type(key) is not None:
                return self._extra_content[key]
            return super().__getitem__(key)

        def __contains__(self, item: object) -> bool:
            if super().__contains__(item):
                return True
            return resolve_model_type(item) is not None

    _Resolving.__name__ = _Resolving.__qualname__ = base.__name__
    mapping.__class__ = _Resolving
