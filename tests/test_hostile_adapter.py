"""A saved memory adapter (save_memory's folder) read back by load_memory (docs/RELIABILITY.md,
"Memory adapters"): nothing outside the folder is read, damaged or forged weights and specs are
one TngramError naming the file and the field, no non-finite weight loads, and the model is left
as it was."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import tiny_model, with_memory  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import load_memory, memory_modules, save_memory  # noqa: E402
from tngram.hf.adapter import DIGEST_KEY, SPEC_FILE, WEIGHTS_FILE  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter") / "mem"
    save_memory(with_memory("llama", "engram"), out)
    return out


def copy(saved: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in (SPEC_FILE, WEIGHTS_FILE):
        (dst / name).write_bytes((saved / name).read_bytes())
    return dst


def refused(folder: Path, needle: str) -> str:
    """load_memory refuses `folder` with one line holding `needle`; the base is untouched."""
    base = tiny_model("llama")
    with pytest.raises(TngramError) as e:
        load_memory(base, folder)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    assert type(base) is LlamaForCausalLM and not memory_modules(base)
    return msg


def edit_meta(folder: Path, fn) -> None:
    meta = json.loads((folder / SPEC_FILE).read_text())
    fn(meta)
    (folder / SPEC_FILE).write_text(json.dumps(meta))


def forge(folder: Path, tensors: dict) -> None:
    """Write `tensors` as the weights and their payload digest into the spec (a forger's work)."""
    from safetensors.torch import save

    data = save(tensors)
    payload = data[8 + int.from_bytes(data[:8], "little") :]
    (folder / WEIGHTS_FILE).write_bytes(data)
    edit_meta(folder, lambda m: m.update({DIGEST_KEY: hashlib.sha256(payload).hexdigest()}))


def test_an_untouched_adapter_loads(saved):
    base = tiny_model("llama")
    load_memory(base, saved)
    assert memory_modules(base)


def test_load_memory_never_follows_a_link_out_of_the_folder(saved, tmp_path):
    """The weights file a link to a (valid) weights file outside the folder: refused, unread."""
    folder = copy(saved, tmp_path / "mem")
    outside = tmp_path / "outside.safetensors"
    (folder / WEIGHTS_FILE).rename(outside)
    (folder / WEIGHTS_FILE).symlink_to(outside)
    refused(folder, "symbolic link")
    (folder / WEIGHTS_FILE).unlink()
    (folder / WEIGHTS_FILE).write_bytes(outside.read_bytes())
    (folder / SPEC_FILE).rename(tmp_path / "spec.json")
    (folder / SPEC_FILE).symlink_to(tmp_path / "spec.json")
    refused(folder, "symbolic link")


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.model"])
def test_load_memory_never_opens_a_tokenizer_outside_the_folder(path, saved, tmp_path):
    folder = copy(saved, tmp_path / "mem")
    edit_meta(folder, lambda m: m["spec"]["memory"].update(compress=True, tokenizer_path=path))
    refused(folder, "tokenizer_path must be a file name inside the folder")


def _truncate(w: Path) -> None:
    w.write_bytes(w.read_bytes()[:-100])


def _append(w: Path) -> None:
    w.write_bytes(w.read_bytes() + b"\0" * 4096)


def _random_payload(w: Path) -> None:
    data = w.read_bytes()
    n = 8 + int.from_bytes(data[:8], "little")
    w.write_bytes(data[:n] + torch.randn((len(data) - n) // 4).numpy().tobytes())


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_truncate, "truncated"),
        (_append, "oversized"),
        (_random_payload, "does not match its recorded sha256"),
        (lambda w: w.write_bytes(b""), "corrupt or truncated safetensors file"),
    ],
    ids=["truncated", "oversized", "random-payload", "empty"],
)
def test_load_memory_refuses_damaged_weights_naming_the_file(damage, needle, saved, tmp_path):
    folder = copy(saved, tmp_path / "mem")
    damage(folder / WEIGHTS_FILE)
    msg = refused(folder, needle)
    assert str(folder / WEIGHTS_FILE) in msg


def test_load_memory_refuses_weights_of_another_shape_naming_the_tensor(saved, tmp_path):
    from safetensors.torch import load_file

    folder = copy(saved, tmp_path / "mem")
    tensors = load_file(folder / WEIGHTS_FILE)
    k = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[k] = torch.zeros(tensors[k].shape[0] + 1, tensors[k].shape[1])
    forge(folder, tensors)
    refused(folder, f"tensor {k} has shape")


def test_load_memory_never_loads_non_finite_weights(saved, tmp_path):
    """NaN in a table with the payload digest forged to match: refused by its values."""
    from safetensors.torch import load_file

    folder = copy(saved, tmp_path / "mem")
    tensors = load_file(folder / WEIGHTS_FILE)
    k = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[k].view(-1)[0] = float("nan")
    forge(folder, tensors)
    refused(folder, f"tensor {k} holds non-finite values")


def test_an_adapter_saved_before_the_digest_loads_exactly_and_says_so(saved, tmp_path):
    """An older save_memory wrote no payload digest: the adapter still loads (shapes and
    finiteness checked), with one warning saying to save it again; its memory equals the saved
    one. A digest that is there but malformed is refused."""
    from safetensors.torch import load_file

    folder = copy(saved, tmp_path / "mem")
    edit_meta(folder, lambda m: m.pop(DIGEST_KEY))
    base = tiny_model("llama")
    with pytest.warns(UserWarning, match=f"no {DIGEST_KEY} .*save_memory again"):
        load_memory(base, folder)
    want = load_file(saved / WEIGHTS_FILE)
    got = {k: v for k, v in base.state_dict().items() if k in want}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    edit_meta(folder, lambda m: m.update({DIGEST_KEY: "abc"}))
    refused(folder, f"field {DIGEST_KEY} must be the sha256")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested more than"),
        ('{"format": NaN}', "field format holds NaN"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
    ids=["deep", "nan-token", "not-utf8"],
)
def test_load_memory_reads_the_spec_as_strict_json(text, needle, saved, tmp_path):
    folder = copy(saved, tmp_path / "mem")
    data = text.encode() if isinstance(text, str) else text
    (folder / SPEC_FILE).write_bytes(data)
    refused(folder, needle)


def test_load_memory_refuses_an_oversized_spec_before_reading_it(saved, tmp_path):
    from tngram.hf.adapter import MAX_SPEC_BYTES

    folder = copy(saved, tmp_path / "mem")
    with open(folder / SPEC_FILE, "ab") as f:
        f.truncate(MAX_SPEC_BYTES + 1)
    refused(folder, f"larger than {MAX_SPEC_BYTES:,} bytes")
