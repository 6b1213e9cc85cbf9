"""Our SentencePiece BPE tokenizer (tngram.data.tokenizer) as Hugging Face tokenizer files.

`AutoTokenizer.from_pretrained(DIR)` then encodes exactly as SentencePiece does (checked against
sentencepiece on a sample of strings by the tests) and needs only the `tokenizers` package.

Why a hand-built pipeline (docs/LOG.md): transformers' ready routes differ from SentencePiece on
our spec (nmt_nfkc normalisation, no dummy prefix, whitespace collapsing, byte fallback):
LlamaTokenizer forces a Metaspace prefix, the `tokenizer.model`-only route does not collapse
whitespace, and the slow->fast SpmConverter fails on BPE in transformers 5.23. So we take the
vocabulary and merges from transformers' SentencePieceExtractor and assemble:

    normalizer     Precompiled(SentencePiece's nmt_nfkc charsmap), Strip, Replace(" {2,}" -> " ")
    pre-tokenizer  Metaspace(prepend_scheme="never")        (add_dummy_prefix False)
    model          BPE(vocab, merges, unk "<unk>", fuse_unk, byte_fallback)
    decoder        Replace("▁" -> " "), ByteFallback, Fuse
    post-processor BOS prepended (TemplateProcessing), as our data pipeline does per document

Converting needs sentencepiece and protobuf (the `hf` extra); loading needs only `tokenizers`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from tngram.common import TngramError

SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_fast_tokenizer(sp_model: str | os.PathLike):
    """A transformers PreTrainedTokenizerFast equivalent to the SentencePiece model file."""
    import sentencepiece as spm
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    path = Path(sp_model)
    if not path.is_file():
        raise TngramError(f"tokenizer model {path} does not exist")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    ids = {k: sp.piece_to_id(v) for k, v in SPECIAL.items()}
    if [sp.id_to_piece(i) for i in ids.values()] != list(SPECIAL.values()):
        raise TngramError(f"{path}: expected the special pieces {SPECIAL} (parameter-golf's spec)")
    # transformers annotates extract() as (vocab, merges), but with a model class it returns the
    # model's keyword arguments: a dict with "vocab", "merges", "_spm_precompiled_charsmap"
    ext = cast(dict[str, Any], SentencePieceExtractor(str(path)).extract(BPE))
    vocab, merges, charsmap = ext["vocab"], ext["merges"], ext["_spm_precompiled_charsmap"]
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=SPECIAL["unk"], fuse_unk=True, byte_fallback=True)
    )
    norms = [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if charsmap:
        norms.insert(0, normalizers.Precompiled(charsmap))
    tok.normalizer = normalizers.Sequence(norms)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=False
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    bos = SPECIAL["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        unk_token=SPECIAL["unk"],
        pad_token=SPECIAL["pad"],
        padding_side="left",
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
    )


def save_hf_tokenizer(sp_model: str | os.PathLike, out_dir: str | os.PathLike):
    """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map) into out_dir."""
    tok = build_fast_tokenizer(sp_model)
    tok.save_pretrained(str(out_dir))
    return tok
