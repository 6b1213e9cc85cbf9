"""SentencePiece BPE tokenizers with parameter-golf's trainer settings.

parameter-golf (`data/download_hf_docs_and_tokenize.py`) trains its `fineweb_{V}_bpe.model` with:
BPE, character_coverage 0.999, byte_fallback, split_digits, normaliser nmt_nfkc,
add_dummy_prefix False, pad/bos/eos/unk = 0/1/2/3. We use the same spec, plus input
sampling (`input_sentence_size`) so that training on tens of MB stays a few seconds.

Note the normaliser: NFKC plus whitespace collapsing, so newlines, tabs and runs of spaces
become one space and leading/trailing whitespace is dropped. Token streams (and the byte
counts used for bits-per-byte) describe the *normalised* text.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import sentencepiece as spm

from tngram.common import MissingFileError, TngramError, atomic_output

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# parameter-golf's trainer spec (data/tokenizer_specs.json + build_sentencepiece_tokenizer).
TRAINER_SPEC: dict[str, object] = {
    "model_type": "bpe",
    "character_coverage": 0.999,
    "byte_fallback": True,
    "split_digits": True,
    "normalization_rule_name": "nmt_nfkc",
    "add_dummy_prefix": False,
    "pad_id": PAD_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "unk_id": UNK_ID,
    "hard_vocab_limit": False,
}
# Our additions: speed (sampling, threads) and tolerance for long paragraphs.
SAMPLING_SPEC: dict[str, object] = {
    "num_threads": 2,
    "input_sentence_size": 1_000_000,
    "shuffle_input_sentence": True,
    "max_sentence_length": 16384,
}

__all__ = [
    "BOS_ID",
    "TRAINER_SPEC",
    "SAMPLING_SPEC",
    "train_tokenizer",
    "load_tokenizer",
    "encode_documents",
    "write_vocab_file",
]


def _lines(texts: Iterable[str | os.PathLike]) -> Iterator[str]:
    """Non-empty lines of each text; os.PathLike items are read as UTF-8 files."""
    for item in texts:
        if isinstance(item, os.PathLike):
            with open(item, encoding="utf-8", errors="replace") as f:
                for line in f:
                    line = line.strip()
                    if line:
                        yield line
        else:
            for line in str(item).splitlines():
                line = line.strip()
                if line:
                    yield line


def train_tokenizer(
    texts: Iterable[str | os.PathLike],
    out_prefix: str | os.PathLike,
    vocab_size: int = 1024,
    *,
    seed: int = 0,
    input_sentence_size: int | None = None,
) -> Path:
    """Train a SentencePiece BPE model; write `{out_prefix}.model` and `.vocab`; return the .model
    path.

    `texts` yields documents as `str` (text) or `pathlib.Path` (a UTF-8 file to read); each is
    split into lines (SentencePiece's "sentences"). Raises TngramError if the text is too
    small to reach `vocab_size` pieces. Both output files are written atomically.
    """
    if not 4 + 256 < vocab_size <= 65536:
        raise TngramError(
            f"vocab_size must be in (260, 65536] (4 specials + 256 byte pieces + merges), got "
            f"{vocab_size}"
        )
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = dict(TRAINER_SPEC)
    spec.update(SAMPLING_SPEC)
    if input_sentence_size is not None:
        spec["input_sentence_size"] = int(input_sentence_size)
    spm.set_random_generator_seed(int(seed) & 0xFFFFFFFF)  # deterministic sentence sampling

    n_lines = 0

    def counted() -> Iterator[str]:
        nonlocal n_lines
        for line in _lines(texts):
            n_lines += 1
            yield line

    writer = (
        io.BytesIO()
    )  # in memory: the model then records no (temp) model_prefix -> reproducible bytes
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counted(),
            model_writer=writer,
            vocab_size=int(vocab_size),
            minloglevel=2,
            **spec,
        )
    except RuntimeError as e:
        if "KeyboardInterrupt" in str(
            e
        ):  # Ctrl-C inside our sentence iterator, wrapped by the C++ side
            raise KeyboardInterrupt from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TngramError(
            f"SentencePiece training failed for vocab_size {vocab_size} on {n_lines} lines: {first}"
        ) from None
    proto = writer.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    if sp.vocab_size() != vocab_size:
        raise TngramError(
            f"the training text ({n_lines} lines) is too small for vocab_size {vocab_size}: "
            f"SentencePiece found only {sp.vocab_size()} pieces; use more text or a smaller "
            f"--vocab-size"
        )
    model = out_prefix.parent / (out_prefix.name + ".model")
    write_vocab_file(sp, out_prefix.parent / (out_prefix.name + ".vocab"))
    with atomic_output(model) as f:
        f.write(proto)
    return model


def write_vocab_file(sp: spm.SentencePieceProcessor, path: str | os.PathLike) -> None:
    """Write SentencePiece's human-readable `.vocab` (piece TAB score per line), atomically."""
    lines = [f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}" for i in range(sp.vocab_size())]
    with atomic_output(path) as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))


def load_tokenizer(path: str | os.PathLike) -> spm.SentencePieceProcessor:
    """Load a SentencePiece model file (ours or parameter-golf's); TngramError if unreadable."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"tokenizer {path}: file not found")
    from tngram.safefs import check_regular

    check_regular(path.resolve())  # a FIFO or device is refused, never waited on
    try:
        try:
            os.fspath(path).encode("utf-8")
        except UnicodeEncodeError:  # sentencepiece opens only UTF-8 paths: read the bytes here
            from tngram.safefs import read_bytes

            return spm.SentencePieceProcessor(model_proto=read_bytes(path, None, 64 << 20))
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise TngramError(f"tokenizer {path}: not a SentencePiece model ({e})") from None


def encode_documents(
    sp: spm.SentencePieceProcessor,
    docs: Sequence[str],
    *,
    bos: bool = True,
    num_threads: int = 2,
) -> list[list[int]]:
    """Encode each document; with `bos` (default) each is `[BOS] + ids`, the shard convention."""
    ids = sp.encode(list(docs), out_type=int, num_threads=num_threads)
    if not bos:
        return ids
    bos_id = sp.bos_id()
    if bos_id < 0:
        raise TngramError(
            "the tokenizer defines no BOS piece; shards need one (parameter-golf uses id 1)"
        )
    return [[bos_id, *d] for d in ids]
