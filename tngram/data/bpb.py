"""Bytes per token and bits per byte, exactly as parameter-golf's `eval_val` counts them.

For a target token `t` preceded by input token `p` the byte count is
``base_bytes[t] + (has_leading_space[t] and not is_boundary[p])``, where
  * control / unknown / unused pieces (pad, BOS, EOS, unk) are boundaries with 0 bytes,
  * byte-fallback pieces (``<0x41>``) are 1 byte,
  * ordinary pieces are the UTF-8 length of the piece with one leading ``▁`` removed; that
    ``▁`` is one space byte, counted only if the previous token is not a boundary (the space
    right after BOS is free, matching the normaliser that drops leading whitespace).
Summed over ``[BOS] + encode(text)`` this gives the UTF-8 length of the normalised text.
bpb = Σ nats / (ln 2 · Σ bytes).
"""

from __future__ import annotations

import math

import sentencepiece as spm
import torch
from torch import Tensor

from tngram.common import TngramError

SPACE_MARK = "\u2581"  # "▁", SentencePiece's whitespace symbol

__all__ = ["token_byte_luts", "target_bytes", "bpb_from_sums"]


def token_byte_luts(
    sp: spm.SentencePieceProcessor, vocab_size: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(base_bytes int16 (V,), has_leading_space bool (V,), is_boundary bool (V,)).

    V = max(sp.vocab_size(), vocab_size): ids beyond the tokenizer (a padded model vocabulary)
    are boundaries with 0 bytes, as in parameter-golf.
    """
    n = sp.vocab_size()
    table = max(n, vocab_size or 0)
    base = torch.zeros(table, dtype=torch.int16)
    lead = torch.zeros(table, dtype=torch.bool)
    boundary = torch.ones(table, dtype=torch.bool)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue  # boundary, 0 bytes
        boundary[i] = False
        if sp.is_byte(i):
            base[i] = 1
            continue
        piece = sp.id_to_piece(i)
        if piece.startswith(SPACE_MARK):
            lead[i] = True
            piece = piece[1:]
        base[i] = len(piece.encode("utf-8"))
    return base, lead, boundary


def target_bytes(prev_ids: Tensor, tgt_ids: Tensor, luts: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Bytes each target token covers, int64, same shape as `tgt_ids` (e.g. (B, T)).

    `prev_ids[i]` is the token before `tgt_ids[i]` (the model input at that position).
    """
    base, lead, boundary = luts
    if prev_ids.shape != tgt_ids.shape:
        raise TngramError(
            f"prev_ids {tuple(prev_ids.shape)} and tgt_ids {tuple(tgt_ids.shape)} must have the "
            f"same shape"
        )
    base, lead, boundary = (
        base.to(tgt_ids.device),
        lead.to(tgt_ids.device),
        boundary.to(tgt_ids.device),
    )
    tgt = tgt_ids.long()
    prev = prev_ids.long()
    extra = lead[tgt] & ~boundary[prev]  # (…,) bool: a "▁" that is a real space
    return base[tgt].long() + extra.long()


def bpb_from_sums(sum_nats: float, n_bytes: int) -> float:
    """Bits per byte from summed cross-entropy (nats) and summed byte counts."""
    if n_bytes <= 0:
        raise TngramError(f"bits-per-byte needs a positive byte count, got {n_bytes}")
    return float(sum_nats) / (math.log(2.0) * float(n_bytes))
