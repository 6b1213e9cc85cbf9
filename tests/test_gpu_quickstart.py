"""docs/GPU.md is a page for GPU owners: its first screen is a quick start of at most 5 commands,
and each runs here on the CPU as written, the model shrunk to tiny shapes: the install (the extras
it names exist and bring Triton and the Hub client), `tngram doctor`, `tngram plan --card`, the
FineWeb download from local files standing in for the Hub, and torchrun with one CPU process on
that download. Its measured table is generated, and the page stays short."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pydoc_data.topics
import pytest

import tngram.data.fineweb as fw
from tngram.cli import main
from tngram.data.shards import write_shard
from tngram.data.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GPU = (ROOT / "docs" / "GPU.md").read_text(encoding="utf-8")
FIRST_SCREEN = 25  # lines
# paper-l9-tngram at tiny shapes (the recipe's vocabulary 1024 stays: the FineWeb tokenizer's)
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1",
        "model.sequence_len=64", "model.memory_layers=1", "model.memory.cp_rank=16",
        "data.global_batch_tokens=128", "data.micro_batch_seqs=2", "data.val_tokens=512",
        "schedule.steps=2", "schedule.warmdown_steps=1", "optim.muon_momentum_warmup_steps=1",
        "run.val_every=0", "run.checkpoint_every=0", "run.dtype=fp32", "run.device=cpu"]
SHARDS = 32


def quick_start() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", GPU, flags=re.S)
    assert block and GPU[: block.end()].count("\n") < FIRST_SCREEN, "no quick start up top"
    return [ln.split("  #")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]


def with_tiny(argv: list[str]) -> list[str]:
    return argv + [a for s in TINY for a in ("--set", s)]


def test_the_first_screen_is_five_commands_and_the_page_is_short():
    cmds = quick_start()
    assert [c.split()[0] for c in cmds] == ["pip", "tngram", "tngram", "tngram", "torchrun"]
    assert "--data" in cmds[-1] and "--card" in cmds[2]
    assert len(GPU.splitlines()) <= 120
    for word in ("carry", "sitting", ".gpu/", "card-version"):      # no words of our workshop
        assert word not in GPU, word


def test_the_install_names_the_extras_for_triton_and_the_hub():
    extras = re.search(r'"\.\[([a-z,]+)\]"', quick_start()[0]).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(extras) == {"kernels", "fineweb"}
    assert any(d.startswith("triton") for d in declared["kernels"])
    assert any(d.startswith("huggingface_hub") for d in declared["fineweb"])


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """The Hub's parameter-golf dataset repo as local files: the manifest, a tokenizer (vocabulary
    1024), one val shard and SHARDS train shards of 600 tokens each."""
    root = tmp_path / "hub"
    data = root / "datasets" / "datasets" / "fineweb10B_sp1024"
    data.mkdir(parents=True)
    upstream = {"datasets": [{"name": "fineweb10B_sp1024", "tokenizer_name": "sp_bpe_1024",
                              "stats": {"files_train": SHARDS, "files_val": 1}}],
                "tokenizers": [{"name": "sp_bpe_1024",
                                "model_path": "tokenizers/fineweb_1024_bpe.model"}]}
    (root / "datasets" / "manifest.json").write_text(json.dumps(upstream))
    rng = np.random.default_rng(0)
    for split, n, count in (("val", 1, 4000), ("train", SHARDS, 600)):
        for i in range(n):
            toks = np.concatenate([[1], rng.integers(4, 1024, count - 1)])
            write_shard(data / f"fineweb_{split}_{i:06d}.bin", toks)
    train_tokenizer(pydoc_data.topics.topics.values(),
                    root / "datasets" / "tokenizers" / "fineweb_1024_bpe", 1024)

    def download(repo_id, remote_path, local_dir, timeout):
        dest = Path(local_dir) / remote_path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / remote_path, dest)
        return dest

    def files(repo_id, paths, timeout):
        return {p: {"size": (root / p).stat().st_size,
                    "sha256": hashlib.sha256((root / p).read_bytes()).hexdigest()} for p in paths}

    monkeypatch.setattr(fw, "_download_file", download)
    monkeypatch.setattr(fw, "_remote_files", files)
    monkeypatch.setattr(fw, "_probe", lambda repo_id, timeout: None)
    monkeypatch.setattr(fw, "_import_hf", lambda: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return root


def test_every_quick_start_command_runs_at_tiny_shapes(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pip, doctor, plan, data, run = (shlex.split(c) for c in quick_start())
    assert pip[:3] == ["pip", "install", "-e"]                  # checked above: its extras
    assert main(doctor[1:]) == 0
    assert "TN-gram cpu/float32" in capsys.readouterr().out
    assert main(with_tiny(plan[1:]) + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["card"] == "H100" and r["peak_tflops"] == 989.4 and r["no_checkpointing"]["fits"]
    assert main(data[1:]) == 0
    folder = tmp_path / data[data.index("--out") + 1]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["files"]["train"]) == SHARDS and manifest["vocab_size"] == 1024
    assert run[:2] == ["torchrun", "--standalone"] and run[run.index("--data") + 1] == data[-1]
    cmd = [sys.executable, "-m", "torch.distributed.run", *run[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(with_tiny(cmd) + ["--no-progress"], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / run[run.index("--out") + 1] / "summary.json").read_text())
    assert summary["steps"] == 2
