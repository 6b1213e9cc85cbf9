"""`tngram eval core|bpb|build-bundle` handlers on a tiny trained-shape run folder (random weights).

The run folder is made here: a SentencePiece model (BOS 1) in a data folder with a manifest and
a val shard (the handlers open it like the trainer, `open_dataset`), a 2-layer GPT's
config.json + model.safetensors via tngram.train.checkpoint, and the toy bundle of
test_core_fixtures. Numbers are not checked against constants (random weights); the handler must
write JSON equal to calling evaluate_core directly with the same model, tokenizer and max length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from test_bundle import make_packages
from test_core_fixtures import lm_items, mc_items, schema_items, write_toy_bundle
from tngram.cli.eval import add_commands

pytest.importorskip("sentencepiece")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tngram")
    add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _make_run(tmp: Path) -> tuple[Path, Path]:
    import sentencepiece as spm

    from tngram.model.gpt import GPT, GPTConfig
    from tngram.train.checkpoint import save_final_weights, save_run_config
    from tngram.train.config import DataConfig, TrainConfig

    data = tmp / "data"
    data.mkdir()
    corpus = [f"{it['query']} {' '.join(it['choices'])}" for it in mc_items()]
    corpus += [" ".join(it["context_options"]) + " " + it["continuation"] for it in schema_items()]
    corpus += [it["context"] + it["continuation"] for it in lm_items()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus * 10), model_prefix=str(data / "tokenizer"),
                                   vocab_size=96, model_type="bpe", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                   character_coverage=1.0, minloglevel=2)
    import numpy as np

    from tngram.data.build import FORMAT, write_manifest
    from tngram.data.shards import write_shard
    write_shard(data / "val_000000.bin", np.arange(4, 4 + 48 * 4 + 1, dtype=np.uint16) % 96)
    write_manifest(data, {"format": FORMAT, "vocab_size": 96, "tokenizer": {"model": "tokenizer.model"},
                          "files": {"train": [], "val": ["val_000000.bin"]}})
    torch.manual_seed(0)
    cfg = TrainConfig(name="tiny", model=GPTConfig(vocab_size=96, n_layer=2, n_embd=32, n_head=2, n_kv_head=1,
                                                   sequence_len=48, memory=None),
                      data=DataConfig(dir=str(data)))
    run = tmp / "run"
    run.mkdir()
    save_run_config(run, cfg.to_dict())
    save_final_weights(run, GPT(cfg.model), step=1)
    return run, data


def test_core_handler_writes_json_equal_to_direct_call(tmp_path: Path) -> None:
    from tngram.eval.core import SentencePieceTokenizer, evaluate_core
    from tngram.train.checkpoint import load_run_model

    run, data = _make_run(tmp_path)
    bundle = write_toy_bundle(tmp_path / "bundle")
    args = _parse(["eval", "core", str(run), "--bundle", str(bundle), "--max-per-task", "5", "--device", "cpu"])
    assert args.func(args) == 0
    out = json.loads((run / "eval" / "core-max5.json").read_text())      # N in the default name
    assert set(out["tasks"]) == {"mc_toy", "schema_toy", "lm_toy"}
    assert all(set(v) >= {"accuracy", "centered", "n"} and v["n"] == 5 for v in out["tasks"].values())

    model, cfg = load_run_model(run)
    direct = evaluate_core(lambda ids: model(ids), SentencePieceTokenizer(data / "tokenizer.model"), bundle,
                           max_per_task=5, max_seq_len=cfg["model"]["sequence_len"], progress=False)
    assert out["core"] == direct["core"]
    assert {k: v["accuracy"] for k, v in out["tasks"].items()} == {k: v["accuracy"] for k, v in direct["tasks"].items()}
    assert out["max_seq_len"] == 48


def test_core_handler_explains_a_missing_bundle(tmp_path: Path) -> None:
    from tngram.common import TngramError
    args = _parse(["eval", "core", str(tmp_path), "--bundle", str(tmp_path / "none")])
    with pytest.raises(TngramError, match="core.yaml"):
        args.func(args)


def test_bpb_handler(tmp_path: Path) -> None:
    import numpy as np

    from tngram.data.shards import write_shard
    run, data = _make_run(tmp_path)
    rng = np.random.default_rng(0)
    write_shard(data / "val_000000.bin", rng.integers(4, 96, size=48 * 4 + 1).astype(np.uint16))
    args = _parse(["eval", "bpb", str(run), "--device", "cpu", "--out", str(tmp_path / "bpb.json")])
    assert args.func(args) == 0
    res = json.loads((tmp_path / "bpb.json").read_text())
    assert res["val_bpb"] > 0 and res["tokens"] == 48 * 4


def test_build_bundle_handler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pkgs = make_packages(tmp_path / "pkgs")
    argv = ["eval", "build-bundle", "--out", str(tmp_path / "b"), "--cache", str(pkgs), "--no-download"]
    args = _parse(argv)
    assert args.func(args) == 0
    assert "CORE-offline bundle: 9 tasks built, 13 not built" in capsys.readouterr().out
    assert (tmp_path / "b" / "core.yaml").is_file()
    args = _parse(argv)
    assert args.func(args) == 0
    assert "nothing to do" in capsys.readouterr().out
