"""fetch_package downloads a pinned archive from a package index's Simple API (PEP 691 JSON) over
real HTTP (a local http.server: no network), checks its pinned sha256, and keeps nothing else."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tngram.eval.bundle as bundle
from tngram.common import TngramError

ARCHIVE = b"not really a tar.gz, but bytes with a known sha256\n" * 100
NAME, FILE = "bigbench", "bigbench-1.0.0.tar.gz"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """A one-package index at http://127.0.0.1:PORT/simple; `state` says what it serves."""
    state = {"listed": True, "body": ARCHIVE, "hits": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == f"/simple/{NAME}/":
                assert self.headers["Accept"] == "application/vnd.pypi.simple.v1+json"
                files = [{"filename": FILE, "url": f"../../files/{FILE}",
                          "hashes": {"sha256": hashlib.sha256(ARCHIVE).hexdigest()}}] if state["listed"] else []
                body = json.dumps({"files": files}).encode()
            elif self.path == f"/files/{FILE}":
                state["hits"] += 1
                body = state["body"]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple/")
    monkeypatch.setitem(bundle.PACKAGE_SHA256, FILE, hashlib.sha256(ARCHIVE).hexdigest())
    yield state
    server.shutdown()


def test_downloads_and_verifies(index: dict, tmp_path: Path) -> None:
    path = bundle.fetch_package(NAME, tmp_path / "pkgs")
    assert path == tmp_path / "pkgs" / FILE and path.read_bytes() == ARCHIVE
    assert sorted(p.name for p in (tmp_path / "pkgs").iterdir()) == [FILE]   # no temp file left
    bundle.fetch_package(NAME, tmp_path / "pkgs")                            # cached: not fetched again
    assert index["hits"] == 1


def test_wrong_hash_is_rejected_and_nothing_is_kept(index: dict, tmp_path: Path) -> None:
    index["body"] = ARCHIVE + b"tampered"
    with pytest.raises(TngramError, match=f"sha256.*place {FILE} in"):
        bundle.fetch_package(NAME, tmp_path / "pkgs")
    assert list((tmp_path / "pkgs").iterdir()) == []


def test_unlisted_file_gives_one_clear_error(index: dict, tmp_path: Path) -> None:
    index["listed"] = False
    with pytest.raises(TngramError, match=f"{FILE} is not listed by .*place {FILE} in"):
        bundle.fetch_package(NAME, tmp_path / "pkgs")


def test_pinned_hashes_cover_every_package() -> None:
    assert set(bundle.PACKAGE_SHA256) == {f for _, f in bundle.PACKAGES.values()}
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in bundle.PACKAGE_SHA256.values())
