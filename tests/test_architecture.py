"""docs/ARCHITECTURE.md "Add a memory", executed: a toy memory defined here, through the memory
contract (tngram.memory.base) and register_memory only, is selected with `--set
model.memory.kind=toy`, grouped by the optimiser rules, trained a few steps by the real trainer,
saved and loaded back. Nothing outside this file names its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

import tngram.memory
from test_train_support import one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.common import TngramError
from tngram.memory import register_memory
from tngram.memory.base import MemoryConfig, MemoryModule
from tngram.memory.ngrams import extend_with_history
from tngram.optim.groups import build_param_groups
from tngram.train.config import OptimConfig


# ---- step 1 of the checklist: one file with a config and a module --------------------------
@dataclass(kw_only=True, frozen=True)
class ToyBigramConfig(MemoryConfig):
    """y = scale * T[x_{t-1}]: a previous-token table with a zero-init scalar gate."""
    kind: ClassVar[str] = "toy"
    injection: ClassVar[str] = "block"
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {"width": (1, 4096)}
    width: int = 8
    pad_id: int = 0

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not 0 <= self.pad_id < vocab_size:
            raise TngramError(f"toy pad_id {self.pad_id} is outside [0, {vocab_size})")

    def make_module(self, *, d_model: int, vocab_size: int, layer_id: int,
                    layer_ids: tuple[int, ...]) -> "ToyBigram":
        return ToyBigram(self, d_model, vocab_size)

    def param_count(self, *, d_model: int, vocab_size: int, layer_id: int = 0,
                    layer_ids: tuple[int, ...] | None = None) -> int:
        return vocab_size * self.width + self.width * d_model + 1


class ToyBigram(MemoryModule, nn.Module):
    def __init__(self, cfg: ToyBigramConfig, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.config = cfg
        self.table = nn.Parameter(torch.randn(vocab_size, cfg.width))      # a lookup table
        self.proj = nn.Linear(cfg.width, d_model, bias=False)              # a matrix (Muon)
        self.scale = nn.Parameter(torch.zeros(1))                          # starts as a no-op

    def table_parameters(self) -> list[nn.Parameter]:
        return [self.table]

    def control_parameters(self) -> list[nn.Parameter]:
        return [self.scale]

    def forward(self, h: Tensor, input_ids: Tensor, cache: dict | None = None,
                valid: Tensor | None = None) -> Tensor:
        ids, P = extend_with_history(input_ids, cache, 2, self.config.pad_id, valid)   # (B, P+T)
        prev = torch.cat([ids.new_full((ids.shape[0], 1), self.config.pad_id), ids[:, :-1]], 1)
        y = self.scale * self.proj(self.table[prev[:, P:]])                # (B, T, D)
        return y.to(h.dtype)


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(tngram.memory, "_registered", {})   # undone after the test
    register_memory(ToyBigramConfig)                        # step 2 of the checklist


def test_contract_checks_and_counts(toy_registered):
    with pytest.raises(TngramError, match=r"model.memory.width must be an int in \[1, 4096\]"):
        ToyBigramConfig(width=0)
    with pytest.raises(TngramError, match="pad_id"):
        ToyBigramConfig(pad_id=9).build(d_model=4, vocab_size=9)
    m = ToyBigramConfig().build(d_model=4, vocab_size=9)
    assert sum(p.numel() for p in m.parameters()) == ToyBigramConfig().param_count(d_model=4, vocab_size=9)


def test_a_new_memory_trains_with_the_real_trainer(toy_registered, tiny_data, tmp_path):
    from tngram.train.checkpoint import load_run_model
    from tngram.train.loop import train
    cfg = tiny_config(tiny_data, "mini-raw", extra=["model.memory.kind=toy", "model.memory.width=4",
                                                    "model.memory_layers=1", "schedule.steps=4",
                                                    "run.val_every=0", "run.checkpoint_every=0"])
    assert isinstance(cfg.model.memory, ToyBigramConfig) and cfg.model.memory.width == 4
    # the optimiser rules ask the module: table -> memory_table (Adam), scale -> scalar, proj -> Muon
    from tngram.model.gpt import GPT
    torch.manual_seed(0)
    groups = {n: g["group"] for g in build_param_groups(GPT(cfg.model), OptimConfig()) for n in g["names"]}
    assert groups["blocks.1.memory.table"] == "memory_table"
    assert groups["blocks.1.memory.scale"] == "scalar" and groups["blocks.1.memory.proj.weight"] == "muon"

    run = tmp_path / "run"
    summary = train(cfg, run, progress=False)
    V, D = cfg.model.vocab_size, cfg.model.n_embd
    assert summary["steps"] == 4 and summary["healthy"]
    assert summary["memory_params"] == summary["delta_params"] == V * 4 + 4 * D + 1
    w = load_file(str(run / "model.safetensors"))
    assert float(w["blocks.1.memory.scale"].abs()) > 0                   # the gate opened
    model, saved = load_run_model(run)                                    # config.json round trip
    assert saved["model"]["memory"] == {"kind": "toy", "width": 4, "pad_id": 0}
    assert isinstance(model.blocks[1].memory, ToyBigram)
    # decode with the cache equals the full forward (the contract's cache / extend_with_history)
    ids = torch.randint(1, V, (1, 12))
    full = model(ids)
    cache: dict = {}
    step = torch.cat([model(ids[:, :5], cache=cache), model(ids[:, 5:], cache=cache)], 1)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
