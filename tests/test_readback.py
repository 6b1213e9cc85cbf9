"""The one checked reader of files tngram reads back (tngram.readback, docs/RELIABILITY.md "Every
file read back"): JSON records and safetensors files, each failure one BadRecordError naming the
file and the field; JSON is written strict."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tngram.common import TngramError, atomic_write_json, json_text
from tngram.readback import BadRecordError, load_json
from tngram.readback.tensors import check_finite_module, read_safetensors


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"a": {"b": [1, NaN]}}', "field a.b[1] holds NaN"),
        ('{"lr": Infinity}', "field lr holds Infinity"),
        ('{"lr": -Infinity}', "field lr holds -Infinity"),
        ('{"lr": 1e999}', "field lr holds 1e999"),  # overflows to inf in Python's parser
        ('{"a": ' * 100 + "1" + "}" * 100, "nested more than 64 levels"),
        ("[" * 100_000 + "]" * 100_000, "nested more than 64 levels"),
        ('{"a": 1', "corrupt or truncated JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_json_records_are_strict(text, needle, tmp_path):
    f = tmp_path / "r.json"
    f.write_text(text)
    with pytest.raises(BadRecordError) as e:
        load_json(f)
    assert str(e.value).startswith(f"{f}: ") and needle in str(e.value), e.value


def test_json_that_is_not_utf8_or_too_large_is_refused_before_parsing(tmp_path):
    f = tmp_path / "r.json"
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(BadRecordError, match="not UTF-8"):
        load_json(f)
    with open(f, "wb") as out:  # a sparse 1 GiB file: refused by its size, never read
        out.truncate(1 << 30)
    with pytest.raises(TngramError, match="larger than 1,048,576 bytes"):
        load_json(f, limit=1 << 20)


def test_json_is_written_strict(tmp_path):
    """NaN and infinities are written as null (strict JSON any parser reads back)."""
    obj = {"loss": float("nan"), "rows": [1.5, float("inf")], "ok": 2}
    assert json.loads(json_text(obj)) == {"loss": None, "rows": [1.5, None], "ok": 2}
    atomic_write_json(tmp_path / "s.json", obj)
    assert load_json(tmp_path / "s.json") == {"loss": None, "rows": [1.5, None], "ok": 2}


@pytest.fixture
def weights(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}, f)
    return f


def _payload_start(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def test_an_untouched_tensor_file_reads_with_its_digest(weights):
    data = weights.read_bytes()
    digest = hashlib.sha256(data[_payload_start(data) :]).hexdigest()
    tensors, _ = read_safetensors(weights, shapes={"a": (2, 3), "b": (4,)}, digest=digest)
    assert torch.equal(tensors["a"], torch.arange(6.0).view(2, 3))


def _header_of(data: bytes) -> dict:
    return json.loads(data[8 : _payload_start(data)])


def _with_header(data: bytes, header: dict) -> bytes:
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data[_payload_start(data) :]


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: d[:-4], "payload bytes, the header lists 40: truncated"),
        (lambda d: d + b"\0" * 8, "8 bytes after the tensors its header lists: oversized"),
        (lambda d: d[:5], "not even a header"),
        (lambda d: (10**9).to_bytes(8, "little") + d[8:], "-byte header in a"),
        (
            lambda d: _with_header(
                d, {**_header_of(d), "a": {**_header_of(d)["a"], "shape": [3, 3]}}
            ),
            "tensor 'a' has a corrupt header entry",
        ),
        (
            lambda d: _with_header(d, {**_header_of(d), "__metadata__": {"x": 1}}),
            "__metadata__ must map strings to strings",
        ),
        (lambda d: d.replace(b'"F32"', b"NaN  ", 1), "field a.dtype holds NaN"),
    ],
    ids=["truncated", "oversized", "tiny", "huge-header", "shape-vs-offsets", "metadata", "nan"],
)
def test_a_damaged_tensor_file_is_one_line_naming_it(damage, needle, weights):
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(BadRecordError) as e:
        read_safetensors(weights)
    assert str(e.value).startswith(str(weights)) and needle in str(e.value), e.value


def test_names_and_shapes_are_checked_before_any_tensor_is_read(weights):
    with pytest.raises(BadRecordError, match=r"tensor a has shape \(2, 3\), the model needs"):
        read_safetensors(weights, shapes={"a": (3, 2), "b": (4,)})
    with pytest.raises(BadRecordError, match=r"missing \['c'\], unexpected \['b'\]"):
        read_safetensors(weights, shapes={"a": (2, 3), "c": (4,)})


def test_a_payload_other_than_the_recorded_one_is_refused(weights):
    with pytest.raises(BadRecordError, match="does not match its recorded sha256"):
        read_safetensors(weights, digest="0" * 64)


def test_non_finite_tensors_are_refused_by_name(weights):
    save_file({"a": torch.tensor([1.0, float("inf")]), "i": torch.tensor([7])}, weights)
    with pytest.raises(BadRecordError, match="tensor a holds non-finite values"):
        read_safetensors(weights)
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(BadRecordError, match="non-finite values in bias"):
        check_finite_module(model, "m")


def test_a_link_is_never_followed_even_to_a_valid_file(weights, tmp_path):
    link = tmp_path / "link.safetensors"
    link.symlink_to(weights)
    with pytest.raises(TngramError, match="symbolic link"):
        read_safetensors(link)
    os.mkfifo(tmp_path / "fifo")  # never opened for reading: no reader blocked for ever
    with pytest.raises(TngramError, match="a FIFO, not a regular file"):
        read_safetensors(tmp_path / "fifo")
