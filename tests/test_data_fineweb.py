"""FineWeb download: layout logic on local fake files, and the offline failures. No network."""

from __future__ import annotations

import hashlib
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

    def files(repo_id, paths, timeout):
        """What the Hub's paths-info API records: shards as LFS files (sha256), the rest as git
        blobs (sha1 of "blob SIZE\\0" + content, what `git hash-object` prints)."""
        out = {}
        for p in paths:
            data = (remote / p).read_bytes()
            if p.endswith(".bin"):
                out[p] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            else:
                blob = b"blob %d\0" % len(data) + data
                out[p] = {"size": len(data), "git_sha1": hashlib.sha1(blob).hexdigest()}
        return out

    monkeypatch.setattr(fw, "_download_file", download)
    monkeypatch.setattr(fw, "_remote_files", files)
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


SHARD = "datasets/datasets/fineweb10B_sp1024/fineweb_train_{:06d}.bin"


def test_git_blob_digest_is_gits(tmp_path):
    """The digest of a non-LFS file is git's blob id: the one `git hash-object` gives for it."""
    import subprocess

    f = tmp_path / "manifest.json"
    f.write_bytes(b'{"version": "10B"}\n')
    git = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("git is not installed")
    assert fw.file_matches(f, {"size": f.stat().st_size, "git_sha1": git.stdout.strip()})
    assert not fw.file_matches(f, {"size": f.stat().st_size, "git_sha1": "0" * 40})


def test_interrupted_download_resumes_with_what_it_has(fake_hub, remote, tmp_path, monkeypatch):
    real = fw._download_file
    broken = {SHARD.format(1)}

    def flaky(repo_id, remote_path, local_dir, timeout):
        if remote_path in broken:
            raise ConnectionError("connection reset by peer")
        return real(repo_id, remote_path, local_dir, timeout)

    monkeypatch.setattr(fw, "_download_file", flaky)
    out = tmp_path / "fw"
    with pytest.raises(TngramError, match="fineweb_train_000001.bin.*ConnectionError"):
        fw.download_fineweb("sp1024", 3, out, progress=False)
    kept = sorted(p.name for p in out.iterdir())
    assert kept == ["fineweb_train_000000.bin", "fineweb_val_000000.bin", "upstream_manifest.json"]
    assert not (out / "manifest.json").exists()               # not a dataset until complete
    broken.clear()
    fake_hub.clear()
    fw.download_fineweb("sp1024", 3, out, progress=False)
    assert fake_hub == [SHARD.format(1), SHARD.format(2), "datasets/tokenizers/fineweb_1024_bpe.model",
                        "datasets/tokenizers/fineweb_1024_bpe.vocab"]       # only what was missing
    info = open_dataset(out)
    assert len(info.train_files) == 3 and set(info.manifest["verified"]) == {
        "fineweb_val_000000.bin", *(f"fineweb_train_{i:06d}.bin" for i in range(3)),
        "tokenizer.model", "tokenizer.vocab"}
    for i in range(3):
        src = remote / SHARD.format(i)
        assert (out / f"fineweb_train_{i:06d}.bin").read_bytes() == src.read_bytes()


def test_a_file_that_does_not_match_the_hub_is_deleted_and_named(fake_hub, remote, tmp_path,
                                                                   monkeypatch):
    real = fw._download_file
    corrupt = {SHARD.format(0)}

    def flip(repo_id, remote_path, local_dir, timeout):
        got = real(repo_id, remote_path, local_dir, timeout)
        if remote_path in corrupt:                      # one byte changed in transit, same size
            data = bytearray(got.read_bytes())
            data[-1] ^= 1
            got.write_bytes(bytes(data))
        return got

    monkeypatch.setattr(fw, "_download_file", flip)
    out = tmp_path / "fw"
    with pytest.raises(TngramError, match="fineweb_train_000000.bin from .* does not match .*"
                                          "sha256.*run the command again"):
        fw.download_fineweb("sp1024", 2, out, progress=False)
    assert not (out / "fineweb_train_000000.bin").exists() and not (out / ".hf-download").exists()
    corrupt.clear()
    fake_hub.clear()
    fw.download_fineweb("sp1024", 2, out, progress=False)
    assert SHARD.format(0) in fake_hub and "datasets/datasets/fineweb10B_sp1024/fineweb_val_000000.bin" not in fake_hub
    # a verified file that later lost bytes is fetched again, the others are trusted
    shard = out / "fineweb_train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    fake_hub.clear()
    fw.download_fineweb("sp1024", 2, out, progress=False)
    assert fake_hub == [SHARD.format(1)]
    assert shard.read_bytes() == (remote / SHARD.format(1)).read_bytes()


def test_remote_files_reads_the_hubs_records(monkeypatch):
    """_remote_files on huggingface_hub's own RepoFile objects (as get_paths_info returns them):
    LFS files by sha256, others by git blob id; a path the repo lacks is named."""
    hf_api = pytest.importorskip("huggingface_hub.hf_api")
    shard, tok = SHARD.format(0), "datasets/tokenizers/fineweb_1024_bpe.model"
    answer = [hf_api.RepoFile(path=shard, size=2048, oid="a" * 40,
                              lfs={"size": 2048, "oid": "b" * 64, "pointerSize": 134}),
              hf_api.RepoFile(path=tok, size=99, oid="c" * 40)]

    class Api:
        def get_paths_info(self, repo_id, paths, repo_type):
            assert repo_type == "dataset"
            return [f for f in answer if f.path in paths]

    monkeypatch.setattr(fw, "_import_hf", lambda: type("hf", (), {"HfApi": Api}))
    assert fw._remote_files("r/x", [shard, tok], 1.0) == {
        shard: {"size": 2048, "sha256": "b" * 64}, tok: {"size": 99, "git_sha1": "c" * 40}}
    with pytest.raises(TngramError, match="r/x has no datasets/nope.bin"):
        fw._remote_files("r/x", [shard, "datasets/nope.bin"], 1.0)
