"""Reading checkpoint and weights files back: safetensors tensors and JSON records, each failure
one TngramError naming the file (tngram.train.checkpoint holds the folder layout)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tngram.common import MissingFileError, TngramError
from tngram.readback import BadRecordError, load_json
from tngram.safefs import check_regular, open_fd, open_read


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _cpu(v) for k, v in model.state_dict().items()}


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


@contextmanager
def st_path(file: str | os.PathLike) -> Iterator[str]:
    """A name safetensors can open for `file`: the path itself when it is UTF-8 text, else (a
    run folder named in another encoding: safetensors takes only UTF-8 paths) the file opened
    without following links and reached as /proc/self/fd/N while the block runs."""
    text = os.fspath(file)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fd = open_fd(file)
        try:
            alias = f"/proc/self/fd/{fd}"
            if not os.path.exists(alias):
                raise TngramError(
                    f"{os.fsencode(text)!r}: the path is not UTF-8 text and this system has no "
                    f"/proc/self/fd to reach the file otherwise; rename the folder"
                ) from None
            yield alias
        finally:
            os.close(fd)
        return
    yield text


def _read_safetensors_header(file: Path) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", ...}} of a safetensors file; TngramError naming it if the
    file is missing, truncated or not safetensors."""
    from safetensors import safe_open

    try:
        check_regular(file)
        with st_path(file) as name, safe_open(name, framework="pt") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except TngramError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError / OSError / ValueError
        raise TngramError(f"{file}: corrupt or truncated safetensors file ({_short(e)})") from None


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        check_regular(file)
        with st_path(file) as name:
            return load_file(name)
    except FileNotFoundError:
        raise MissingFileError(f"{file}: missing") from None
    except TngramError:
        raise
    except Exception as e:
        raise TngramError(f"{file}: corrupt or truncated safetensors file ({_short(e)})") from None


def _load_json(file: Path) -> Any:
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
        raise TngramError(f"{file}: corrupt or truncated JSON ({_short(e)})") from None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
