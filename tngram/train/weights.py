"""Model weights files: loading them into a model (names and shapes checked first), the final
weights' in-header digest, and the finiteness checks of loaded weights."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from tngram.common import MissingFileError, TngramError, json_text
from tngram.readback.tensors import (
    SafetensorsHeader,
    check_finite_module,
    payload_digest,
    read_safetensors_header,
)
from tngram.train.ckpt_files import load_tensors, sha256_hex
from tngram.train.runfiles import latest_checkpoint


def load_weights(
    model: nn.Module, file: str | os.PathLike, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> None:
    """Load a safetensors state dict into `model`; names and shapes are checked first, so a file
    that does not fit raises one TngramError naming it (and loads nothing)."""
    file = Path(file)
    tensors = load_tensors(file)
    # weights saved after adaptive CP-rank pruning have smaller TN-gram shapes than the config's
    # starting rank: shrink those modules first (the loaded values then overwrite them; the
    # optimisers are pointed at the new, smaller parameters)
    from tngram.memory.cp_rank import shrink_to_state

    shrink_to_state(model, tensors, optimizers)
    own = model.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    if missing or unexpected:
        raise TngramError(
            f"weights in {file} do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    bad = [
        (k, tuple(tensors[k].shape), tuple(v.shape))
        for k, v in own.items()
        if tensors[k].shape != v.shape
    ]
    if bad:
        k, got, want = bad[0]
        raise TngramError(
            f"weights in {file} do not fit the model: {k} has shape {got}, the model "
            f"needs {want} ({len(bad)} mismatched tensor(s)); was it written by another config?"
        )
    model.load_state_dict(tensors, strict=True)


def weights_with_digest(
    tensors: dict[str, torch.Tensor], step: int, config: dict[str, Any] | None = None
) -> bytes:
    """A safetensors file whose header records its payload's size and sha256 (the final weights'
    manifest, inside the file so a copied model.safetensors carries it: `verify_weights_file`)
    and the run config it was trained with (`recorded_config`)."""
    data = save(tensors, metadata={"step": str(step)})
    payload = memoryview(data)[8 + int.from_bytes(data[:8], "little") :]
    meta = {
        "step": str(step),
        "payload_bytes": str(len(payload)),
        "payload_sha256": sha256_hex(payload),
    }
    if config is not None:
        meta["config"] = json_text(config, sort_keys=True, separators=(",", ":"))
    return save(tensors, metadata=meta)  # the payload does not depend on the metadata


def _final_header(file: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(file)
    except MissingFileError:
        raise
    except TngramError as e:
        raise TngramError(
            f"{file}: corrupt or truncated final weights ({str(e).split(': ', 1)[-1]}); delete "
            f"it to use the newest checkpoint, or re-run the last step with --resume"
        ) from None


def verify_weights_file(file: Path) -> None:
    """A weights file whose header records a payload digest must match it (size and sha256);
    files without one (checkpoints, verified by their manifest; older runs) pass."""
    want = _final_header(file).metadata.get("payload_sha256")
    if want is None:
        return
    size, got, head = payload_digest(file)
    if str(size) != head.metadata.get("payload_bytes") or got != want:
        raise TngramError(
            f"{file}: the weights do not match the size and sha256 recorded in their header "
            f"(corrupt or replaced); delete it to use the newest checkpoint"
        )


def check_finite_model(model: nn.Module, file: Path) -> None:
    """Loaded weights must be finite and give finite logits on a first probe (8 tokens)."""
    check_finite_module(model, str(file))
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    T = min(8, int(cfg.sequence_len))
    ids = (
        torch.arange(T, device=next(model.parameters()).device)
        .remainder(int(cfg.vocab_size))
        .view(1, T)
    )
    with torch.no_grad():
        out = model(ids)
    logits = out[0] if isinstance(out, tuple) else out
    if not bool(torch.isfinite(logits).all()):
        raise TngramError(
            f"{file}: the weights give non-finite logits on a first probe; they are corrupt "
            f"or diverged"
        )


def weights_step(file: Path) -> int:
    try:
        return int(_final_header(file).metadata.get("step", -1))
    except ValueError as e:
        if isinstance(e, TngramError):
            raise
        raise TngramError(f"{file}: field __metadata__.step must be an int") from None


def recorded_config(file: Path) -> dict[str, Any] | None:
    """The run config final weights were written with (their header's `config`), or None for
    weights written before tngram recorded it."""
    from tngram.readback import parse_json

    text = _final_header(file).metadata.get("config")
    if text is None:
        return None
    cfg = parse_json(text, f"{file} (header field config)")
    if not isinstance(cfg, dict):
        raise TngramError(f"{file}: header field config must be a JSON object")
    return cfg


def final_problem(params: Iterable[torch.Tensor], val_loss: Any) -> str | None:
    """What makes a run's end unfit to be written as "done", or None: a non-finite parameter (of
    this process: call on every process and combine) or a non-finite validation loss."""
    flags = [torch.isfinite(p.detach()).all() for p in params if p.is_floating_point()]
    if flags and not bool(torch.stack(flags).all()):
        return "non-finite final weights"
    if not isinstance(val_loss, (int, float)) or not math.isfinite(val_loss):
        return f"non-finite validation loss ({val_loss})"
    return None


def refuse_final(run_dir: str | os.PathLike, problem: str, step: int) -> None:
    """Raise the one line that stops a run whose end is `problem` before its final weights and
    summary are written, naming the last good checkpoint to resume or inspect."""
    last = latest_checkpoint(run_dir)
    raise TngramError(
        f"{problem} at step {step}; not writing the final weights or summary.json. Last good "
        f"checkpoint: {last if last else 'none'} (resume from an older one by moving newer ones "
        f"away, or lower the learning rates)"
    )


SUSPECT_STEPS = 10  # a non-finite loss this soon after a resume points at the checkpoint


def resume_suspect(resumed_from: Path | None, resumed_step: int, step: int) -> str:
    """The sentence naming the checkpoint a run resumed from as a suspect when a non-finite loss
    comes within SUSPECT_STEPS steps of the resume (damaged or edited state shows there first),
    else ""."""
    if resumed_from is None or step - resumed_step > SUSPECT_STEPS:
        return ""
    return (
        f"The run resumed from {resumed_from} {step - resumed_step} step(s) earlier: that "
        f"checkpoint is a suspect (damaged or edited weights or optimiser state); move it away "
        f"to resume from an older one. "
    )


def check_final(
    run_dir: str | os.PathLike, params: Iterable[torch.Tensor], val_loss: Any, step: int, ctx: Any
) -> None:
    """`final_problem` on every process (this one's parameters; `ctx` a DistContext), then
    `refuse_final` everywhere if any process found one: before anything final is written."""
    from tngram.train.dist import all_true

    bad = final_problem(params, val_loss)
    if not all_true(bad is None, ctx):
        refuse_final(run_dir, bad or "non-finite final weights on another process", step)
