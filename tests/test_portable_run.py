"""A run folder stands alone: moved elsewhere (with or without its dataset) it still samples and
evaluates, and `tngram.load_run` gives the same model and tokenizer in one call."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_train_support import one_thread, tiny_config, tiny_data  # noqa: F401
import tngram
from tngram.cli import main
from tngram.common import TngramError
from tngram.train.loop import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):  # noqa: F811
    """A tiny TN-gram run trained for 2 steps; its dataset copied next to it (both movable)."""
    from test_train_support import single_thread
    root = tmp_path_factory.mktemp("portable")
    data = root / "project" / "data"
    shutil.copytree(tiny_data, data)
    run = root / "project" / "runs" / "a"
    with single_thread():
        train(tiny_config(data, extra=["schedule.steps=2", "run.val_every=0", "run.checkpoint_every=0"]), run)
    return root, run, data


def test_run_holds_tokenizer_and_manifest(trained):
    root, run, data = trained
    assert (run / "tokenizer.model").read_bytes() == (data / "tokenizer.model").read_bytes()
    rec = json.loads((run / "dataset.json").read_text())
    manifest = json.loads((data / "manifest.json").read_text())
    assert rec["manifest"] == manifest and rec["fingerprint"] == manifest["fingerprint"]
    assert rec["relative_dir"] == "../../data"


def test_moved_run_samples_and_evaluates(trained, tmp_path, capsys):
    root, run, data = trained
    # move run + dataset together (relative path still valid), the old absolute paths gone
    moved = tmp_path / "elsewhere"
    shutil.copytree(root / "project", moved)
    run2 = moved / "runs" / "a"
    cfg = json.loads((run2 / "config.json").read_text())
    cfg["data"]["dir"] = str(tmp_path / "gone")        # as if the config's absolute path were stale
    (run2 / "config.json").write_text(json.dumps(cfg))
    rec = json.loads((run2 / "dataset.json").read_text())
    rec["absolute_dir"] = str(tmp_path / "gone-too")    # ... and the recorded absolute path
    (run2 / "dataset.json").write_text(json.dumps(rec))

    model0, tok0 = tngram.load_run(str(run))
    model, tok = tngram.load_run(str(run2))
    for a, b in zip(model0.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    text = tngram.sample(model, tok, "the", max_new_tokens=5, temperature=0)
    assert text.startswith("the") and text == tngram.sample(model0, tok0, "the", max_new_tokens=5, temperature=0)

    assert main(["sample", str(run2), "--prompt", "the", "--max-new-tokens", "5", "--temperature", "0",
                 "--device", "cpu", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out.strip().split("\n" + "-" * 40 + "\n")
    assert out == [text, text]                          # greedy: two identical samples

    # bpb finds the dataset through dataset.json's relative path
    assert main(["eval", "bpb", str(run2), "--device", "cpu"]) == 0
    res = json.loads((run2 / "eval" / "bpb.json").read_text())
    assert res["data_dir"] == str(moved / "data") and res["val_bpb"] > 0

    # without any dataset: sampling still works; bpb names --data, and --data works
    shutil.rmtree(moved / "data")
    assert main(["sample", str(run2), "--prompt", "the", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["eval", "bpb", str(run2), "--device", "cpu"]) == 2
    assert "--data DIR" in capsys.readouterr().err
    assert main(["eval", "bpb", str(run2), "--device", "cpu", "--data", str(data)]) == 0
    assert json.loads((run2 / "eval" / "bpb.json").read_text())["val_bpb"] == pytest.approx(res["val_bpb"])


def test_sampling_seeds_differ_and_repeat(trained, capsys):
    _, run, _ = trained
    args = ["sample", str(run), "--prompt", "a", "--max-new-tokens", "8", "--temperature", "1.5", "--top-k", "0",
            "--num-samples", "3", "--seed", "5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    samples = first.strip().split("\n" + "-" * 40 + "\n")
    assert len(samples) == 3 and len(set(samples)) > 1
    assert main(args[:-2] + ["--seed", "6", "--num-samples", "1"]) == 0   # sample i uses seed SEED+i
    assert capsys.readouterr().out.strip() == samples[1]


def test_sample_rejects_bad_flags(trained, capsys):
    _, run, _ = trained
    assert main(["sample", str(run), "--prompt", "a", "--num-samples", "0"]) == 2
    assert "--num-samples must be in [1, 10000], got 0" in capsys.readouterr().err
    assert main(["sample", str(run), "--prompt", "a", "--device", "tpu"]) == 2
    assert "--device must be" in capsys.readouterr().err
    with pytest.raises(TngramError, match="no config.json"):
        tngram.load_run(str(run / "nope"))
