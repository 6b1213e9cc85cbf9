"""`tngram export RUN --hf DIR`: a run of ours (any recipe) as a Hugging Face model folder.

DIR receives config.json (model_type "tngram_gpt", our GPTConfig under "gpt"), model.safetensors
(every weight, keys "model." + ours, no pickle), generation_config.json (bos/eos/pad 1/2/0) and
the run's SentencePiece tokenizer as tokenizer.json (tngram.hf.tokenizer). After
`import tngram.hf`, AutoConfig, AutoModelForCausalLM, AutoTokenizer and
pipeline("text-generation") open DIR without trust_remote_code.

The folder is written beside DIR under a temporary name and renamed into place when complete;
an existing non-empty DIR is never overwritten.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tngram.common import TngramError
from tngram.safefs import check_regular


def check_export_target(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TngramError(f"--hf {out} already exists and is not empty; choose a new folder")
    return out


def export_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "fp32",
) -> Path:
    """Convert RUN to an HF folder at out_dir; returns out_dir."""
    import torch

    from tngram.data.tokenizer import load_tokenizer
    from tngram.hf.gpt_folder import MEMORY_TOKENIZER, memory_tokenizer_for_export
    from tngram.hf.gpt_model import from_gpt, register
    from tngram.train.checkpoint import load_run_model
    from tngram.train.portable import run_tokenizer_path

    out = check_export_target(out_dir)
    if dtype not in ("fp32", "bf16"):
        raise TngramError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    run_dir = Path(run_dir)
    model, cfg = load_run_model(run_dir)  # clear error when RUN is not a run
    sp_path = run_tokenizer_path(run_dir, cfg, tokenizer)
    load_tokenizer(sp_path)  # a file that is not a SentencePiece model: one line, before writing
    register()
    hf = from_gpt(model)
    mem_tok = memory_tokenizer_for_export(hf)  # Engram's compression tokenizer goes inside
    if dtype == "bf16":
        hf = hf.to(torch.bfloat16)  # type: ignore[arg-type, unused-ignore]  # (as in from_gpt)
    gen = hf.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = 1, 2, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_torn_exports(out)
    tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _quiet_progress(), _signals_stop_the_export(out):
            hf.save_pretrained(str(tmp))
        if mem_tok is not None:
            shutil.copyfile(check_regular(mem_tok), tmp / MEMORY_TOKENIZER)
        _save_tokenizer(sp_path, tmp)
        mask = os.umask(0o022)
        os.umask(mask)
        for f in tmp.iterdir():  # transformers writes model.safetensors 0600: the usual mode
            f.chmod(0o666 & ~mask)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except Exception as e:
        if _disk_full(e):  # the project's disk-full line (exit 2), nothing left behind
            from tngram.train.checkpoint import DiskFull

            raise DiskFull(
                f"disk full while writing the export to {out.parent}; nothing was written to "
                f"{out}; free some space and export again"
            ) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


TMP_MARK = ".tmp-"  # the folder is written as .NAME.tmp-PID beside --hf NAME


def remove_torn_exports(out: Path) -> None:
    """Remove the temporary folders a killed export into `out` left (its process is gone), saying
    so; a link is never followed (tngram.safefs.remove_tree)."""
    from tngram.safefs import remove_tree

    prefix = f".{out.name}{TMP_MARK}"
    for p in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = p.name[len(prefix) :]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if remove_tree(p):
            print(f"tngram: removed {p}, a partial export left by process {pid} (not running)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def _signals_stop_the_export(out: Path) -> Iterator[None]:
    """SIGTERM / SIGHUP while exporting stop it like Ctrl-C: the temporary folder is removed on
    the way out (`finally`), nothing is left at `out`; exit 128 + the signal's number."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        print(f"tngram: {name}: export stopped; nothing was written to {out}", file=sys.stderr)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' "Writing model shards" bar off while saving (the CLI's lines stay its own)."""
    from transformers.utils import logging as tlog

    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tlog.enable_progress_bar()


def _disk_full(e: BaseException) -> bool:
    """An OSError ENOSPC / EDQUOT, or a library's error carrying its text (safetensors)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def _save_tokenizer(sp_path: Path, folder: Path) -> None:
    """save_hf_tokenizer, a file that is not a SentencePiece model one line naming it."""
    from tngram.hf.tokenizer import save_hf_tokenizer

    try:  # in a folder of its own: sentencepiece and tokenizers take only UTF-8 paths
        with tempfile.TemporaryDirectory(prefix="tngram-tokenizer-") as staging:
            src, dst = Path(staging) / "tokenizer.model", Path(staging) / "hf"
            shutil.copyfile(check_regular(sp_path), src)
            save_hf_tokenizer(src, dst)
            for f in dst.iterdir():
                shutil.copyfile(f, folder / f.name)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        if isinstance(e, TngramError) or _disk_full(e):
            raise
        raise TngramError(
            f"{sp_path}: not a SentencePiece tokenizer model ({str(e).splitlines()[0][:100]})"
        ) from None
