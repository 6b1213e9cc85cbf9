"""One CLI vocabulary: every option is documented with its default, a flag means the same thing
in every command, no internal names in --help, --version, `python -m tngram`, plain progress
lines when stderr is not a terminal, loggers, and user errors that are the matching built-ins."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from test_train_support import TINY_SETS, cli_args, one_thread, tiny_data  # noqa: F401
from tngram.cli.main import build_parser, main
from tngram.common import MissingFileError, TngramError


def all_parsers(parser=None, path=("tngram",)):
    """(command path, parser) for the top-level parser and every sub-command under it."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, path + (name,))


def options(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, (argparse._HelpAction,
                                                                                  argparse._VersionAction))]


def _lab_parsers():
    """The lab's commands (`python -m research ...`) share the vocabulary: same helpers, same flags."""
    from research.cli import build_parser as lab_parser
    return all_parsers(lab_parser(), ("python -m research",))


COMMANDS = {" ".join(p): parser for p, parser in [*all_parsers(), *_lab_parsers()]}
LEAVES = {k: p for k, p in COMMANDS.items() if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)}


def test_every_option_has_help_with_its_default():
    missing, no_default = [], []
    for cmd, parser in LEAVES.items():
        text = parser.format_help()
        for a in options(parser) + [a for a in parser._actions if not a.option_strings]:
            if not a.help:
                missing.append(f"{cmd} {a.dest}")
        for a in options(parser):
            if a.default not in (None, False) and not (isinstance(a.default, list) and not a.default):
                helptext = parser._get_formatter()._expand_help(a) if a.help else ""
                if "default" not in helptext:
                    no_default.append(f"{cmd} {a.option_strings[0]}")
        assert "%(default)" not in text
    assert not missing, missing
    assert not no_default, no_default


# words that look like internal names but are products / formats
_ALLOWED = {"TensorBoard", "SentencePiece", "PyPI", "FineWeb", "PyTorch", "TN-gram", "GPUs", "HF", "SymPy", "NumPy",
            "SciPy", "GitHub", "HuggingFace", "OpenWebText", "TinyStories", "WikiText",
            "AutoModelForCausalLM", "AutoTokenizer", "GiB", "MiB"}   # Hugging Face API names, units


def test_no_internal_names_in_help():
    bad = []
    for cmd, parser in COMMANDS.items():
        text = parser.format_help()
        for m in re.finditer(r"\btngram\.[a-z_]+\.[a-z_.]+|\b[A-Z][a-z]+[A-Z][A-Za-z]*\b|\b[a-z]+_[a-z_]+\(", text):
            if m.group(0) not in _ALLOWED:
                bad.append(f"{cmd}: {m.group(0)}")
        assert "TODO" not in text and "XXX" not in text
    assert not bad, bad


def _helps(flag):
    out = {}
    for cmd, parser in LEAVES.items():
        for a in options(parser):
            if flag in a.option_strings:
                out[cmd] = a
    return out


@pytest.mark.parametrize("flag,phrase", [
    ("--steps", "total optimiser steps"),
    ("--threads", "0 = torch's default"),
    ("--device", "auto | cpu | cuda"),
    ("--no-progress", "not a terminal"),
    ("--set", "SECTION.FIELD=VALUE"),
])
def test_a_flag_means_the_same_everywhere(flag, phrase):
    found = _helps(flag)
    assert len(found) >= 2, f"{flag} in only {list(found)}"
    for cmd, a in found.items():
        assert phrase in (a.help or "") + " " + str(a.metavar), f"{cmd} {flag}: {a.help}"


def test_json_is_a_switch_everywhere_and_preset_not_scale():
    js = _helps("--json")
    assert {"tngram params", "tngram eval core", "tngram eval bpb", "python -m research bench data"} <= set(js)
    assert all(a.nargs == 0 for a in js.values())            # store_true: never a path
    assert not _helps("--scale")
    assert set(_helps("--preset")) == {"tngram compare", "python -m research experiment"}
    assert "tngram data bench" not in COMMANDS and "python -m research bench data" in COMMANDS
    for cmd in ("tngram train", "tngram compare", "python -m research experiment", "tngram data build",
                "tngram data fineweb", "tngram eval core", "tngram eval build-bundle"):
        assert "--no-progress" in COMMANDS[cmd].format_help(), cmd


def test_version_and_python_m(capsys):
    import tngram
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tngram {tngram.__version__}"
    p = subprocess.run([sys.executable, "-m", "tngram", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"tngram {tngram.__version__}"
    assert main(["params", "mini-tngram", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recipe"] == "mini-tngram"


def test_user_errors_are_builtin_exceptions(tmp_path):
    import tngram
    assert issubclass(TngramError, ValueError) and issubclass(MissingFileError, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        tngram.load_run(str(tmp_path / "no-run"))
    from tngram.data.build import open_dataset
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(tmp_path / "no-data")
    with pytest.raises(ValueError, match="unknown recipe"):
        tngram.build_model("no-such-recipe")


def test_plain_log_lines_when_stderr_is_not_a_terminal(tiny_data, tmp_path):  # noqa: F811
    """A subprocess's stderr is a pipe: one plain line every run.log_every steps, no bar redraws."""
    args = cli_args(tiny_data, "mini-raw", tmp_path / "run", ["schedule.steps=4", "run.log_every=2",
                                                               "run.val_every=0", "run.checkpoint_every=0"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tngram", "train", *args], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if re.match(r"mini-raw: step \d+/4 loss \d", ln)]
    assert [ln.split()[2] for ln in lines] == ["2/4", "4/4"], p.stderr


def test_tensorboard_logger(tiny_data, tmp_path):  # noqa: F811
    pytest.importorskip("tensorboard")
    from tngram.train.recipes import resolve_config
    from tngram.train.loop import train
    cfg = resolve_config("mini-raw", TINY_SETS + ["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"],
                         str(tiny_data))
    train(cfg, tmp_path / "run", logger="tensorboard", progress=False)
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_wandb_logger_offline(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from tngram.train.recipes import resolve_config
    from tngram.train.loop import train
    from tngram.train.metrics import read_metrics
    cfg = resolve_config("mini-raw", TINY_SETS + ["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0",
                                                  "run.log_every=1"], str(tiny_data))
    train(cfg, tmp_path / "run", logger="wandb", progress=False)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]   # JSONL stays the record


def test_unknown_or_missing_logger_fails_before_work(tmp_path, monkeypatch, capsys):
    from tngram.train.metrics import check_logger
    with pytest.raises(TngramError, match="--logger must be"):
        check_logger("mlflow")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "mini-raw", "--out", str(tmp_path / "r"), "--logger", "wandb"]) == 2
    assert "pip install" in capsys.readouterr().err and not (tmp_path / "r").exists()
