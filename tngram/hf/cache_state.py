"""The n-gram memories' decode state, kept inside the Hugging Face cache object.

Incremental decoding needs, per memory, the last n-1 token ids (n-gram window) and the recent
conv inputs. They live on the transformers `Cache` the model is called with, so that everything
generate() does to the cache happens to them too:

    reorder_cache(beam_idx)        beam search            rows picked by index_select
    batch_select_indices(idx)      contrastive / manual   rows picked
    batch_repeat_interleave(r)     expansion              rows repeated
    crop(-k)                       assisted / prompt-lookup decoding, manual rewinds
    reset()                        cache reuse            state dropped

A cache the memory creates itself (a call with use_cache and no cache) is made of a subclass
adding these overrides (`memory_cache_class(DynamicCache)`, made before any compilation, so a
fullgraph-compiled forward builds it without a class swap). A cache passed in (generate()'s
DynamicCache or StaticCache, yours) has its class swapped for that subclass on first use, in
eager code (it stays an instance of its own class). Dynamo cannot trace a class swap: in a
compiled forward the swap runs eagerly at a graph break (`torch.compiler.disable`), so with
fullgraph=True a plain cache stops compilation with dynamo's graph-break error whose reason is
our line (COMPILED_PLAIN_CACHE); a cache that is already a memory cache (made by the model, by
an eager call, or with memory_cache_class) compiles in one graph. Either way the cache gains
`_tngram_memory = {memory key: state dict}` and `_tngram_seen` (tokens the memories saw).
The memories keep their whole history (`keep_history`, tngram.memory.ngrams), so crop is exact:
the cost is the memory's conv input per position, about one layer's value cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tngram.common import TngramError

_SWAPPED: dict[type, type] = {}
COMPILED_PLAIN_CACHE = (
    "tngram: a compiled forward got a transformers cache that holds no n-gram memory state "
    "(giving it one is a class swap that dynamo cannot trace, so fullgraph=True stops here): "
    "build the cache with tngram.hf.memory_cache_class(DynamicCache)(config=model.config) (or "
    "StaticCache), pass past_key_values=None, or make the first call eagerly"
)
_INSTALL_EAGERLY: Callable[[Any], None] | None = None

if TYPE_CHECKING:  # the mixin's super() is the transformers Cache it is mixed into
    from transformers.cache_utils import Cache as _CacheBase
else:
    _CacheBase = object


class MemoryCacheMixin(_CacheBase):
    """Extends a transformers Cache so the memories' state follows its batch/time edits."""

    _tngram_memory: dict[str, dict[str, Any]]
    _tngram_seen: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tngram_memory = {}
        self._tngram_seen = 0

    def _tngram_apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        for state in self._tngram_memory.values():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    state[key] = fn(value)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._tngram_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._tngram_apply(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._tngram_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        seen = self._tngram_seen
        # <= 0: remove that many tokens (crop(0) is a no-op); > 0 (legacy): keep that many
        keep = seen + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, seen)
        keep = max(keep, 0)
        self._tngram_apply(lambda t: t[:, :keep])
        self._tngram_seen = keep

    def reset(self) -> None:
        super().reset()
        self._tngram_memory.clear()
        self._tngram_seen = 0


def memory_cache_class(cls: type) -> type:
    """The memory subclass of a transformers Cache class (made once; the class itself if it is
    one already): `memory_cache_class(StaticCache)(config=..., max_cache_len=...)` is a cache a
    compiled forward accepts."""
    if issubclass(cls, MemoryCacheMixin):
        return cls
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(cls.__name__, (MemoryCacheMixin, cls), {"__module__": cls.__module__})
    return _SWAPPED[cls]


def memory_states(cache: Any) -> dict[str, dict[str, Any]]:
    """The {memory key: state dict} of a transformers Cache, installing the mixin on first use."""
    if not isinstance(cache, MemoryCacheMixin):
        if torch.compiler.is_compiling():  # a graph break; fullgraph=True reports our line
            assert _INSTALL_EAGERLY is not None  # made by the eager hook install (hooks.py)
            _INSTALL_EAGERLY(cache)
        else:
            _install_state(cache)
    return cache._tngram_memory


def prepare_compiled_install() -> None:
    """Make the eager class-swap wrapper (outside any compiled region: it imports dynamo)."""
    global _INSTALL_EAGERLY
    if _INSTALL_EAGERLY is None:
        _INSTALL_EAGERLY = torch.compiler.disable(_install_state, reason=COMPILED_PLAIN_CACHE)


def _install_state(cache: Any) -> None:
    """Give a plain transformers Cache the memory state (its class swapped for the mixin's)."""
    for name in ("reorder_cache", "crop", "reset"):
        if not callable(getattr(cache, name, None)):
            raise TngramError(
                f"past_key_values of type {type(cache).__name__} is not a "
                "transformers Cache; pass a Cache (e.g. DynamicCache) or None"
            )
    try:
        cache.__class__ = memory_cache_class(type(cache))
    except TypeError as e:
        raise TngramError(
            f"cannot keep the n-gram memory state in a {type(cache).__name__} "
            f"({e}); use DynamicCache or StaticCache"
        ) from None
    cache._tngram_memory = {}
    cache._tngram_seen = 0


def check_and_advance(cache: Any, n_new: int, token: str = "") -> None:
    """Before a forward of n_new tokens: the memories must have seen exactly what the attention
    cache holds (a cache filled without them would give wrong windows), and be the memory that
    `token` names (hooks.MemoryState.token: another memory's state is not theirs); then count
    the new ones."""
    have = int(cache.get_seq_length())
    if have != cache._tngram_seen:
        raise TngramError(
            f"the cache holds {have} tokens but the n-gram memory state holds "
            f"{cache._tngram_seen}: the cache was filled or edited outside this model's forward "
            "(use cache.crop / reorder_cache, or start from a new cache)"
        )
    if cache._tngram_seen and getattr(cache, "_tngram_token", token) != token:
        raise TngramError(
            "the cache was filled while another n-gram memory ran (set_memory, add_memory or "
            "load_memory since): start from a new cache"
        )
    cache._tngram_token = token
    cache._tngram_seen += n_new
