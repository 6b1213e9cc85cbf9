"""Engram's tokenizer compression from a Hugging Face tokenizer (tokenizer.json, a tokenizers
Tokenizer, a PreTrainedTokenizerFast) equals the SentencePiece path on the same vocabulary: the
SentencePiece model is converted offline to a fast tokenizer (tngram.hf.tokenizer) and the two
compression tables are compared, then two Engram layers built from each."""

from __future__ import annotations

import pytest
import torch

from tngram.memory.compression import build_compression, build_compression_from_file
from tngram.memory.engram import EngramConfig

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TEXT = [
    "The Café serves CAFÉ au lait; the cafe's naïve Naïve coffee costs 3.50 € today.",
    "Über die Brücke, über DIE brücke!  Straße   and  STRASSE\tand\ttabs.",
    "Ünïcödé ÀÉÎÕÜ àéîõü, 東京 と 大阪, emoji 🙂🙂 and 🚀, déjà vu, résumé, RÉSUMÉ.",
    "if x == 1:\n    return [a, b, c]  # comment with CamelCase and snake_case",
] * 30


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    from tngram.data.tokenizer import train_tokenizer
    from tngram.hf.tokenizer import build_fast_tokenizer

    d = tmp_path_factory.mktemp("tok")
    sp_path = train_tokenizer(TEXT, d / "sp", vocab_size=400)
    fast = build_fast_tokenizer(sp_path)
    fast.save_pretrained(d / "hf")
    return sp_path, fast, d / "hf"


def test_the_tables_are_equal(tokenizers_pair):
    sp_path, fast, hf_dir = tokenizers_pair
    sp = spm.SentencePieceProcessor(model_file=str(sp_path))
    want = build_compression(sp)
    assert len(fast) == sp.get_piece_size() == want.numel()
    for got in (
        build_compression(fast),  # a PreTrainedTokenizerFast
        build_compression(fast.backend_tokenizer),  # a tokenizers.Tokenizer
        build_compression_from_file(hf_dir),  # a save_pretrained folder
        build_compression_from_file(hf_dir / "tokenizer.json"),
    ):
        assert torch.equal(got, want)
    assert torch.equal(
        build_compression(fast, want.numel() + 3), build_compression(sp, want.numel() + 3)
    )
    # the vocabulary exercises every rule: merged keys, byte pieces under the U+FFFD rule
    assert int(want.max()) + 1 < want.numel()
    bytes_ = [
        t
        for t in range(sp.get_piece_size())
        if sp.is_byte(t) and int(sp.id_to_piece(t)[3:-1], 16) >= 0x80
    ]
    assert bytes_ and len({int(want[t]) for t in bytes_}) == len(bytes_)
    groups: dict[int, list[str]] = {}
    for t in range(sp.get_piece_size()):
        groups.setdefault(int(want[t]), []).append(sp.id_to_piece(t))
    merged = [g for g in groups.values() if len(g) > 1]
    assert any(len({p.lower() for p in g}) < len(g) for g in merged)  # case folded together


def test_engram_from_either_tokenizer_hashes_alike(tokenizers_pair):
    sp_path, _, hf_dir = tokenizers_pair
    V = 400
    layers = []
    for path in (sp_path, hf_dir):
        cfg = EngramConfig(
            max_ngram=3,
            n_head_per_ngram=2,
            n_embed_per_ngram=8,
            compress=True,
            tokenizer_path=str(path),
            pad_id=0,
        )
        layers.append(cfg.build(d_model=16, vocab_size=V))
    a, b = layers
    assert a.compression_fingerprint == b.compression_fingerprint
    assert a.compressed_vocab_size == b.compressed_vocab_size < V
    ids = torch.randint(0, V, (2, 9))
    assert torch.equal(a.hash_ids(ids), b.hash_ids(ids))
