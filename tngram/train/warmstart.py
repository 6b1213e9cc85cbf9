"""Warm starts: begin training from another model's weights, optionally training only the memory.

    run.init_from = DIR        DIR is a run folder of ours (config.json + weights) or a folder
                               written by `tngram export RUN --hf DIR` (config.json with
                               model_type "tngram_gpt" + model.safetensors)
    optim.trainable = "memory" only the memory modules (TN-gram, Engram, Over-Encoding) get
                               gradients and an optimiser; the backbone stays frozen

Loading copies every tensor of DIR into the new model by name. The only keys allowed to be
missing are the new model's memory parameters (a memory added to a trained raw GPT keeps its own
initialisation; with zero-initialised value projections it starts as an exact no-op). A key of
DIR the new model lacks, or a shape that differs, is an error: the backbones must match.

This module reads the export folder's files directly (safetensors + JSON); it never imports
tngram.hf or transformers (layers point one way).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tngram.common import TngramError
from tngram.readback import get, load_json
from tngram.readback.tensors import read_safetensors
from tngram.train.checkpoint import load_run_model
from tngram.train.init_from import TRAINABLE, check_init_from

HF_MODEL_TYPE = "tngram_gpt"  # model_type of tngram.hf.gpt_model.TngramGPTConfig
HF_PREFIX = "model."  # TngramGPTForCausalLM keeps our GPT as `.model`


def is_memory_param(name: str) -> bool:
    """Memory parameters of our GPT: blocks.<i>.memory.* and embed_memory.* (Over-Encoding)."""
    return name.startswith("embed_memory.") or ".memory." in name


def source_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The GPT state dict (our key names) stored in a run folder or an HF export folder."""
    d = Path(path)
    check_init_from(str(d))
    cfg = load_json(d / "config.json", d)
    if cfg.get("model_type") == HF_MODEL_TYPE:  # export's payload digest, finite values
        # an export by an older tngram records no digest: shapes and finiteness still checked
        digests = get(cfg, "weights_sha256", "dict", str(d / "config.json"), default={})
        want = get(
            digests, "model.safetensors", "str", f"{d / 'config.json'} weights_sha256", default=None
        )
        tensors, _ = read_safetensors(d / "model.safetensors", d, digest=want)
        return {k[len(HF_PREFIX) :]: v for k, v in tensors.items() if k.startswith(HF_PREFIX)}
    model, _ = load_run_model(d)  # newest of final weights / latest checkpoint
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_init_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Copy DIR's weights into `model`; returns the memory keys left at their initialisation."""
    src = source_state_dict(path)
    own = model.state_dict()
    extra = sorted(set(src) - set(own))
    if extra:
        raise TngramError(
            f"run.init_from: {path} has weights the model lacks: {extra[:5]} "
            f"(the backbones differ: use the same model.* settings as that run)"
        )
    bad = [
        f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in src.items()
        if v.shape != own[k].shape
    ]
    if bad:
        raise TngramError(f"run.init_from: shapes differ from {path}: {bad[:5]}")
    missing = sorted(set(own) - set(src))
    not_memory = [k for k in missing if not is_memory_param(k)]
    if not_memory:
        raise TngramError(f"run.init_from: {path} lacks backbone weights {not_memory[:5]}")
    model.load_state_dict(src, strict=False)
    return missing


def freeze_backbone(model: nn.Module) -> int:
    """requires_grad False on every non-memory parameter; returns the trainable parameter count."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_memory_param(name))
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise TngramError(
            "optim.trainable=memory but the model has no memory module "
            "(choose a recipe with model.memory)"
        )
    return n


def apply_warmstart(model: nn.Module, init_from: str | None, trainable: str) -> None:
    """Called by the trainer after building the model, before the optimisers."""
    if trainable not in TRAINABLE:
        raise TngramError(f"optim.trainable must be one of {TRAINABLE}, got {trainable!r}")
    if init_from:
        load_init_weights(model, init_from)
    if trainable == "memory":
        freeze_backbone(model)
