"""A run's files checked against each other (docs/RELIABILITY.md, "Run folders"): config.json
must say what the weights were trained with (the config recorded in the final weights' header
and in each checkpoint's meta.json), and a dataset's tokenizer must be the one its manifest
recorded. An edit that keeps every shape would otherwise compute other numbers with exit 0 (and
`export` would sign it); each is one line naming the file and the field, exit 2, nothing
written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_hostile import EXTRA, cli, copy_run, one_line_exit_2, tree_digest
from test_train_support import cli_args, tiny_config, tiny_data  # noqa: F401
from tngram.train.loop import train


@pytest.fixture(scope="module")
def pkm_run(tiny_data, tmp_path_factory):
    """A finished product-key run (top 8 of 128^2 slots): 4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("runfiles") / "pkm"
    torch.set_num_threads(1)
    train(tiny_config(tiny_data, "mini-pkm", extra=EXTRA), out)
    return out


def _edit_topk(run, topk=4):
    c = json.loads((run / "config.json").read_text())
    assert c["model"]["memory"]["topk"] == 8
    c["model"]["memory"]["topk"] = topk  # every weight keeps its shape
    (run / "config.json").write_text(json.dumps(c))


def _commands(run, tiny_data, tmp_path):
    yield ["eval", "bpb", str(run), "--out", str(tmp_path / "bpb.json")]
    yield ["sample", str(run), "--prompt", "the", "--max-new-tokens", "2"]
    yield ["train", *cli_args(tiny_data, "mini-pkm", run, EXTRA), "--resume"]
    pytest.importorskip("transformers", reason="export needs the hf extra")
    yield ["export", str(run), "--hf", str(tmp_path / "hf")]


def test_config_json_edited_after_training_is_refused_naming_the_field(
    pkm_run, tiny_data, tmp_path, capsys
):
    run = copy_run(pkm_run, tmp_path / "run")
    _edit_topk(run)
    before = tree_digest(run)
    for argv in _commands(run, tiny_data, tmp_path):
        rc, err = cli(argv, capsys)
        one_line_exit_2(rc, err)
        assert "config.json: field model.memory.topk is 4" in err and "8" in err, (argv, err)
        after = {k: v for k, v in tree_digest(run).items() if k != ".tngram.lock"}  # (train's)
        assert after == before, argv
    assert not (tmp_path / "hf").exists() and not (tmp_path / "bpb.json").exists()


def test_config_json_is_checked_against_the_checkpoint_when_the_weights_are_a_checkpoint(
    pkm_run, tmp_path, capsys
):
    """A run still going (no final weights) loads its newest checkpoint: the same check, against
    that checkpoint's meta.json."""
    run = copy_run(pkm_run, tmp_path / "run")
    (run / "model.safetensors").unlink()
    _edit_topk(run)
    rc, err = cli(["eval", "bpb", str(run), "--out", str(tmp_path / "bpb.json")], capsys)
    one_line_exit_2(rc, err)
    assert "field model.memory.topk is 4" in err and "step_000004/meta.json" in err, err


def test_untouched_run_evaluates(pkm_run, tmp_path, capsys):
    rc, err = cli(["eval", "bpb", str(pkm_run), "--out", str(tmp_path / "bpb.json")], capsys)
    assert rc == 0, err


def test_a_dataset_whose_tokenizer_was_replaced_is_refused(tiny_data, tmp_path, capsys):
    """The manifest records the tokenizer's sha256: a swapped tokenizer.model (another valid
    model: the test suite's own, retrained with another vocabulary) is refused before a run
    folder is made."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    tok = data / "tokenizer.model"
    tok.write_bytes(tok.read_bytes() + b"\n")  # any other bytes
    out = tmp_path / "run"
    rc, err = cli(["train", *cli_args(data, "mini-raw", out, EXTRA)], capsys)
    one_line_exit_2(rc, err)
    assert "manifest.json: field tokenizer.sha256" in err and str(tok) in err, err
    assert not out.exists()


def _poison(tensors: dict) -> str:
    k = next(k for k, v in sorted(tensors.items()) if v.is_floating_point() and v.dim() == 2)
    tensors[k].view(-1)[0] = float("nan")
    return k


def test_init_from_never_starts_from_non_finite_weights(tiny_data, tmp_path):
    """run.init_from a run whose final weights hold a NaN (their header digest rewritten to
    match, as a forger would) and an exported folder likewise (its weights_sha256 rewritten):
    refused naming the tensor before step 1, not a non-finite loss at step 1."""
    from safetensors.torch import load_file

    from tngram.common import TngramError
    from tngram.train.checkpoint import recorded_config, weights_with_digest

    src = tmp_path / "raw"
    train(tiny_config(tiny_data, "mini-raw", ["schedule.steps=1", "run.val_every=0"]), src)
    w = src / "model.safetensors"
    tensors = load_file(w)
    k = _poison(tensors)
    w.write_bytes(weights_with_digest(tensors, 1, recorded_config(w)))
    cfg = tiny_config(tiny_data, "mini-tngram", [f"run.init_from={src}", "run.val_every=0"])
    with pytest.raises(TngramError, match=f"tensor {k} holds non-finite values"):
        train(cfg, tmp_path / "a")
    assert not (tmp_path / "a" / "metrics.jsonl").exists()

    pytest.importorskip("transformers", reason="an exported folder needs the hf extra")
    from safetensors.torch import save_file

    from tngram.hf.gpt_folder import record_weights_digest
    from tngram.hf.gpt_model import from_gpt
    from tngram.model.gpt import GPT

    folder = tmp_path / "hf"
    from_gpt(GPT(tiny_config(tiny_data, "mini-raw").model)).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    k = _poison(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    record_weights_digest(folder)
    with pytest.raises(TngramError, match=f"tensor {k} holds non-finite values"):
        train(tiny_config(tiny_data, "mini-tngram", [f"run.init_from={folder}"]), tmp_path / "b")


SIGNAL_DURING_EXPORT = """
import os, signal, sys
from tngram.hf import gpt_model
real = gpt_model.TngramGPTForCausalLM.save_pretrained
def save_pretrained(self, *a, **k):
    out = real(self, *a, **k)  # the weights are written, the tokenizer not yet
    os.kill(os.getpid(), signal.{sig})
    return out
gpt_model.TngramGPTForCausalLM.save_pretrained = save_pretrained
from tngram.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_export_leaves_no_partial_folder(sig, pkm_run, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    pytest.importorskip("transformers", reason="export needs the hf extra")
    out = tmp_path / "hf"
    code = SIGNAL_DURING_EXPORT.format(sig=sig)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, "export", str(pkm_run), "--hf", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 128 + getattr(signal, sig), p.stderr[-2000:]
    assert f"{sig}: export stopped; nothing was written to {out}" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == []  # no folder, no .hf.tmp-PID


def test_a_partial_export_of_a_dead_process_is_removed_by_the_next_export(
    pkm_run, tmp_path, capsys
):
    """kill -9 cannot be caught: the next export into the same place removes what it left."""
    import subprocess
    import sys

    pytest.importorskip("transformers", reason="export needs the hf extra")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    torn = tmp_path / f".hf.tmp-{dead.pid}"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half")
    from tngram.cli import main

    assert main(["export", str(pkm_run), "--hf", str(tmp_path / "hf")]) == 0
    assert f"removed {torn}, a partial export left by process {dead.pid}" in capsys.readouterr().out
    assert not torn.exists() and (tmp_path / "hf" / "config.json").exists()
