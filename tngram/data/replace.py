"""Replacing a dataset folder with a finished rebuild, keeping what no build wrote.

`tngram.data.build` builds into a hidden sibling folder and calls `swap_in` when it is complete:
the old folder is renamed away, the new one renamed into place, every entry of the old folder
that no build wrote (the user's files, a run folder kept there, links) is moved into the new one
by rename (never followed), and the old folder is removed only when nothing else is left in it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tngram.common import TngramError, print0
from tngram.safefs import remove_tree

_SHARD = re.compile(r"^(train|val)_\d+\.bin$")


def read_manifest(out: Path) -> dict[str, Any] | None:
    """out/manifest.json read back (tngram.readback), or None when missing or unreadable."""
    from tngram.readback import load_json

    try:
        m = load_json(out / "manifest.json", out)
    except (OSError, ValueError):  # missing, a link, a FIFO, not JSON: not up to date
        return None
    return m


def _own_entries(out: Path) -> set[str] | None:
    """The names in dataset folder `out` that a build wrote (its manifest's files, the manifest,
    tokenizer files, our temporaries); None when there is no readable manifest."""
    m = read_manifest(out)
    if m is None:
        return None
    names = {"manifest.json", "tokenizer.model", "tokenizer.vocab"}
    sizes = m.get("file_sizes")
    if isinstance(sizes, dict):
        names |= {k for k in sizes if isinstance(k, str)}
    files = m.get("files")
    if isinstance(files, dict):
        for split in files.values():
            if isinstance(split, list):
                names |= {f for f in split if isinstance(f, str)}
    return names


def _user_entries(out: Path) -> list[str]:
    """The names in dataset folder `out` that no build wrote (the user's files, a run folder kept
    there): a rebuild carries them into the new folder, never deletes them."""
    if not out.is_dir():
        return []
    own = _own_entries(out)
    if own is None:  # manifest unreadable (corrupt, a link, a FIFO): only names a build writes
        own = {"manifest.json", "tokenizer.model", "tokenizer.vocab"}
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name not in own
        and not _SHARD.match(p.name)
        and not (p.name.startswith(".manifest.json.") and p.name.endswith(".tmp"))
    )


def swap_in(staging: Path, out: Path) -> None:
    """Replace `out` by the finished `staging` folder; entries of the old folder that no build wrote
    (user files, a run folder kept there) are moved into the new one, and the old folder is
    removed only when nothing but the old build's own files is left in it (else it is kept, hidden,
    and named)."""
    if out.exists():
        keep = _user_entries(out)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        try:
            os.replace(staging, out)
        except BaseException:
            os.replace(old, out)
            raise
        left = []
        for name in keep:  # renames within one filesystem: links are moved, never followed
            try:
                if os.path.lexists(out / name):
                    raise FileExistsError(name)
                os.replace(old / name, out / name)
            except OSError:
                left.append(name)
        if left:
            raise TngramError(
                f"rebuilt {out}, but could not carry {', '.join(left[:5])} over from the old "
                f"folder: they are kept in {old}; move them back by hand"
            )
        if keep:
            print0(
                f"kept {len(keep)} entr{'y' if len(keep) == 1 else 'ies'} that no build wrote "
                f"({', '.join(keep[:5])}{', ...' if len(keep) > 5 else ''}) in the rebuilt {out}"
            )
        remove_tree(old)  # only the old build's own files are left; links inside are not followed
    else:
        os.replace(staging, out)
