"""The memory contract: what every n-gram memory (TN-gram, Engram, Over-Encoding, yours) provides.

A memory is two classes, written in one file of `tngram/memory/` and registered in
`tngram.memory.MEMORY_KINDS`:

    config (frozen dataclass, subclass of MemoryConfig)       module (nn.Module + MemoryModule)
      kind, injection          class attributes                 forward(h, input_ids, cache, valid)
      check()                  runs at construction             table_parameters()
      check_vocab(vocab_size)  the checks that need V           control_parameters()
      build(*, d_model, vocab_size, layer_id, layer_ids)
      param_count(*, same arguments)   exact count of build(...)

Optional hooks, declared below with their defaults (a memory overrides only what it has; callers
use them directly, never through getattr/hasattr):

    config                                      module
      moved_fields      fields now of another     sparse_grad   (RowSparse modules only) True
                        kind: {field: kind}                     while the tables train row-sparse
      row_sparse        modules are RowSparse     row_sparse_problem()  why not now ("" = can)
      row_sparse_problem()  why the tables cannot
                        train row-sparse ("" = can)
      link_layers(modules)  tie the layers'
                        modules after building
      reshape_step()    step of a shape change

`injection` is "block" (the module's output is added to the residual stream of each block in
`model.memory_layers`, before attention) or "embedding" (one module; its output replaces the
token embedding). Config validation (tngram.train.config) and optimiser grouping
(tngram.optim.groups) ask these methods; neither names a memory's fields.

Generic field ranges (checked by `check()` for every field of a subclass, so a typo such as an
extra zero fails before a model is built): ints in [0, 2^40] unless `int_bounds` says otherwise,
floats finite and >= 0 (> 0 for the names in `positive_floats`), tuples of ints in [1, 2^40];
bools, strings and None are left to the subclass's `check_fields()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from torch import nn

from tngram.common import TngramError

INT_MAX = 1 << 40
INJECTIONS = ("block", "embedding")


@dataclass(kw_only=True, frozen=True)
class MemoryConfig:
    """Base of every memory config. Subclasses set `kind`, `injection`, the bounds, implement
    `check_fields()` (cross-field checks), `check_vocab()` (checks that need the vocabulary),
    `make_module()` and `param_count()`."""

    kind: ClassVar[str] = ""
    injection: ClassVar[str] = "block"
    # the int field holding the optimiser step after which the module changes its parameter
    # shapes (0 there: never), e.g. TN-gram's adaptive CP rank; "" when the memory never does
    reshape_step_field: ClassVar[str] = ""
    # field name -> (lo, hi) for int fields; unnamed ints are in [0, INT_MAX]
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {}
    positive_floats: ClassVar[frozenset[str]] = frozenset()

    # ---- optional hooks: declared with their defaults --------------------------------------
    # fields this kind no longer has, each -> the kind that holds it now: a saved config dict
    # (config.json, an exported memory spec) or a --set of this kind naming one is read as that
    # kind (tngram.memory.migrate_memory_dict)
    moved_fields: ClassVar[dict[str, str]] = {}
    # True when the memory's modules are RowSparse (below): their lookup tables can get a
    # row-sparse gradient, which optim.memory_update=sparse|rowwise needs
    row_sparse: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.check()

    def link_layers(self, modules: list[nn.Module]) -> None:
        """Called once after one module per memory layer is built (`modules` in layer order), by
        the GPT and by tngram.hf.add_memory: ties the layers' modules together (e.g. TN-gram
        share_factors: the first module owns A_1..A_N). Default: the layers are independent."""

    def row_sparse_problem(self) -> str:
        """Why this memory's tables cannot train row-sparse (optim.memory_update=sparse|rowwise),
        as one line naming the setting to change; "" when they can. Checked with the training
        config, before any data or weights are touched. Default: supported iff `row_sparse`."""
        if self.row_sparse:
            return ""
        return (
            f"optim.memory_update sparse/rowwise needs row-sparse table gradients, which "
            f"model.memory.kind={self.kind} does not provide; use optim.memory_update=dense"
        )

    # ---- checks ----------------------------------------------------------------------------
    def check(self) -> None:
        """Generic ranges of every field (names as in config.json: model.memory.<field>), then
        the subclass's own `check_fields()`; TngramError on the first violation."""
        for f in fields(self):
            v, key = getattr(self, f.name), f"model.memory.{f.name}"
            if isinstance(v, bool) or v is None or isinstance(v, str):
                continue
            if isinstance(v, int):
                lo, hi = self.int_bounds.get(f.name, (0, INT_MAX))
                if not lo <= v <= hi:
                    raise TngramError(f"{key} must be an int in [{lo}, {hi}], got {v!r}")
            elif isinstance(v, float):
                if f.name in self.positive_floats:
                    if not (math.isfinite(v) and v > 0):
                        raise TngramError(f"{key} must be a finite float > 0, got {v!r}")
                elif not (math.isfinite(v) and v >= 0):
                    raise TngramError(f"{key} must be a finite float >= 0, got {v!r}")
            elif isinstance(v, tuple):
                if not all(
                    isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= INT_MAX for x in v
                ):
                    raise TngramError(f"{key} must be ints in [1, {INT_MAX}], got {v!r}")
        self.check_fields()

    def check_fields(self) -> None:
        """Checks that involve several fields or non-numeric ones (override)."""

    def reshape_step(self) -> int:
        """The step after which the module changes its parameter shapes (0: never). The trainer
        refuses what cannot follow a reshape (DDP, row-sparse table optimisers)."""
        return int(getattr(self, self.reshape_step_field)) if self.reshape_step_field else 0

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the vocabulary size (override; call super first)."""
        if vocab_size < 1:
            raise TngramError(f"vocab_size must be >= 1, got {vocab_size}")

    # ---- building --------------------------------------------------------------------------
    def build(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> nn.Module:
        """The module of layer `layer_id` (a block index, or 0 for an embedding memory) in a
        model whose memory layers are `layer_ids` (default: just this one)."""
        self.check_vocab(vocab_size)
        layer_ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
        return self.make_module(
            d_model=d_model, vocab_size=vocab_size, layer_id=layer_id, layer_ids=layer_ids
        )

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> nn.Module:
        raise NotImplementedError

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """Exact number of parameters of `build(...)` with the same arguments."""
        raise NotImplementedError


class RowSparse:
    """Mixin of a module whose lookup tables can produce a row-sparse gradient
    (tngram.kernels.sparse_rows: only the rows a step read). tngram.optim.memory_update sets
    `sparse_grad` on the instance when optim.memory_update is "sparse" / "rowwise"; the module
    then returns the same values with a row-sparse table gradient. A memory whose module (or a
    submodule, e.g. TN-gram's hashed table) is RowSparse sets `row_sparse = True` on its
    config."""

    sparse_grad: bool = False

    def row_sparse_problem(self) -> str:
        """Why this instance cannot produce a row-sparse gradient now (one line; "" = it can)."""
        return ""


def builds_row_sparse_grads(model: nn.Module) -> bool:
    """Whether a memory of `model` returns row-sparse table gradients now (`sparse_grad` set by
    optim.memory_update sparse / rowwise)."""
    return any(isinstance(m, RowSparse) and m.sparse_grad for m in model.modules())


class MemoryModule:
    """Mixin of every memory nn.Module: which of its parameters are lookup tables (Adam at the
    table learning rate, never Muon) and which are control parameters (gains, scales, per-channel
    conv kernels: Adam at the scalar learning rate). Everything else is grouped by shape and
    type (nn.Linear weights -> Muon, 1-D -> scalar) in tngram.optim.groups."""

    def table_parameters(self) -> list[nn.Parameter]:
        return []

    def control_parameters(self) -> list[nn.Parameter]:
        return []


class SharesParameters(nn.Module):
    """Mixin of a memory module that can read another layer's parameter in place of its own
    (Memory+'s shared value table, TN-gram's shared factors): the tensor stays a parameter of
    the owner only, so it is counted, optimised and saved once."""

    def share_parameter(self, name: str, owner: nn.Module, option: str) -> None:
        """Drop this module's parameter `name` and read `owner`'s (same shape)."""
        own, theirs = self._parameters[name], getattr(owner, name)
        assert own is not None  # registered as an nn.Parameter in __init__
        if theirs.shape != own.shape:
            raise TngramError(
                f"{option}: {name} shapes differ {tuple(theirs.shape)} vs {tuple(own.shape)}"
            )
        del self._parameters[name]
        self.__dict__.setdefault("_shared_from", {})[name] = owner  # not a registered submodule

    def __getattr__(self, name: str) -> Any:
        owner = self.__dict__.get("_shared_from", {}).get(name)
        if owner is not None:
            return getattr(owner, name)
        return super().__getattr__(name)
