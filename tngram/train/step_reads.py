"""When the trainer reads the device: every step on the CPU, only at sync points on CUDA.

Reading a CUDA tensor on the host (`.item()`, `float()`, `.tolist()`, `bool()`) waits for every
kernel queued before it, so a read per step keeps the host from queueing the next step while the
GPU works. parameter-golf's train_gpt.py reads the loss only on its logging steps. Here:

    CPU (and MPS)  each step's loss is read right after its backward, before the update, as
                   before: a non-finite loss stops the run before the update (the read is free).
    CUDA           each step's mean loss stays on the device (`StepLosses.add`); all the losses
                   since the last read are moved to the host in ONE transfer at the next sync
                   point: a metrics row (run.log_every, validation), a checkpoint, the CP-rank
                   pruning step, a stop signal, the last step. A non-finite loss is then reported
                   with the step it first appeared at; the run stops there. The steps between
                   it and the sync point did update the weights in memory, but no checkpoint,
                   final weights or summary is written after a non-finite loss: every write is
                   at a sync point, and the read comes first.

Under DDP the stop-signal check is a collective whose result the host reads (all processes must
stop at the same step); on CUDA it runs at the sync points only (`stop_check_due`), so a signal
stops the run at the next sync point, checkpointed there as usual.

`reads_every_step(device)` is the choice; `StepLosses` holds the pending losses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reads_every_step(device: torch.device) -> bool:
    """True where a host read costs nothing (the CPU) or MPS; False on CUDA."""
    return device.type != "cuda"


def stop_check_due(every_step: bool, world_size: int, sync_point: bool) -> bool:
    """Whether the loop checks for a stop signal after this step: always in one process (no
    collective) or where the host reads every step; under DDP on CUDA at sync points only."""
    return every_step or world_size == 1 or sync_point


class StepLosses:
    """The training losses not yet read: (step, 0-d device tensor) pairs; `read()` moves them
    to the host in one transfer and returns [(step, loss)]; `last` is the newest read loss."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[Tensor] = []
        self.last = float("nan")

    def add(self, step: int, loss: Tensor) -> None:
        self.steps.append(step)
        self.values.append(loss.detach())

    def __len__(self) -> int:
        return len(self.steps)

    def read(self) -> list[tuple[int, float]]:
        """Every pending loss as (step, float), oldest first; none pending afterwards."""
        if not self.values:
            return []
        host = self.values[0].item() if len(self.values) == 1 else torch.stack(self.values).tolist()
        got = list(zip(self.steps, host if isinstance(host, list) else [host]))
        self.steps, self.values = [], []
        self.last = got[-1][1]
        return got


def nonfinite_message(
    step: int, loss: float, read_at: int | None, last_checkpoint: object, hint: str = ""
) -> str:
    """The error for a non-finite training loss at `step`, read before that step's update
    (`read_at` None: the CPU) or at the sync point after step `read_at` (CUDA)."""
    when = (
        "stopped before the update"
        if read_at is None
        else f"read at step {read_at} (on CUDA the losses are read at log, checkpoint and the "
        f"last steps); stopped there, nothing written after step {step - 1}"
    )
    return (
        f"non-finite training loss ({loss}) at step {step}; {when}. Last good checkpoint: "
        f"{last_checkpoint if last_checkpoint else 'none (none written yet)'}. {hint}"
        f"Lower the learning rates (optim.matrix_lr, optim.tied_embed_lr, optim.scalar_lr) "
        f"or check the data."
    )


def first_nonfinite(losses: list[tuple[int, float]]) -> tuple[int, float] | None:
    """The first (step, loss) whose loss is nan or infinite, or None."""
    return next(((s, v) for s, v in losses if not math.isfinite(v)), None)
