"""`python -m research bench data`: shard reading and tokenisation throughput (tngram.data, a
colleague's).

Shard reading: synthetic uint16 shards (`tngram.data.shards.write_shard`, `tokens` tokens in 4
shards, in a temporary folder) read through `tngram.data.loader.TokenLoader.next_batch` after a
warm-up pass (page cache warm): tokens/s, median of `reps` one-second windows.
Tokenisation: the default dataset's SentencePiece model, when that dataset has been built
(`tngram data build`), encoding text decoded from its validation shard with
`tngram.data.tokenizer.encode_documents`: bytes/s and tokens/s. Parts whose modules or files are
missing are skipped with a message.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from research.bench.common import machine_info


def _read_throughput(
    tokens: int, reps: int, batch: int, seq: int, dataset: Any = None
) -> dict[str, Any]:
    try:
        from tngram.data.loader import TokenLoader
        from tngram.data.shards import read_shard, write_shard
    except ImportError as e:
        return {"skipped": f"tngram.data loader/shards not available ({e})"}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tngram-bench-") as tmp:
        files = []
        if dataset is not None:  # a real dataset's train shards (val when it has none)
            files = list(dataset.train_files or dataset.val_files)
            tokens = sum(int(np.asarray(read_shard(f)).size) for f in files)
        for i in range(4 if dataset is None else 0):
            path = Path(tmp) / f"bench_train_{i:06d}.bin"
            write_shard(path, rng.integers(0, 1024, tokens // 4, dtype=np.uint16))
            files.append(path)
        loader = TokenLoader(
            files, batch, seq, vocab_size=1024 if dataset is None else dataset.vocab_size
        )
        for _ in range(tokens // (batch * seq) + 1):  # one pass: page cache warm, shards checked
            loader.next_batch()
        rates = []
        for _ in range(reps):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                loader.next_batch()
                n += batch * seq
            rates.append(n / (time.perf_counter() - t0))
    return {
        "shards": "synthetic" if dataset is None else str(dataset.dir),
        "n_shards": len(files),
        "tokens_in_shards": tokens,
        "batch": batch,
        "seq": seq,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_max": max(rates),
    }


def _tokenise_throughput(reps: int, dataset: Any = None) -> dict[str, Any]:
    try:
        from tngram.data.build import default_data_dir, open_dataset
        from tngram.data.shards import read_shard
        from tngram.data.tokenizer import encode_documents, load_tokenizer
    except ImportError as e:
        return {"skipped": f"tngram.data build/tokenizer not available ({e})"}
    try:
        info = dataset if dataset is not None else open_dataset(default_data_dir())
    except Exception as e:  # noqa: BLE001 - any reason the dataset is not there
        return {"skipped": f"default dataset not built (run `tngram data build`): {e}"}
    sp = load_tokenizer(info.tokenizer_path)
    files = info.val_files or info.train_files
    ids = np.asarray(read_shard(files[0]))[:400_000].tolist()
    bos = sp.bos_id()
    docs: list[str] = []
    cur: list[int] = []
    for t in ids:  # split at BOS into documents, decode back to text
        if t == bos and cur:
            docs.append(sp.decode(cur))
            cur = []
        elif t != bos:
            cur.append(t)
    if cur:
        docs.append(sp.decode(cur))
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    times, n_tok = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = encode_documents(sp, docs)
        times.append(time.perf_counter() - t0)
        n_tok = sum(len(x) for x in out)
    t = statistics.median(times)
    return {
        "tokenizer": str(info.tokenizer_path),
        "documents": len(docs),
        "bytes": n_bytes,
        "tokens": n_tok,
        "bytes_per_s": n_bytes / t,
        "tokens_per_s": n_tok / t,
    }


def run(
    tokens: int = 8_000_000,
    reps: int = 5,
    batch: int = 16,
    seq: int = 256,
    dataset: str | None = None,
) -> dict[str, Any]:
    """dataset: a dataset folder to read and tokenise (None: synthetic shards, default corpus)."""
    info = None
    if dataset is not None:
        from tngram.data.build import open_dataset

        info = open_dataset(dataset)
    return {
        "benchmark": "data",
        "machine": machine_info(),
        "shard_reading": _read_throughput(tokens, reps, batch, seq, info),
        "tokenisation": _tokenise_throughput(reps, info),
    }


def report(res: dict[str, Any]) -> str:
    lines = [
        f"python -m research bench data (machine: {res['machine']['cpu']}, load "
        f"{res['machine']['loadavg']})"
    ]
    r = res["shard_reading"]
    if "skipped" in r:
        lines.append(f"shard reading: skipped: {r['skipped']}")
    else:
        lines.append(
            f"shard reading (loader batches of {r['batch']} x {r['seq']}, "
            f"{r['tokens_in_shards']:,} tokens in {r['n_shards']} {r['shards']} shard(s)): "
            f"{r['tokens_per_s_median'] / 1e6:,.1f} M tokens/s median "
            f"({r['tokens_per_s_max'] / 1e6:,.1f} best)"
        )
    t = res["tokenisation"]
    if "skipped" in t:
        lines.append(f"tokenisation: skipped: {t['skipped']}")
    else:
        lines.append(
            f"tokenisation (encode_documents, {t['documents']:,} documents, "
            f"{t['bytes'] / 1e6:.1f} MB): {t['bytes_per_s'] / 1e6:.2f} MB/s, "
            f"{t['tokens_per_s'] / 1e6:.2f} M tokens/s"
        )
    return "\n".join(lines)
