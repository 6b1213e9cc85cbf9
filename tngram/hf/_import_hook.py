"""Register tngram with transformers when (and only when) transformers is imported.

`import tngram` must stay cheap, so it does not import transformers. Instead it installs a
`sys.meta_path` finder that waits for three modules and runs a callback right after each executes:

    transformers.modeling_utils  ->  tngram.hf.attach.install_transformers_patches()
                                     (the Auto classes resolve the model types
                                     "tngram_<family>" of saved memory models; a family class
                                     loading such a folder raises instead of dropping the memory)
    transformers                 ->  tngram.hf.register_auto_classes()
                                     (modules listed in tngram.hf register their Auto classes)
    peft.peft_model              ->  tngram.hf.peft_compat.install_peft_patches()
                                     (an adapter holding memory weights refuses a base
                                     without the memory)

Modules already imported get their callback at once. Waiting for modeling_utils (not the top
package) keeps `import transformers` itself as cheap as without tngram. This is what makes
`AutoModelForCausalLM.from_pretrained(dir)` rebuild a saved memory model after `import tngram`,
without trust_remote_code (without tngram, transformers refuses the unknown model type).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any


def _on_transformers() -> None:
    from tngram.hf import register_auto_classes

    register_auto_classes()


def _on_modeling_utils() -> None:
    from tngram.hf.attach import install_transformers_patches

    install_transformers_patches()


def _on_peft_model() -> None:
    from tngram.hf.peft_compat import install_peft_patches

    install_peft_patches()


CALLBACKS = {
    "transformers": _on_transformers,
    "transformers.modeling_utils": _on_modeling_utils,
    "peft.peft_model": _on_peft_model,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callback: Any) -> None:
        self.inner, self.callback = inner, callback

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.callback()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending = {name: cb for name, cb in CALLBACKS.items() if name not in sys.modules}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        callback = self.pending.pop(fullname, None)
        if callback is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:  # the spec the import system would have found
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _Loader(spec.loader, callback)
        return spec


def install() -> None:
    """Run the callbacks of modules already imported; wait for the others (idempotent)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    for name, callback in CALLBACKS.items():
        if name in sys.modules:
            callback()
    finder = _Finder()
    if finder.pending:
        sys.meta_path.insert(0, finder)
