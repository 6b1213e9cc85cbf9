"""Shards (format, validation) and the streaming TokenLoader (order, DDP slicing, resume)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tngram.common import TngramError
from tngram.data.loader import TokenLoader, load_val_tokens, shard_order
from tngram.data.shards import HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, list_shards, read_shard, write_shard


def _header_bytes(magic: int, version: int, count: int) -> bytes:
    # parameter-golf's header: 256 little-endian int32, [magic, version, count, 0, ...]
    return struct.pack("<256i", magic, version, count, *([0] * 253))


# -- shards -----------------------------------------------------------------------------------


def test_constants_match_parameter_golf():
    # parameter-golf train_gpt.py load_data_shard: 256 int32 header, magic 20240520, version 1
    assert (SHARD_MAGIC, SHARD_VERSION, HEADER_INTS) == (20240520, 1, 256)


def test_shard_round_trip_and_exact_bytes(tmp_path):
    rng = np.random.default_rng(0)
    tokens = np.concatenate([[0, 65535, 1], rng.integers(0, 65536, size=997)]).astype(np.int64)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    # independent encoding of the file: header then uint16 LE payload
    assert raw == _header_bytes(20240520, 1, 1000) + tokens.astype("<u2").tobytes()
    assert len(raw) == 1024 + 2 * 1000
    back = read_shard(path)
    assert back.dtype == np.uint16 and back.shape == (1000,)
    np.testing.assert_array_equal(back, tokens)
    assert isinstance(back, np.memmap)


def test_empty_shard_round_trip(tmp_path):
    write_shard(tmp_path / "val_000000.bin", np.zeros(0, dtype=np.int64))
    assert (tmp_path / "val_000000.bin").stat().st_size == 1024
    assert read_shard(tmp_path / "val_000000.bin").shape == (0,)


@pytest.mark.parametrize("bad", [65536, -1])
def test_write_refuses_ids_outside_uint16_and_keeps_old_file(tmp_path, bad):
    path = tmp_path / "train_000000.bin"
    write_shard(path, np.array([5, 6, 7]))
    before = path.read_bytes()
    with pytest.raises(TngramError, match=str(bad)) as ei:
        write_shard(path, np.array([1, bad, 2]))
    assert str(path) in str(ei.value)
    assert path.read_bytes() == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_000000.bin"]  # no temp file left


def _write_raw(path: Path, header: bytes, payload: bytes) -> Path:
    path.write_bytes(header + payload)
    return path


@pytest.mark.parametrize(
    "case, header, payload, needle",
    [
        ("bad_magic", _header_bytes(20240521, 1, 3), b"\x01\x00" * 3, "bad magic"),
        ("bad_version", _header_bytes(20240520, 2, 3), b"\x01\x00" * 3, "version 2"),
        ("truncated", _header_bytes(20240520, 1, 3), b"\x01\x00" * 2, "truncated"),  # 2 of 3 tokens
        ("oversized", _header_bytes(20240520, 1, 3), b"\x01\x00" * 4, "oversized"),  # 4 for 3
        ("short_header", _header_bytes(20240520, 1, 3)[:500], b"", "truncated header"),
        ("negative_count", _header_bytes(20240520, 1, -3), b"", "negative"),
    ],
)
def test_corrupt_shards_give_one_clear_error(tmp_path, case, header, payload, needle):
    path = _write_raw(tmp_path / f"{case}.bin", header, payload)
    with pytest.raises(TngramError) as ei:
        read_shard(path)
    msg = str(ei.value)
    assert str(path) in msg and needle in msg
    with pytest.raises(TngramError, match=needle):  # the loader reports the same problem up front
        TokenLoader([path], 1, 1)


def test_size_error_states_expected_size(tmp_path):
    path = _write_raw(tmp_path / "t.bin", _header_bytes(20240520, 1, 10), b"\x00" * 6)
    # expected size = 1024 + 2*10 = 1044 bytes; actual = 1024 + 6 = 1030
    with pytest.raises(TngramError, match=r"1044 bytes, but it has 1030"):
        read_shard(path)


def test_token_id_out_of_vocab(tmp_path):
    path = tmp_path / "val_000000.bin"
    write_shard(path, np.array([1, 5, 1023, 1024, 7]))
    assert read_shard(path, vocab_size=1025).shape == (5,)  # max id 1024 < 1025 is fine
    with pytest.raises(TngramError) as ei:
        read_shard(path, vocab_size=1024)
    msg = str(ei.value)
    assert str(path) in msg and "1024" in msg and "token 3" in msg  # id 1024 sits at index 3
    with pytest.raises(TngramError, match="out of range"):
        TokenLoader([path], 1, 2, vocab_size=1024).next_batch()


def test_missing_shard(tmp_path):
    with pytest.raises(TngramError, match="not found"):
        read_shard(tmp_path / "nope.bin")


def test_list_shards_both_naming_schemes(tmp_path):
    for name in ["train_000001.bin", "train_000000.bin", "fineweb_train_000000.bin", "val_000000.bin",
                 "fineweb_val_000000.bin", "train_notes.bin", "train_000002.bin.tmp", "xtrain_000000.bin"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_shards(tmp_path, "train")] == [
        "fineweb_train_000000.bin", "train_000000.bin", "train_000001.bin"]
    assert [p.name for p in list_shards(tmp_path, "val")] == ["fineweb_val_000000.bin", "val_000000.bin"]
    with pytest.raises(TngramError, match="does not exist"):
        list_shards(tmp_path / "missing", "train")


# -- loader -----------------------------------------------------------------------------------

SIZES = [1000, 1, 0, 2345, 777]  # includes a 1-token and an empty shard


@pytest.fixture()
def shards(tmp_path):
    """Shards whose tokens are their global stream positions (all < 65536), so each value is unique."""
    files, start = [], 0
    for i, n in enumerate(SIZES):
        f = tmp_path / f"train_{i:06d}.bin"
        write_shard(f, np.arange(start, start + n))
        files.append(f)
        start += n
    return files


def _reference(files, order, start, B, T, W, rank, step):
    """Independent model of parameter-golf's scheme: the stream is the cyclic concatenation of the
    shards in `order` starting at `start`; call `step` takes chunk [step*W*(BT+1), +W*(BT+1)) and
    rank r its r-th slice of BT+1."""
    stream = np.concatenate([read_shard(files[i]) for i in order]).astype(np.int64)
    span = B * T + 1
    first = start + step * W * span + rank * span
    idx = np.arange(first, first + span) % stream.size
    s = stream[idx]
    return s[:-1].reshape(B, T), s[1:].reshape(B, T)


def test_seed0_is_natural_order_and_matches_reference_with_wraparound(shards):
    B, T = 3, 64  # 3*64+1 = 193 tokens per call; total 4,123 tokens -> wraps after ~21 calls
    loader = TokenLoader(shards, B, T)
    for step in range(50):
        x, y = loader.next_batch()
        rx, ry = _reference(shards, range(len(shards)), 0, B, T, 1, 0, step)
        assert x.dtype == torch.int64 and x.shape == (B, T)
        np.testing.assert_array_equal(x.numpy(), rx)
        np.testing.assert_array_equal(y.numpy(), ry)
    assert np.array_equal(_reference(shards, range(5), 0, B, T, 1, 0, 0)[0].ravel()[:5], [0, 1, 2, 3, 4])


def test_seeded_order_is_deterministic_and_differs(shards):
    counts = [read_shard(f).size for f in shards]
    order, start = shard_order(counts, 7)
    assert sorted(order) == list(range(5)) and 0 <= start < max(counts[order[0]], 1)
    assert (order, start) != (list(range(5)), 0)  # seed 7 really reorders/offsets (fixed outcome)
    a, b = TokenLoader(shards, 2, 16, seed=7), TokenLoader(shards, 2, 16, seed=7)
    for step in range(30):
        xa, _ = a.next_batch()
        xb, _ = b.next_batch()
        assert torch.equal(xa, xb)
        rx, _ = _reference(shards, order, start, 2, 16, 1, 0, step)
        np.testing.assert_array_equal(xa.numpy(), rx)


def test_ranks_are_disjoint_and_tile_the_chunk(shards):
    B, T, W = 2, 32, 3
    loaders = [TokenLoader(shards, B, T, ddp_rank=r, world_size=W) for r in range(W)]
    for step in range(10):
        seen = []
        for r, ld in enumerate(loaders):
            x, y = ld.next_batch()
            seen.append(set(x.flatten().tolist()) | set(y.flatten().tolist()))
            rx, ry = _reference(shards, range(5), 0, B, T, W, r, step)
            np.testing.assert_array_equal(x.numpy(), rx)
        for i in range(W):
            for j in range(i + 1, W):
                assert not seen[i] & seen[j]  # token values are unique stream positions


def test_one_process_accum2_equals_two_ranks_accum1(shards):
    B, T = 4, 50
    single = TokenLoader(shards, B, T, world_size=1)
    ranks = [TokenLoader(shards, B, T, ddp_rank=r, world_size=2) for r in range(2)]
    for _ in range(12):
        micro = [single.next_batch() for _ in range(2)]  # grad-accum 2 on one process
        for r in range(2):
            x, y = ranks[r].next_batch()  # one micro-step per rank
            assert torch.equal(x, micro[r][0]) and torch.equal(y, micro[r][1])


@pytest.mark.parametrize("seed, world, rank", [(0, 1, 0), (3, 2, 1)])
def test_resume_gives_exactly_the_next_batches(shards, seed, world, rank):
    run = TokenLoader(shards, 3, 40, ddp_rank=rank, world_size=world, seed=seed)
    for _ in range(17):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # it is saved as JSON
    expected = [run.next_batch() for _ in range(25)]
    resumed = TokenLoader(shards, 3, 40, ddp_rank=rank, world_size=world, seed=seed)
    resumed.load_state_dict(state)
    for ex, ey in expected:
        x, y = resumed.next_batch()
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_state_is_plain_json_and_rejects_other_data(shards, tmp_path):
    st = TokenLoader(shards, 1, 8).state_dict()
    assert all(isinstance(v, (int, list)) for v in st.values())
    other = tmp_path / "other.bin"
    write_shard(other, np.arange(10))
    with pytest.raises(TngramError, match="different data"):
        TokenLoader([other], 1, 8).load_state_dict(st)


def test_loader_argument_errors(shards):
    with pytest.raises(TngramError, match="no shard files"):
        TokenLoader([], 1, 8)
    with pytest.raises(TngramError, match="rank"):
        TokenLoader(shards, 1, 8, ddp_rank=2, world_size=2)
    with pytest.raises(TngramError, match="empty"):
        TokenLoader([shards[2]], 1, 8)  # the 0-token shard alone


def test_load_val_tokens(shards):
    T = 100
    val = load_val_tokens(shards, T)
    total = sum(SIZES)  # 4,123 tokens -> usable = floor(4122/100)*100 = 4,100 -> 4,101 returned
    assert val.shape == (4101,) and val.dtype == torch.int64
    assert torch.equal(val, torch.arange(4101))  # tokens are their positions
    assert total == 4123
    assert load_val_tokens(shards, T, dtype=torch.int32).dtype == torch.int32
    with pytest.raises(TngramError, match="too short"):
        load_val_tokens(shards[:2], 1001)  # 1,001 tokens: (1000 // 1001) * 1001 = 0 usable
