"""FineWeb download: layout logic on local fake files, and the offline failures. No network."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
from pathlib import Path

import numpy as np
import pydoc_data.topics
import pytest

import tngram.data.fineweb as fw
from tngram.common import TngramError
from tngram.data.build import open_dataset
from tngram.data.loader import TokenLoader
from tngram.data.shards import read_shard, write_shard
from tngram.data.tokenizer import train_tokenizer

UPSTREAM = {  # the shape of parameter-golf's datasets/manifest.json (data/download_hf_docs_and_tokenize.py)
    "version": "10B",
    "shuffle_seed": 1337,
    "datasets": [
        {"name": "fineweb10B_sp1024", "tokenizer_name": "sp_bpe_1024", "vocab_size": 1024,
         "stats": {"files_train": 3, "files_val": 1, "tokens_train": 3000, "tokens_val": 500}},
        {"name": "fineweb10B_sp4096", "tokenizer_name": "sp_bpe_4096", "stats": {"files_train": 2, "files_val": 1}},
    ],
    "tokenizers": [
        {"name": "sp_bpe_1024", "model_path": "tokenizers/fineweb_1024_bpe.model",
         "vocab_path": "tokenizers/fineweb_1024_bpe.vocab"},
    ],
}


@pytest.fixture()
def remote(tmp_path):
    """A local copy of the remote repo layout: datasets/manifest.json, datasets/datasets/..., datasets/tokenizers/."""
    root = tmp_path / "remote" / "datasets"
    (root / "datasets" / "fineweb10B_sp1024").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(UPSTREAM), encoding="utf-8")
    rng = np.random.default_rng(0)
    for split, n, count in (("val", 1, 500), ("train", 3, 1000)):
        for i in range(n):
            toks = np.concatenate([[1], rng.integers(4, 1024, count - 1)])
            write_shard(root / "datasets" / "fineweb10B_sp1024" / f"fineweb_{split}_{i:06d}.bin", toks)
    train_tokenizer(pydoc_data.topics.topics.values(), root / "tokenizers" / "fineweb_1024_bpe", 1024)
    return tmp_path / "remote"


@pytest.fixture()
def fake_hub(remote, monkeypatch):
    calls: list[str] = []

    def download(repo_id, remote_path, local_dir, timeout):
        assert repo_id == "willdepueoai/parameter-golf" and timeout == 10.0
        calls.append(remote_path)
        dest = Path(local_dir) / remote_path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(remote / remote_path, dest)
        return dest

    monkeypatch.setattr(fw, "_download_file", download)
    monkeypatch.setattr(fw, "_probe", lambda repo_id, timeout: None)
    monkeypatch.setattr(fw, "_import_hf", lambda: None)  # huggingface_hub need not be installed
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("MATCHED_FINEWEB_REPO_ID", raising=False)
    monkeypatch.delenv("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", raising=False)
    return calls


def test_plan_matches_upstream_layout():
    plan = fw.plan_fineweb(UPSTREAM, "sp1024", 2)
    assert plan.files == [
        ("datasets/datasets/fineweb10B_sp1024/fineweb_val_000000.bin", "fineweb_val_000000.bin"),
        ("datasets/datasets/fineweb10B_sp1024/fineweb_train_000000.bin", "fineweb_train_000000.bin"),
        ("datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin", "fineweb_train_000001.bin"),
        ("datasets/tokenizers/fineweb_1024_bpe.model", "tokenizer.model"),
        ("datasets/tokenizers/fineweb_1024_bpe.vocab", "tokenizer.vocab"),
    ]
    assert plan.train == ["fineweb_train_000000.bin", "fineweb_train_000001.bin"]
    assert fw.plan_fineweb(UPSTREAM, "sp1024", 0).train == []
    with pytest.raises(TngramError, match="only 3 train shards"):
        fw.plan_fineweb(UPSTREAM, "sp1024", 4)
    with pytest.raises(TngramError, match="fineweb10B_sp8192 is not in the upstream manifest"):
        fw.plan_fineweb(UPSTREAM, "sp8192", 1)
    with pytest.raises(TngramError, match="tokenizer 'sp_bpe_4096'"):
        fw.plan_fineweb(UPSTREAM, "sp4096", 1)
    with pytest.raises(TngramError, match="unsupported FineWeb variant"):
        fw.plan_fineweb(UPSTREAM, "byte260", 1)


def test_download_layout_opens_as_dataset(fake_hub, remote, tmp_path):
    out = fw.download_fineweb("sp1024", 2, tmp_path / "fw", progress=False)
    assert fake_hub[0] == "datasets/manifest.json" and len(fake_hub) == 1 + 1 + 2 + 2  # manifest, val, 2 train, tok
    info = open_dataset(out)
    assert [p.name for p in info.train_files] == ["fineweb_train_000000.bin", "fineweb_train_000001.bin"]
    assert [p.name for p in info.val_files] == ["fineweb_val_000000.bin"]
    assert info.tokenizer_path.name == "tokenizer.model" and info.vocab_size == 1024
    tok_src = remote / "datasets" / "tokenizers" / "fineweb_1024_bpe.model"
    assert info.tokenizer_path.read_bytes() == tok_src.read_bytes()
    assert info.manifest["tokenizer"]["source"].endswith("datasets/tokenizers/fineweb_1024_bpe.model")
    assert info.manifest["kind"] == "fineweb" and info.manifest["tokens"] == {"train": 2000, "val": 500}
    src = remote / "datasets" / "datasets" / "fineweb10B_sp1024" / "fineweb_train_000001.bin"
    assert (out / "fineweb_train_000001.bin").read_bytes() == src.read_bytes()
    assert not (out / ".hf-download").exists()
    x, _ = TokenLoader(info.train_files, 2, 10, vocab_size=info.vocab_size).next_batch()
    assert np.array_equal(x.numpy().ravel(), read_shard(info.train_files[0])[:20])
    # asking again fetches nothing; asking for more fetches only the missing shard
    fake_hub.clear()
    fw.download_fineweb("sp1024", 2, out, progress=False)
    assert fake_hub == []
    fw.download_fineweb("sp1024", 3, out, progress=False)
    assert fake_hub == ["datasets/datasets/fineweb10B_sp1024/fineweb_train_000002.bin"]
    assert len(open_dataset(out).train_files) == 3


def test_connection_error_is_one_clear_message(fake_hub, tmp_path, monkeypatch):
    def refuse(repo_id, remote_path, local_dir, timeout):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(fw, "_download_file", refuse)
    t0 = time.perf_counter()
    with pytest.raises(TngramError) as ei:
        fw.download_fineweb("sp1024", 1, tmp_path / "fw", progress=False)
    assert time.perf_counter() - t0 < 5
    msg = str(ei.value)
    assert "datasets/manifest.json" in msg and "willdepueoai/parameter-golf" in msg and "ConnectionError" in msg
    assert not (tmp_path / "fw").exists()  # nothing half-written, not even an empty folder


def test_unreachable_hub_fails_at_once_before_downloading(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    monkeypatch.setattr(fw, "_import_hf", lambda: None)  # as if huggingface_hub were installed

    def no_network(req, timeout):
        assert timeout == 10.0
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(fw.urllib.request, "urlopen", no_network)
    monkeypatch.setattr(fw, "_download_file", lambda *a: pytest.fail("must not try to download"))
    with pytest.raises(TngramError) as ei:
        fw.download_fineweb("sp1024", 1, tmp_path / "fw", progress=False)
    msg = str(ei.value)
    assert "cannot reach" in msg and "https://hub.invalid/api/datasets/willdepueoai/parameter-golf" in msg
    assert "tngram data build" in msg


def test_http_error_means_online(monkeypatch):
    def answer(req, timeout):
        raise urllib.error.HTTPError(req.full_url, 401, "Unauthorized", {}, None)

    monkeypatch.setattr(fw.urllib.request, "urlopen", answer)
    fw._probe("willdepueoai/parameter-golf", 1.0)  # no exception: the server answered


def test_hf_hub_offline_never_touches_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fw, "_probe", lambda *a: pytest.fail("must not probe"))
    monkeypatch.setattr(fw, "_download_file", lambda *a: pytest.fail("must not download"))
    with pytest.raises(TngramError, match="HF_HUB_OFFLINE is set.*manifest.json"):
        fw.download_fineweb("sp1024", 1, tmp_path / "fw", progress=False)


def test_offline_mode_uses_complete_local_copy(fake_hub, tmp_path, monkeypatch):
    out = fw.download_fineweb("sp1024", 1, tmp_path / "fw", progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.clear()
    assert fw.download_fineweb("sp1024", 1, out, progress=False) == out and fake_hub == []
    with pytest.raises(TngramError, match="HF_HUB_OFFLINE is set.*fineweb_train_000001.bin"):
        fw.download_fineweb("sp1024", 2, out, progress=False)


def test_missing_huggingface_hub(tmp_path, monkeypatch):
    import sys

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(TngramError, match="pip install huggingface_hub"):
        fw.download_fineweb("sp1024", 1, tmp_path / "fw", progress=False)


def test_refuses_foreign_folder(tmp_path, fake_hub):
    (tmp_path / "mine.txt").write_text("x", encoding="utf-8")
    with pytest.raises(TngramError, match="not a FineWeb download"):
        fw.download_fineweb("sp1024", 1, tmp_path, progress=False)
