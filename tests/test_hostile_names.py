"""Names and bytes (docs/RELIABILITY.md): non-UTF-8 prompts and folder names end to end, a crash
handler that never crashes on them, and a kernel cache that does not load (random bytes, or a
valid library without our functions): rebuilt with the same flags, said in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_hostile import EXTRA, cli, one_line_exit_2
from test_train_support import cli_args, tiny_data  # noqa: F401

ODD = os.fsdecode(b"run-\xff\xfe")  # not UTF-8: the name as Python sees it (surrogate escapes)


@pytest.fixture(scope="module")
def odd_run(tiny_data, tmp_path_factory):
    """A run trained through the CLI into a folder whose name is not UTF-8."""
    from tngram.cli import main

    run = tmp_path_factory.mktemp("names") / ODD
    assert main(["train", *cli_args(tiny_data, "mini-tngram", run, EXTRA)]) == 0
    return run


def test_a_non_utf8_run_folder_works_in_later_commands(odd_run, capsys):
    """Every later command reads the folder's weights and tokenizer (safetensors and
    sentencepiece open only UTF-8 paths: tngram reaches the files another way)."""
    import tngram

    model, tok = tngram.load_run(odd_run)
    assert tok.encode("hello")
    capsys.readouterr()
    rc, err = cli(["sample", str(odd_run), "--prompt", "hello", "--max-new-tokens", "3"], capsys)
    assert rc == 0, err
    rc, err = cli(["eval", "bpb", str(odd_run), "--max-tokens", "256"], capsys)
    assert rc == 0, err


def test_a_non_utf8_run_folder_exports_and_evaluates_core(odd_run, tmp_path, capsys):
    """export --hf into a folder whose name is not UTF-8 either (the tokenizer files are made in
    a folder of their own), and eval core reading the run's own tokenizer."""
    pytest.importorskip("transformers", reason="export needs the hf extra")
    from test_core_fixtures import write_toy_bundle

    out = tmp_path / os.fsdecode(b"hf-\xff")
    rc, err = cli(["export", str(odd_run), "--hf", str(out)], capsys)
    assert rc == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    bundle = write_toy_bundle(tmp_path / "bundle")
    core = tmp_path / "core.json"
    rc, err = cli(["eval", "core", str(odd_run), "--bundle", str(bundle), "--max-per-task", "2",
                   "--out", str(core)], capsys)
    assert rc == 0 and core.exists(), err


def test_the_sample_api_refuses_a_non_utf8_prompt_in_one_line(odd_run):
    import tngram
    from tngram.common import TngramError

    model, tok = tngram.load_run(odd_run)
    with pytest.raises(TngramError, match=r"prompt is not UTF-8 text \(byte b'\\xe9' at character 3\)"):
        tngram.sample(model, tok, os.fsdecode(b"caf\xe9"), max_new_tokens=2)


def test_a_non_utf8_prompt_is_one_line(odd_run, capsys):
    prompt = os.fsdecode(b"caf\xe9")
    rc, err = cli(["sample", str(odd_run), "--prompt", prompt, "--max-new-tokens", "3"], capsys)
    one_line_exit_2(rc, err)
    assert "--prompt is not UTF-8 text" in err and "\\xe9" in err


def test_the_crash_handler_survives_undecodable_arguments(monkeypatch, tmp_path, capsys):
    """An internal error while argv and the message hold surrogate escapes: still one line, and
    the traceback file is written (undecodable bytes as backslash escapes)."""
    from tngram.cli.safety import run_command

    monkeypatch.setenv("TNGRAM_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["tngram", "sample", "--prompt", os.fsdecode(b"\xff")])

    odd = os.fsdecode(b"x\xfey")

    def boom(args):
        raise RuntimeError(f"bad {odd}")

    assert run_command(boom, None) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" in err
    (crash,) = list((tmp_path / "crash").iterdir())
    assert "\\udcff" in crash.read_text(encoding="utf-8")


KERNEL_PROBE = """
import json, sys
from tngram.kernels import tngram_c
lib = tngram_c.library()
print(json.dumps({"ok": lib is not None, **tngram_c.c_build_info()}))
"""


def _probe(cache: Path) -> tuple[dict, str]:
    import json

    env = dict(os.environ, TNGRAM_CACHE=str(cache), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", KERNEL_PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.slow  # three fresh processes (each imports torch): about 15 s on 2 busy cores
@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_a_kernel_cache_that_does_not_load_is_rebuilt_with_the_same_flags(tmp_path):
    first, err = _probe(tmp_path)
    assert first["ok"] and "rebuilding" not in err
    lib = Path(first["library"])
    good = lib.read_bytes()
    # random bytes in place of the library
    lib.write_bytes(os.urandom(4096))
    again, err = _probe(tmp_path)
    assert again["ok"] and again["flags"] == first["flags"] and again["library"] == first["library"]
    notes = [ln for ln in err.splitlines() if "rebuilding" in ln]
    assert len(notes) == 1 and f"same flags ({first['flags']})" in notes[0], err
    assert lib.read_bytes() == good  # the same source and flags build the same library
    # a valid shared library without our functions
    src = tmp_path / "other.c"
    src.write_text("int unrelated(void) { return 1; }\n")
    cc = os.environ.get("CC") or "cc"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    again, err = _probe(tmp_path)
    assert again["ok"] and again["flags"] == first["flags"]
    notes = [ln for ln in err.splitlines() if "rebuilding" in ln]
    assert len(notes) == 1 and "lacks the kernel functions" in notes[0], err
