"""Training configuration: nested frozen dataclasses, serialised to the run's config.json.

A run = a recipe function (tngram.recipes) + dotted overrides (`--set optim.matrix_lr=0.02`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tngram.model.gpt import GPTConfig


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """Muon for block matrices, Adam for embeddings/tables, controls and scalars (paper App. E)."""
    matrix_lr: float = 0.04            # Muon
    muon_momentum: float = 0.95        # final Nesterov momentum ...
    muon_momentum_start: float = 0.85  # ... ramped linearly from this value
    muon_momentum_warmup_steps: int = 500
    muon_ns_steps: int = 5             # Newton-Schulz iterations
    tied_embed_lr: float = 0.05        # Adam: tied embedding (and head)
    memory_table_lr: float | None = None  # Adam: CP factors / hash tables (None -> tied_embed_lr)
    scalar_lr: float = 0.04            # Adam: scalar / control parameters
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 0.0        # 0 disables


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    steps: int = 6000
    warmdown_steps: int = 1200         # constant lr, then linear decay to 0 over the last steps


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    dir: str | None = None             # dataset folder; None -> the default offline corpus
    global_batch_tokens: int = 524_288 # tokens per optimiser step across all processes
    micro_batch_seqs: int = 64         # sequences per process per micro-step
    val_tokens: int | None = None      # cap on validation tokens (None -> the whole val split)
    seed: int = 0                      # loader seed


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    seed: int = 1337
    dtype: str = "auto"                # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16"
    compile: bool = False
    device: str = "auto"
    log_every: int = 10
    val_every: int = 250               # 0: only at the end
    checkpoint_every: int = 500        # 0: only at the end
    keep_checkpoints: int = 2


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    name: str
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model.to_dict(), "optim": asdict(self.optim),
                "schedule": asdict(self.schedule), "data": asdict(self.data), "run": asdict(self.run)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        return cls(name=d["name"], model=GPTConfig.from_dict(d["model"]),
                   optim=OptimConfig(**d["optim"]), schedule=ScheduleConfig(**d["schedule"]),
                   data=DataConfig(**d["data"]), run=RunConfig(**d["run"]))
