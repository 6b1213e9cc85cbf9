"""Engram tokenizer compression P: V -> V' (as in DeepSeek's engram_demo_v1.py), built from a
SentencePiece model or a Hugging Face tokenizer (`tokenizer.json`, a `tokenizers.Tokenizer` or a
transformers `PreTrainedTokenizerFast`), as the reference builds it.

Every raw id gets a canonical key; ids with equal keys share one compressed id. New compressed ids
are handed out in first-seen order while scanning tid = 0, 1, 2, ...

    text(tid)  = the token's text (see `token_text`)
    key(tid)   = raw piece string            if text contains U+FFFD (an incomplete UTF-8 byte)
               = normalize(text)             otherwise, unless that is empty
               = text                        if normalize(text) is empty
    normalize  = NFKC -> NFD -> drop combining marks -> lowercase -> collapse [ \\t\\r\\n]+ to " "
                 -> a string that is exactly " " stays " ", anything else is stripped.

The reference builds this from a Hugging Face tokenizer with `tokenizers.normalizers`; we use
Python's `unicodedata` and `re`, written to follow the Rust semantics:

* StripAccents removes every General_Category=Mark character (Mn, Mc, Me), like the Rust crate's
  `is_combining_mark`; `unicodedata.combining() != 0` would be a different set.
* Lowercase maps char by char (Rust `char::to_lowercase`): no Greek final-sigma context, unlike
  Python's `str.lower()` on a whole string.
* Strip removes Unicode White_Space characters (Rust `char::is_whitespace`); Python's `str.strip()`
  also strips U+001C..U+001F, which Rust keeps, so we use an explicit set.
* Remaining possible differences: the Unicode version of Python's `unicodedata` vs the Rust
  crates' tables (NFKC/NFD/case mappings of characters added in newer Unicode versions).

Token text for a SentencePiece model (the analogue of HF `decode([tid],
skip_special_tokens=False)`):
control and unknown pieces use their literal piece string (`<s>`, `</s>`, `<pad>`, `<unk>`), byte
pieces `<0xNN>` decode to their single byte (a non-ASCII byte gives U+FFFD, so its key becomes
the raw piece and every such byte keeps its own id), and ordinary pieces replace the
word-boundary mark U+2581 by a space (so the lone `▁` piece is whitespace-only and maps to " ").
An ASCII byte piece has the same text as the ordinary piece for that character and therefore
shares its compressed id, as in the reference's byte-level BPE where they are one token.

Token text for a Hugging Face tokenizer is the reference's own: `decode([tid],
skip_special_tokens=False)` and, for the U+FFFD rule, `id_to_token(tid)`, over
`len(tokenizer)` ids (added tokens included). For the same vocabulary (tngram.hf.tokenizer's
conversion of a SentencePiece model) both give the same table (tests/test_hf_compression.py).

Dimension letters: V raw vocab size.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import unicodedata
from typing import Any

import torch
from torch import Tensor

from tngram.common import TngramError

REPLACEMENT_CHAR = "\ufffd"
SP_SPACE = "\u2581"  # SentencePiece's word-boundary mark
_WS_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space property = Rust char::is_whitespace (Strip normalizer).
_UNICODE_WHITESPACE = "".join(
    map(
        chr,
        [
            0x09,
            0x0A,
            0x0B,
            0x0C,
            0x0D,
            0x20,
            0x85,
            0xA0,
            0x1680,
            *range(0x2000, 0x200B),
            0x2028,
            0x2029,
            0x202F,
            0x205F,
            0x3000,
        ],
    )
)


def normalize_text(text: str) -> str:
    """The reference normalizer chain (without the empty-string fallback), see module docstring."""
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = "".join(c.lower() for c in s)
    s = _WS_RUN.sub(" ", s)
    if s == " ":  # whitespace-only tokens keep one space instead of stripping to ""
        return s
    return s.strip(_UNICODE_WHITESPACE)


def token_key(text: str, raw_piece: str) -> str:
    """Canonical key of one token: U+FFFD rule, normalisation, empty -> unnormalised text."""
    if REPLACEMENT_CHAR in text:
        return raw_piece
    key = normalize_text(text)
    return key if key else text


def token_text(sp: Any, tid: int) -> str:
    """Text of one SentencePiece id (see module docstring)."""
    piece = sp.id_to_piece(tid)
    if sp.is_control(tid) or sp.is_unknown(tid):
        return piece
    if sp.is_byte(tid):
        # pieces look like <0x41>; decode the single byte, invalid UTF-8 -> U+FFFD
        return bytes([int(piece[3:-1], 16)]).decode("utf-8", errors="replace")
    return piece.replace(SP_SPACE, " ")


def build_compression_from_keys(keys: list[str]) -> Tensor:
    """lookup[tid] = index of keys[tid] among distinct keys in first-seen order -> (V,) int64."""
    ids: dict[str, int] = {}
    lookup = [ids.setdefault(k, len(ids)) for k in keys]
    return torch.tensor(lookup, dtype=torch.int64)


def build_compression(sp: Any, vocab_size: int | None = None) -> Tensor:
    """Compression lookup table (V,) int64 from a `sentencepiece.SentencePieceProcessor`, or from
    a Hugging Face tokenizer (a `tokenizers.Tokenizer` or a transformers tokenizer with one).

    vocab_size: the model's vocabulary (defaults to the tokenizer's size). It may exceed the
    tokenizer's size (padded embedding tables); each extra id then gets its own new compressed
    id, after all tokenizer ids. It may not be smaller.
    """
    tok = getattr(sp, "backend_tokenizer", sp)  # a transformers fast tokenizer: its Tokenizer
    if hasattr(tok, "get_piece_size"):  # SentencePiece
        n = tok.get_piece_size()
        keys = [token_key(token_text(tok, tid), tok.id_to_piece(tid)) for tid in range(n)]
    elif hasattr(tok, "id_to_token"):  # tokenizers.Tokenizer: the reference's decode
        n = tok.get_vocab_size(with_added_tokens=True)
        texts = [tok.decode([tid], skip_special_tokens=False) for tid in range(n)]
        keys = [token_key(t, tok.id_to_token(tid) or "") for tid, t in enumerate(texts)]
    else:
        raise TngramError(
            f"cannot build Engram's compression from a {type(sp).__name__}: pass a "
            "SentencePieceProcessor, a tokenizers.Tokenizer or a fast transformers tokenizer"
        )
    V = n if vocab_size is None else int(vocab_size)
    if V < n:
        raise TngramError(f"the tokenizer has {n} pieces but the model vocabulary is only {V}")
    # extra ids beyond the tokenizer: unique keys that no piece can produce
    keys += [f"\x00<extra id {tid}>\x00" for tid in range(n, V)]
    return build_compression_from_keys(keys)


def compressed_vocab_size(lookup: Tensor) -> int:
    """V' = number of distinct compressed ids (lookup values are 0..V'-1)."""
    return int(lookup.max().item()) + 1 if lookup.numel() else 0


def lookup_fingerprint(lookup: Tensor) -> str:
    """sha256 of the mapping; pin it in experiment logs (a tokenizer change re-hashes
    everything)."""
    return hashlib.sha256(lookup.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


@functools.lru_cache(maxsize=8)
def _cached_compression(path: str, size: int, mtime_ns: int, vocab_size: int | None) -> Tensor:
    if path.endswith(".json"):  # a Hugging Face tokenizer.json (needs the tokenizers package)
        from tokenizers import Tokenizer

        tok: Any = Tokenizer.from_file(path)
    else:
        import sentencepiece as spm

        tok = spm.SentencePieceProcessor(model_file=path)
    # real values even while a model is built on the meta device (from_pretrained): the table
    # sizes depend on them
    with torch.device("cpu"):
        return build_compression(tok, vocab_size)


def build_compression_from_file(path: str | os.PathLike, vocab_size: int | None = None) -> Tensor:
    """`build_compression` for a tokenizer file: a SentencePiece model, a Hugging Face
    `tokenizer.json`, or a folder holding one (a tokenizer's `save_pretrained` folder); cached per
    (file, size, mtime, V)."""
    path = os.path.realpath(os.fspath(path))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise TngramError(f"tokenizer model not found: {path}")
    st = os.stat(path)
    return _cached_compression(path, st.st_size, st.st_mtime_ns, vocab_size).clone()
