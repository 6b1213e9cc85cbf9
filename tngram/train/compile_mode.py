"""`run.compile`: whether the trainer's forward runs under torch.compile, and what ran.

    true   torch.compile(model, dynamic=False); a failure to compile is an error (as before)
    false  eager
    auto   (the default) on CUDA torch.compile(model, dynamic=False, fullgraph=True), as
           parameter-golf's train_gpt.py compiles its model; if that fails at the first step
           (a graph break, a backend error), the step is rerun eager from the same batches, one
           line names the reason, and the run goes on eager. On the CPU (and MPS): eager.
           With row-sparse tables (optim.memory_update=sparse|rowwise) the tables' gathers
           are outside dynamo (torch.compiler.disable: their backward builds a sparse
           gradient), so the model compiles with fullgraph=False: every other op compiled,
           the gathers eager between the graphs, instead of the whole forward eager.

Why eager on the CPU: inductor's CPU kernels sum fp32 in another order than eager torch, so a
compiled CPU run would not reproduce the CPU runs (the golden test, `make demo`) to the last
digit, and compiling costs tens of seconds that the CPU recipes' short runs do not win back (not
measured here: run.compile=true is there to try).

The run's env.json records the outcome under "compile" (`CompileState.record`): the setting,
what ran ("compiled" / "eager") and why it is eager where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tngram.memory.base import builds_row_sparse_grads

COMPILE_SETTINGS = (True, False, "auto")


def compiles(setting: bool | str, device: torch.device) -> bool:
    """Whether run.compile=`setting` compiles the forward on `device`: true always, false never,
    "auto" on CUDA only."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


@dataclass
class CompileState:
    """What the forward runs: `ran` is "compiled" or "eager" (with `reason`); `armed` while the
    first step of an "auto" compile may still fall back to eager."""

    setting: bool | str
    ran: str
    reason: str | None = None
    armed: bool = False
    newton_schulz: str = "eager"  # Muon's (tngram.optim.muon): compiled with the forward
    graph_breaks: str | None = None  # why an "auto" compile allows graph breaks (row-sparse)

    def record(self) -> dict[str, object]:
        """The env.json entry: {"setting", "ran", "reason"?, "newton_schulz", "graph_breaks"?}."""
        out: dict[str, object] = {"setting": self.setting, "ran": self.ran}
        if self.reason is not None:
            out["reason"] = self.reason
        out["newton_schulz"] = self.newton_schulz
        if self.graph_breaks is not None:
            out["graph_breaks"] = self.graph_breaks
        return out

    def fall_back(self, exc: BaseException) -> str:
        """Switch to eager after `exc`; returns the one line that says so."""
        self.ran, self.armed = "eager", False
        self.reason = f"torch.compile failed: {failure_reason(exc)}"
        return f"tngram: note: run.compile=auto: {self.reason}; running eager"


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """One line: the exception's type, and the type and first message line of the error it
    wraps (a backend's failure arrives inside dynamo's BackendCompilerFailed)."""
    root = exc
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if not isinstance(inner, BaseException) or inner is root:
            break
        root = inner
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    what = f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__
    text = what if root is exc else f"{type(exc).__name__} ({what})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compile_forward(
    model: nn.Module, setting: bool | str, device: torch.device
) -> tuple[nn.Module, CompileState]:
    """(the module the forward calls, its CompileState) for run.compile=`setting` on `device`.
    torch.compile is lazy: an "auto" compile fails, if at all, at the first call, where the
    trainer catches it (CompileState.armed)."""
    if not compiles(setting, device):
        why = "run.compile=false" if setting is False else f"run.compile=auto on {device.type}"
        return model, CompileState(setting, "eager", why)
    if setting is True:
        compiled = cast(nn.Module, torch.compile(model, dynamic=False))
        return compiled, CompileState(setting, "compiled")
    if builds_row_sparse_grads(model):
        compiled = cast(nn.Module, torch.compile(model, dynamic=False, fullgraph=False))
        why = "row-sparse table gathers run eager (optim.memory_update=sparse|rowwise)"
        return compiled, CompileState(setting, "compiled", armed=True, graph_breaks=why)
    compiled = cast(nn.Module, torch.compile(model, dynamic=False, fullgraph=True))
    return compiled, CompileState(setting, "compiled", armed=True)
