"""Streaming, memory-mapped token loader with parameter-golf's DDP slicing and exact resume.

The shards (in a seed-determined order) form one endless stream that wraps around. Every
`next_batch()` call consumes ONE contiguous chunk of ``world_size * (B*T + 1)`` tokens from that
stream; rank r takes the r-th slice of ``B*T + 1`` tokens and returns ``x = slice[:-1]``,
``y = slice[1:]`` as (B, T). All ranks keep the same stream position, so:

  * ranks see disjoint tokens within a step;
  * 1 process doing 2 accumulation micro-steps sees exactly the data that 2 ranks see in one
    step (micro-step i == rank i), like parameter-golf's ``DistributedTokenLoader``;
  * ``state_dict()`` is a few ints, and a resumed loader yields exactly the next batches.

Sequences cut across document boundaries (BOS appears mid-sequence), as in parameter-golf.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from tngram.common import TngramError
from tngram.data.shards import check_vocab, read_shard, read_shard_header

STATE_VERSION = 1

__all__ = ["DeviceBatches", "TokenLoader", "load_val_tokens", "shard_order"]


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def shard_order(counts: Sequence[int], seed: int) -> tuple[list[int], int]:
    """(order of shard indices, start offset in the first shard) for `seed`.

    seed 0 is the natural order from token 0 (parameter-golf's behaviour). Other seeds sort the
    shards by a SHA-256 key and start at a hashed offset, so the result is stable across
    Python/NumPy versions and machines.
    """
    n = len(counts)
    if seed == 0:
        return list(range(n)), 0
    order = sorted(range(n), key=lambda i: _hash_int(f"tngram-loader:{seed}:shard:{i}"))
    first = counts[order[0]]
    start = _hash_int(f"tngram-loader:{seed}:start") % first if first > 0 else 0
    return order, start


class TokenLoader:
    """Per-rank batches (x, y), each int64 (batch_size, seq_len), from uint16 shards.

    `vocab_size`, if given, is checked against every shard the first time it is read.
    x and y are views of one (B*T+1,) buffer (y is x shifted by one), freshly allocated per call.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        batch_size: int,
        seq_len: int,
        ddp_rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        self.files = [Path(f) for f in files]
        if not self.files:
            raise TngramError(
                "TokenLoader: no shard files given (is the dataset's train split empty?)"
            )
        if batch_size <= 0 or seq_len <= 0:
            raise TngramError(
                f"TokenLoader: batch_size and seq_len must be positive, got {batch_size}, {seq_len}"
            )
        if world_size <= 0 or not 0 <= ddp_rank < world_size:
            raise TngramError(
                f"TokenLoader: need 0 <= ddp_rank < world_size, got rank {ddp_rank} of {world_size}"
            )
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.ddp_rank = int(ddp_rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self.counts = [read_shard_header(f) for f in self.files]  # validates every header up front
        if sum(self.counts) == 0:
            raise TngramError(f"TokenLoader: all {len(self.files)} shards are empty")
        self._tokens: dict[int, np.ndarray] = {}  # shard index -> memmap, opened lazily
        self.order, start = shard_order(self.counts, self.seed)
        self._k = 0  # index into self.order
        self._pos = start  # token offset inside shard self.order[self._k]
        self.batches = 0
        self._normalise()

    # -- stream mechanics -------------------------------------------------------------------
    def _shard(self, i: int) -> np.ndarray:
        tok = self._tokens.get(i)
        if tok is None:
            tok = read_shard(self.files[i])
            if tok.size != self.counts[i]:
                raise TngramError(
                    f"shard {self.files[i]}: changed on disk while the loader was running"
                )
            if self.vocab_size is not None:
                check_vocab(tok, self.vocab_size, self.files[i])
            self._tokens[i] = tok
        return tok

    def _normalise(self) -> None:
        """Move (k, pos) off the end of exhausted/empty shards."""
        while self._pos >= self.counts[self.order[self._k]]:
            self._pos -= self.counts[self.order[self._k]]
            self._k = (self._k + 1) % len(self.order)

    def _walk(self, k: int, pos: int, n: int, out: np.ndarray | None) -> tuple[int, int]:
        """From stream position (k, pos) step over n tokens, copying them into `out` if given."""
        done = 0
        while done < n:
            i = self.order[k]
            avail = self.counts[i] - pos
            if avail <= 0:
                k, pos = (k + 1) % len(self.order), 0
                continue
            take = min(avail, n - done)
            if out is not None:
                out[done : done + take] = self._shard(i)[pos : pos + take]  # uint16 -> int64 copy
            done += take
            pos += take
        return k, pos

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(x, y), int64 (batch_size, seq_len) each, for this rank; advances the shared stream."""
        span = self.batch_size * self.seq_len + 1
        k, pos = self._walk(self._k, self._pos, self.ddp_rank * span, None)  # skip lower ranks
        buf = np.empty(span, dtype=np.int64)  # (B*T+1,)
        self._walk(k, pos, span, buf)
        self._k, self._pos = self._walk(self._k, self._pos, self.world_size * span, None)
        self._normalise()
        self.batches += 1
        t = torch.from_numpy(buf)
        x = t[:-1].view(self.batch_size, self.seq_len)  # (B, T)
        y = t[1:].view(self.batch_size, self.seq_len)  # (B, T)
        return x, y

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Stream position as plain ints/lists (JSON-safe). Independent of rank and batch shape."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "counts": list(self.counts),
            "order": list(self.order),
            "shard": self._k,
            "pos": self._pos,
            "batches": self.batches,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict()`; the next batches are exactly those that
        the saved loader would have produced next. TngramError if the shards differ."""
        if d.get("version") != STATE_VERSION:
            raise TngramError(
                f"loader state has version {d.get('version')!r}, expected {STATE_VERSION}"
            )
        counts = [int(c) for c in d.get("counts", [])]
        if counts != self.counts:
            raise TngramError(
                f"loader state was saved for {len(counts)} shards with token counts "
                f"{counts[:4]}..., but this loader has {len(self.counts)} shards with "
                f"{self.counts[:4]}...: different data"
            )
        order = [int(i) for i in d["order"]]
        if sorted(order) != list(range(len(self.counts))):
            raise TngramError(f"loader state has an invalid shard order {order}")
        k, pos = int(d["shard"]), int(d["pos"])
        if not 0 <= k < len(order) or not 0 <= pos < self.counts[order[k]]:
            raise TngramError(f"loader state position (shard {k}, token {pos}) is out of range")
        self.seed = int(d.get("seed", self.seed))
        self.order, self._k, self._pos = order, k, pos
        self.batches = int(d.get("batches", 0))


class DeviceBatches:
    """A TokenLoader's batches on `device`. On CUDA each batch goes through pinned host memory
    with a non_blocking copy (a copy from pageable memory makes the host wait for the GPU), and
    the next batch is read and sent as soon as the current one is handed out (one ahead), as
    parameter-golf's loader sends its batches non_blocking. Elsewhere (`ahead` False) this is
    the loader itself plus `.to(device)`, batch for batch.

    `state_dict()` is the loader's position BEFORE the batch held ahead, so a checkpoint resumes
    at the first batch not yet trained on; `load_state_dict()` drops the held batch.
    """

    def __init__(
        self,
        loader: TokenLoader,
        device: torch.device,
        pin: bool | None = None,
        ahead: bool | None = None,
    ) -> None:
        cuda = device.type == "cuda"
        self.loader, self.device = loader, device
        self.pin = cuda if pin is None else pin
        self.ahead = cuda if ahead is None else ahead
        self._held: tuple[dict[str, Any], Tensor, Tensor] | None = None

    def _fetch(self) -> tuple[dict[str, Any], Tensor, Tensor]:
        state = self.loader.state_dict() if self.ahead else {}
        x, y = self.loader.next_batch()
        n = x.numel()
        buf = x.reshape(-1).as_strided((n + 1,), (1,))  # (B*T+1,): x and y are views of it
        if self.pin:
            buf = buf.pin_memory()
        buf = buf.to(self.device, non_blocking=self.pin)  # one copy for x and y
        return state, buf[:n].view_as(x), buf[1:].view_as(y)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(x, y) on the device, int64 (batch_size, seq_len) each; the next one is sent ahead."""
        if not self.ahead:
            return self._fetch()[1:]
        current = self._held if self._held is not None else self._fetch()
        self._held = self._fetch()
        return current[1], current[2]

    def state_dict(self) -> dict[str, Any]:
        """The loader's position before any batch held ahead (TokenLoader.state_dict)."""
        return dict(self._held[0]) if self._held is not None else self.loader.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._held = None
        self.loader.load_state_dict(d)


def load_val_tokens(
    files: Sequence[str | os.PathLike],
    seq_len: int,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.int64,
) -> Tensor:
    """All val shards concatenated, truncated to k*seq_len + 1 tokens (k maximal), shape
    (k*seq_len+1,).

    As in parameter-golf: windows are val[i*T : (i+1)*T + 1]. int64 by default (8 bytes/token;
    pass dtype=torch.int32 to halve memory for FineWeb's 62 M val tokens).
    """
    files = [Path(f) for f in files]
    if not files:
        raise TngramError("no validation shards given")
    parts = [read_shard(f, vocab_size) for f in files]
    total = sum(p.size for p in parts)
    usable = ((total - 1) // seq_len) * seq_len
    if usable <= 0:
        raise TngramError(f"validation split has {total} tokens: too short for seq_len {seq_len}")
    out = np.empty(usable + 1, dtype=np.int64)  # (k*T+1,)
    done = 0
    for p in parts:
        take = min(p.size, usable + 1 - done)
        out[done : done + take] = p[:take]
        done += take
        if done == usable + 1:
            break
    t = torch.from_numpy(out)
    return t if dtype == torch.int64 else t.to(dtype)
