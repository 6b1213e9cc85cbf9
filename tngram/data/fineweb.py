"""Download parameter-golf's published FineWeb export (tokenizer + shards) for users with internet.

Source: the Hugging Face dataset repo `willdepueoai/parameter-golf` (override with
$MATCHED_FINEWEB_REPO_ID / $MATCHED_FINEWEB_REMOTE_ROOT_PREFIX, as upstream), remote root
`datasets/`. Its `datasets/manifest.json` lists each variant (`fineweb10B_sp1024`, ...) with shard
counts and its tokenizer. We fetch the manifest, every val shard, the first K train shards and
the tokenizer files with `huggingface_hub.hf_hub_download`, into one flat folder:

    <data_root>/fineweb-sp1024/
        manifest.json              ours: kind "fineweb", file lists, tokenizer, vocab_size
        upstream_manifest.json     parameter-golf's datasets/manifest.json
        tokenizer.model            (+ .vocab) = datasets/tokenizers/fineweb_1024_bpe.model
        fineweb_val_000000.bin
        fineweb_train_000000.bin ...

`open_dataset` then reads it like any other dataset. Every file is checked against the size and
digest the Hub records for it (sha256 for LFS files, the git blob id otherwise) before it joins
the folder; a file that does not match is deleted and named. Files land whole (downloaded beside,
then renamed), so an interrupted download resumes: the same command fetches only what is missing,
and a larger K only the new shards. Files verified before are trusted by their recorded size
(manifest.json "verified"). Offline the command fails at once: it first probes the Hub with one
short HEAD request (huggingface_hub itself retries for ~20 s), and with $HF_HUB_OFFLINE set it
never touches the network.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import sys
import re
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tngram.common import TngramError, print0
from tngram.data.build import FORMAT, FORMAT_VERSION, data_root, write_manifest
from tngram.data.corpus import sha256_file
from tngram.data.shards import read_shard_header

DEFAULT_REPO_ID = "willdepueoai/parameter-golf"
DEFAULT_REMOTE_ROOT = "datasets"
DEFAULT_TIMEOUT = 10.0

__all__ = ["FinewebPlan", "plan_fineweb", "fineweb_dir", "download_fineweb", "hf_offline"]


@dataclass
class FinewebPlan:
    dataset: str  # e.g. "fineweb10B_sp1024"
    files: list[tuple[str, str]] = field(default_factory=list)  # (remote path, local file name)
    train: list[str] = field(default_factory=list)  # local names
    val: list[str] = field(default_factory=list)
    tokenizer_model: str = ""
    tokenizer_vocab: str | None = None
    tokenizer_remote: str = ""  # e.g. datasets/tokenizers/fineweb_1024_bpe.model
    entry: dict[str, Any] = field(default_factory=dict)  # the upstream dataset entry


def fineweb_dir(variant: str = "sp1024") -> Path:
    """Default download folder: data_root()/fineweb-{variant}."""
    return data_root() / f"fineweb-{variant}"


def hf_offline() -> bool:
    """True if $HF_HUB_OFFLINE asks huggingface_hub not to use the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _dataset_name(variant: str) -> str:
    if not re.fullmatch(r"sp\d+", variant):
        raise TngramError(
            f"unsupported FineWeb variant {variant!r}: expected sp<VOCAB_SIZE>, e.g. sp1024"
        )
    return f"fineweb10B_{variant}"


def plan_fineweb(
    upstream: dict[str, Any],
    variant: str,
    train_shards: int,
    remote_root: str = DEFAULT_REMOTE_ROOT,
) -> FinewebPlan:
    """Which remote files to fetch and their local names, from parameter-golf's manifest."""
    name = _dataset_name(variant)
    if train_shards < 0:
        raise TngramError(f"--train-shards must be >= 0, got {train_shards}")
    entry = next((d for d in upstream.get("datasets", []) if d.get("name") == name), None)
    if entry is None:
        have = ", ".join(str(d.get("name")) for d in upstream.get("datasets", [])) or "none"
        raise TngramError(
            f"variant {variant}: dataset {name} is not in the upstream manifest (it has: {have})"
        )
    stats = entry.get("stats") or {}
    try:
        n_train, n_val = int(stats["files_train"]), int(stats["files_val"])
    except (KeyError, TypeError, ValueError):
        raise TngramError(
            f"upstream manifest entry {name} has no stats.files_train / stats.files_val"
        ) from None
    if train_shards > n_train:
        raise TngramError(
            f"{variant} has only {n_train} train shards upstream; requested {train_shards}"
        )
    tok = next(
        (t for t in upstream.get("tokenizers", []) if t.get("name") == entry.get("tokenizer_name")),
        None,
    )
    if tok is None or not tok.get("model_path"):
        raise TngramError(
            f"upstream manifest: tokenizer {entry.get('tokenizer_name')!r} of {name} not found"
        )
    root = f"{remote_root}/" if remote_root else ""
    plan = FinewebPlan(dataset=name, entry=entry)
    for split, n in (("val", n_val), ("train", train_shards)):
        for i in range(n):
            local = f"fineweb_{split}_{i:06d}.bin"
            plan.files.append((f"{root}datasets/{name}/{local}", local))
            getattr(plan, split).append(local)
    # stored under our uniform names (every dataset has tokenizer.model); the manifest keeps the
    # origin
    plan.tokenizer_model = "tokenizer.model"
    plan.files.append((f"{root}{tok['model_path']}", plan.tokenizer_model))
    if tok.get("vocab_path"):
        plan.tokenizer_vocab = "tokenizer.vocab"
        plan.files.append((f"{root}{tok['vocab_path']}", plan.tokenizer_vocab))
    plan.tokenizer_remote = f"{root}{tok['model_path']}"
    return plan


def _import_hf() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise TngramError(
            "`tngram data fineweb` needs the huggingface_hub package: pip install huggingface_hub "
            "(or pip install 'tngram[fineweb]')"
        ) from None
    return huggingface_hub


def _probe(repo_id: str, timeout: float) -> None:
    """One short HEAD request to the Hub so that offline machines fail at once."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/datasets/{repo_id}"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # the server answered: we are online (auth/404 problems surface in the download)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TngramError(
            f"cannot reach the Hugging Face Hub: tried HEAD {url} ({timeout:.0f} s timeout): "
            f"{reason}. "
            "`tngram data fineweb` needs internet access; offline, use the default corpus "
            "(`tngram data build`) or your own text (`tngram data build --from-text PATH`)."
        ) from None


def _download_file(repo_id: str, remote_path: str, local_dir: Path, timeout: float) -> Path:
    """Fetch one file of the dataset repo into local_dir (keeping its remote path); return it."""
    hf = _import_hf()
    return Path(
        hf.hf_hub_download(
            repo_id=repo_id,
            filename=remote_path,
            repo_type="dataset",
            local_dir=str(local_dir),
            etag_timeout=timeout,
        )
    )


def _remote_files(repo_id: str, paths: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """The size and digest the Hub records for each remote path: {"size", "sha256"} for LFS
    files, {"size", "git_sha1"} (the git blob id) for the others."""
    hf = _import_hf()
    try:
        infos = hf.HfApi().get_paths_info(repo_id, paths, repo_type="dataset")
    except Exception as e:
        raise TngramError(
            f"reading the file list of the Hugging Face dataset repo {repo_id} failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    out: dict[str, dict[str, Any]] = {}
    for f in infos:
        if getattr(f, "size", None) is not None:  # a file, not a folder
            lfs = getattr(f, "lfs", None)
            out[f.path] = (
                {"size": f.size, "sha256": lfs.sha256}
                if lfs
                else {"size": f.size, "git_sha1": f.blob_id}
            )
    absent = [p for p in paths if p not in out]
    if absent:
        raise TngramError(f"the Hugging Face dataset repo {repo_id} has no {', '.join(absent[:3])}")
    return out


def file_matches(path: Path, want: dict[str, Any]) -> bool:
    """Whether `path` has the size and digest `want` records (see _remote_files)."""
    if path.stat().st_size != want["size"]:
        return False
    h = hashlib.sha256() if "sha256" in want else hashlib.sha1(b"blob %d\0" % want["size"])
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest() == want.get("sha256", want.get("git_sha1"))


def _fetch(
    repo_id: str, remote_path: str, dest: Path, staging: Path, timeout: float, want: dict[str, Any]
) -> None:
    try:
        got = _download_file(repo_id, remote_path, staging, timeout)
    except TngramError:
        raise
    except Exception as e:  # connection errors, HTTP errors, huggingface_hub's own errors
        raise TngramError(
            f"downloading {remote_path} from the Hugging Face dataset repo {repo_id} "
            f"(https://huggingface.co/datasets/{repo_id}) failed: {type(e).__name__}: {e}"
        ) from None
    if not file_matches(got, want):
        got.unlink()
        raise TngramError(
            f"{remote_path} from {repo_id} does not match the size and digest the Hub records "
            f"for it ({want}); deleted it: run the command again to fetch it again"
        )
    os.replace(got, dest)


def _verified(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The files an earlier download verified ({name: record}, from its manifest.json); a
    manifest that cannot be read, or a record without a size, verifies nothing."""
    from tngram.readback import load_json

    try:
        records = load_json(out_dir / "manifest.json", out_dir).get("verified")
    except (OSError, TngramError):
        return {}
    if not isinstance(records, dict):
        return {}
    return {
        k: v for k, v in records.items() if isinstance(v, dict) and isinstance(v.get("size"), int)
    }


def download_fineweb(
    variant: str = "sp1024",
    train_shards: int = 1,
    out: str | os.PathLike | None = None,
    *,
    repo_id: str | None = None,
    remote_root: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool = True,
) -> Path:
    """Fetch the FineWeb export into `out` (default fineweb_dir(variant)); return the dataset
    dir."""
    repo_id = repo_id or os.environ.get("MATCHED_FINEWEB_REPO_ID", DEFAULT_REPO_ID)
    remote_root = (
        remote_root
        if remote_root is not None
        else os.environ.get("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", DEFAULT_REMOTE_ROOT)
    )
    _dataset_name(variant)
    out_dir = Path(out).expanduser() if out is not None else fineweb_dir(variant)
    _refuse_foreign_folder(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / ".hf-download"
    online = _OnlineGate(hf_offline(), out_dir, repo_id, timeout)
    try:
        upstream = _upstream_manifest(out_dir, repo_id, remote_root, staging, timeout, online)
        plan = plan_fineweb(upstream, variant, train_shards, remote_root)
        verified = _verified(out_dir)
        ok = _fetch_plan(plan, out_dir, verified, repo_id, staging, timeout, online, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # do not leave an empty folder behind a failed first attempt
        raise
    shutil.rmtree(staging, ignore_errors=True)
    manifest = _fineweb_manifest(out_dir, plan, upstream, repo_id, remote_root, {**verified, **ok})
    write_manifest(out_dir, manifest)
    print0(f"FineWeb {variant}: {len(plan.train)} train + {len(plan.val)} val shards in {out_dir}")
    return out_dir


def _refuse_foreign_folder(out_dir: Path) -> None:
    """Raise when `out_dir` holds files but no FineWeb download (neither manifest)."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        m = out_dir / "manifest.json"
        if not (out_dir / "upstream_manifest.json").is_file() and not m.is_file():
            raise TngramError(
                f"{out_dir} exists, is not empty and is not a FineWeb download; choose another "
                f"--out"
            )


class _OnlineGate:
    """Called before the first thing a download needs from the network: refuses it under
    HF_HUB_OFFLINE, and probes the Hub once (the first call) so an offline run fails at once."""

    def __init__(self, offline: bool, out_dir: Path, repo_id: str, timeout: float) -> None:
        self.offline, self.out_dir, self.repo_id, self.timeout = offline, out_dir, repo_id, timeout
        self.checked = False

    def __call__(self, what: str) -> None:
        """Allow fetching `what` (named in the offline error), or raise."""
        if self.offline:
            raise TngramError(
                f"HF_HUB_OFFLINE is set and {what} is not in {self.out_dir}: cannot download it "
                f"from the Hugging Face dataset repo {self.repo_id}. Unset HF_HUB_OFFLINE when "
                "online, or use `tngram data build` (offline default corpus)."
            )
        if not self.checked:
            _import_hf()
            _probe(self.repo_id, self.timeout)
            self.checked = True


def _upstream_manifest(
    out_dir: Path,
    repo_id: str,
    remote_root: str,
    staging: Path,
    timeout: float,
    online: _OnlineGate,
) -> dict[str, Any]:
    """parameter-golf's manifest.json, fetched into out_dir once and read (deleted if invalid)."""
    root = f"{remote_root}/" if remote_root else ""
    upstream_path = out_dir / "upstream_manifest.json"
    if not upstream_path.is_file():
        online(f"{root}manifest.json")
        want = _remote_files(repo_id, [f"{root}manifest.json"], timeout)
        _fetch(repo_id, f"{root}manifest.json", upstream_path, staging, timeout, *want.values())
    try:
        return json.loads(upstream_path.read_text(encoding="utf-8"))
    except ValueError as e:
        upstream_path.unlink()
        raise TngramError(
            f"{upstream_path}: invalid JSON ({e}); deleted it, please retry"
        ) from None


def _fetch_plan(
    plan: FinewebPlan,
    out_dir: Path,
    verified: dict[str, dict[str, Any]],
    repo_id: str,
    staging: Path,
    timeout: float,
    online: _OnlineGate,
    progress: bool,
) -> dict[str, dict[str, Any]]:
    """Fetch the plan's files not yet in out_dir; return {name: record} of every file of the
    plan now known good (verified before with its size unchanged, matched, or downloaded)."""
    from tqdm import tqdm

    ok = {
        name: verified[name]
        for _, name in plan.files
        if name in verified
        and (out_dir / name).is_file()
        and (out_dir / name).stat().st_size == verified[name].get("size")
    }
    todo = [(r, name) for r, name in plan.files if name not in ok]
    if not todo:
        return ok
    online(", ".join(name for _, name in todo[:3]) + (" ..." if len(todo) > 3 else ""))
    remote = _remote_files(repo_id, [r for r, _ in todo], timeout)
    for r, name in todo:  # left by a download that stopped before its manifest
        if (out_dir / name).is_file() and file_matches(out_dir / name, remote[r]):
            ok[name] = remote[r]
    missing = [(r, name) for r, name in todo if name not in ok]
    if missing:
        print0(
            f"downloading {len(missing)} file(s) from "
            f"https://huggingface.co/datasets/{repo_id} into {out_dir}"
        )
    for r, name in tqdm(
        missing, desc="fineweb", unit="file", disable=not (progress and sys.stderr.isatty())
    ):
        _fetch(repo_id, r, out_dir / name, staging, timeout, remote[r])
        ok[name] = remote[r]
    return ok


def _fineweb_manifest(
    out_dir: Path,
    plan: FinewebPlan,
    upstream: dict[str, Any],
    repo_id: str,
    remote_root: str,
    verified: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Our manifest.json of a complete download: files, token counts, tokenizer, provenance."""
    from tngram.data.tokenizer import load_tokenizer

    sp = load_tokenizer(out_dir / plan.tokenizer_model)
    counts = {
        split: sum(read_shard_header(out_dir / f) for f in getattr(plan, split))
        for split in ("train", "val")
    }
    rel = [*plan.train, *plan.val, plan.tokenizer_model] + (
        [plan.tokenizer_vocab] if plan.tokenizer_vocab else []
    )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": "fineweb",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vocab_size": int(sp.vocab_size()),
        "bos_id": int(sp.bos_id()),
        "tokenizer": {
            "model": plan.tokenizer_model,
            "vocab": plan.tokenizer_vocab,
            "sha256": sha256_file(out_dir / plan.tokenizer_model),
            "trained": False,
            "source": f"hf://datasets/{repo_id}/{plan.tokenizer_remote}",
        },
        "split": {
            "by": "document",
            "seed": upstream.get("shuffle_seed"),
            "note": "parameter-golf: first 50,000 docs of the shuffled list are val",
        },
        "sources": [
            {
                "name": "fineweb",
                "repo_id": repo_id,
                "remote_root": remote_root,
                "dataset": plan.dataset,
                "train_shards": len(plan.train),
                "upstream_stats": plan.entry.get("stats", {}),
                "text_licence": "FineWeb: ODC-By 1.0 (subject to Common Crawl terms of use)",
            }
        ],
        "tokens": counts,
        "files": {"train": plan.train, "val": plan.val},
        "file_sizes": {f: (out_dir / f).stat().st_size for f in rel},
        "verified": verified,
    }
