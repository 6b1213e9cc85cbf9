"""Reading checkpoint and weights files back: safetensors tensors and JSON records, each failure
one TngramError naming the file (tngram.train.checkpoint holds the folder layout)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tngram.common import MissingFileError, TngramError
from tngram.readback import BadRecordError, load_json
from tngram.readback.tensors import read_safetensors, read_safetensors_header
from tngram.safefs import open_read


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: cpu_copy(v) for k, v in model.state_dict().items()}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def short_error(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def safetensors_shapes(file: Path) -> dict[str, Any]:
    """{tensor name: shape} of a safetensors file, read and checked by tngram.readback.tensors
    (missing, truncated, oversized or not safetensors: one TngramError naming it)."""
    return dict(read_safetensors_header(file).shapes)


def load_tensors(file: Path, finite: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (tngram.readback.tensors.read_safetensors: header and
    size checked first, float tensors finite)."""
    return read_safetensors(file, finite=finite)[0]


def load_checkpoint_json(file: Path) -> Any:
    try:
        return load_json(file, want_dict=False)
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except BadRecordError as e:
        if "JSON" in str(e) or "UTF-8" in str(e):
            raise TngramError(
                f"{file}: corrupt or truncated JSON ({str(e).split(': ', 1)[-1]})"
            ) from None
        raise
    except OSError as e:
        raise TngramError(f"{file}: corrupt or truncated JSON ({short_error(e)})") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
