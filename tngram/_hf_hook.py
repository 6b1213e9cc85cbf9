"""Register tngram with transformers when (and only when) transformers is imported.

`import tngram` must stay cheap, so it does not import transformers. Instead it installs a
`sys.meta_path` finder that waits for the top-level `transformers` module: once that module has
executed, `tngram.hf.register()` runs (PreTrainedModel.post_init learns to rebuild memories from
`config.tngram_memory`; registering modules add their Auto classes). If transformers is already
imported, register() runs at once. This is what makes `AutoModelForCausalLM.from_pretrained(dir)`
rebuild a saved memory model after `import tngram`, without trust_remote_code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "transformers"


def _register() -> None:
    from tngram.hf import register

    register()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)      # one shot; also avoids finding ourselves below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if transformers is loaded, else when it gets imported (idempotent)."""
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
