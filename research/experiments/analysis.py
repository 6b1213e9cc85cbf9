"""Analyses beyond the paper: loss on seen vs unseen n-grams, and Engram's hash collisions.

N-gram identity uses a 64-bit polynomial key, key = sum_k x_{t-k} * m_k mod 2^64 with fixed odd
random multipliers m_k; two distinct n-grams share a key with probability ~2^-64 per pair, i.e.
about 1e-6 expected false matches among 6M distinct n-grams (negligible for these statistics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tngram.common import atomic_write_json, atomic_write_text, print0

_KEY_MULT = (
    np.random.default_rng(20240520).integers(1, 2**62, size=16, dtype=np.int64).astype(np.uint64)
    * 2
    + 1
)


def ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """keys[t] identifies (x_{t-n+1}, ..., x_t); positions t < n-1 get the key of a left-padded
    window (pad = 0). tokens: (L,) -> (L,) uint64."""
    x = tokens.astype(np.uint64)
    keys = np.zeros(len(x), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            shifted = np.zeros_like(x)
            shifted[k:] = x[: len(x) - k] if k else x
            keys += shifted * _KEY_MULT[k]
    return keys


def train_split_tokens(data_dir: str) -> np.ndarray:
    from tngram.data.build import open_dataset
    from tngram.data.shards import read_shard

    info = open_dataset(data_dir)
    return np.concatenate([np.asarray(read_shard(f)) for f in info.train_files])


def per_token_losses(run_dir: str, val: torch.Tensor, seq_len: int, batch: int = 16) -> np.ndarray:
    """Cross-entropy of every target in non-overlapping windows: (n_windows * seq_len,)."""
    from tngram.train.checkpoint import load_run_model

    model, _ = load_run_model(run_dir)
    n = (len(val) - 1) // seq_len
    out = []
    with torch.no_grad():
        for i in range(0, n, batch):
            j = min(n, i + batch)
            chunk = val[i * seq_len : j * seq_len + 1].long()
            x, y = chunk[:-1].view(-1, seq_len), chunk[1:].view(-1, seq_len)
            out.append(model(x, y, reduction="none").view(-1).numpy())
    return np.concatenate(out)


def unseen_split(out: Path, rows: list[dict[str, Any]], data_dir: str) -> Path:
    """Val loss of each trained run split by whether the position's n-gram occurs in train."""
    from tngram.data.build import open_dataset
    from tngram.data.loader import load_val_tokens

    info = open_dataset(data_dir)
    cfg = json.loads((Path(rows[0]["run_dir"]) / "config.json").read_text())
    seq_len = cfg["model"]["sequence_len"]
    val = load_val_tokens(info.val_files, seq_len)
    cap = cfg["data"].get("val_tokens")
    if cap:
        val = val[: (cap // seq_len) * seq_len + 1]
    train = train_split_tokens(data_dir)
    positions = np.asarray(val[:-1].numpy())  # the input token at each scored position
    results: dict[str, Any] = {"orders": {}, "runs": {}}
    seen_by_order = {}
    for n in (2, 3, 4, 5):
        seen = np.isin(ngram_keys(positions, n), np.unique(ngram_keys(train, n)))
        seen_by_order[n] = seen
        results["orders"][n] = {"seen_fraction": float(seen.mean())}
    lines = [
        "| method | " + " | ".join(f"{n}-gram seen / unseen" for n in seen_by_order) + " |",
        "|---|" + "---|" * len(seen_by_order),
    ]
    for r in rows:
        losses = per_token_losses(r["run_dir"], val, seq_len)
        per = {
            n: {
                "seen": float(losses[s].mean()),
                "unseen": float(losses[~s].mean()) if (~s).any() else None,
            }
            for n, s in seen_by_order.items()
        }
        results["runs"][r["label"]] = {"method": r["method"], **{str(k): v for k, v in per.items()}}
        lines.append(
            f"| {r['label']} | "
            + " | ".join(
                f"{p['seen']:.3f} / {p['unseen']:.3f}"
                if p["unseen"] is not None
                else f"{p['seen']:.3f} / –"
                for p in per.values()
            )
            + " |"
        )
    frac = ", ".join(f"{n}-gram {v['seen_fraction']:.1%}" for n, v in results["orders"].items())
    body = (
        f"Validation loss (nats/token) at positions whose n-gram ending at t occurs in the "
        f"training "
        f"data (seen) or not (unseen). Seen fractions: {frac}.\n\n" + "\n".join(lines)
    )
    paired = paired_differences(rows, results["runs"], list(seen_by_order))
    if paired:
        results["tngram_minus_engram"] = paired
        from research.report.plots import fmt_pm

        npairs = len(
            {r.get("seed") for r in rows if r["method"] == "tngram"}
            & {r.get("seed") for r in rows if r["method"] == "engram"}
        )
        body += (
            "\n\nTN-gram − Engram, paired by seed (mean ± std over seeds; negative = TN-gram "
            "better):\n\n"
            "| order | seen | unseen |\n|---|---|---|\n"
            + "\n".join(
                f"| {n} | {fmt_pm(*d['seen'], npairs, '+.4f')} | "
                f"{fmt_pm(*d['unseen'], npairs, '+.4f')} |"
                for n, d in paired.items()
            )
        )
    atomic_write_json(out / "unseen.json", results)
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment unseen\n\nData: `{data_dir}`\n\n{body}\n",
    )
    print0(body)
    return out / "report.md"


def paired_differences(
    rows: list[dict[str, Any]], runs: dict[str, Any], orders: list[int]
) -> dict[str, dict[str, tuple[float, float]]]:
    """Per order: mean ± std over seeds of (TN-gram − Engram) loss on seen and on unseen positions,
    pairing the two runs of each seed (same backbone init and data order). {} without pairs."""
    from tngram.report.runs import mean_std

    by_seed: dict[Any, dict[str, str]] = {}
    for r in rows:
        by_seed.setdefault(r.get("seed"), {})[r["method"]] = r["label"]
    pairs = [
        (d["tngram"], d["engram"]) for d in by_seed.values() if "tngram" in d and "engram" in d
    ]
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for n in orders:
        diffs = {
            part: [
                runs[t][str(n)][part] - runs[e][str(n)][part]
                for t, e in pairs
                if runs[t][str(n)][part] is not None and runs[e][str(n)][part] is not None
            ]
            for part in ("seen", "unseen")
        }
        if diffs["seen"] and diffs["unseen"]:
            out[str(n)] = {part: mean_std(v) for part, v in diffs.items()}
    return out


def collision_stats(out: Path, cfg: Any, data_dir: str) -> Path:
    """Per order and head: distinct train n-grams, table size, share of n-grams in a shared
    bucket."""
    mem = cfg.model.memory
    layers = tuple(cfg.model.memory_layers)
    module = mem.build(
        d_model=cfg.model.n_embd,
        vocab_size=cfg.model.vocab_size,
        layer_id=layers[0],
        layer_ids=layers,
    )
    train = train_split_tokens(data_dir)
    ids = torch.from_numpy(train.astype(np.int64)).unsqueeze(0)
    with torch.no_grad():
        hashes = module.hash_ids(ids)[0].numpy()  # (L, (N-1)*H)
    H, N = mem.n_head_per_ngram, mem.max_ngram
    primes = mem.layer_primes(cfg.model.vocab_size, layers[0], layers)  # [[p_{n,j}] per order]
    lines = [
        "| order | distinct n-grams | mean table size/head | load (n-grams/row) | in a shared "
        "bucket (per head) "
        "| n-grams sharing the bucket (occurrence-weighted) | indistinguishable in all heads |",
        "|---|---|---|---|---|---|---|",
    ]
    stats = {}
    for n in range(2, N + 1):
        keys = ngram_keys(train, n)
        uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        per_head, crowd = [], []
        cols = hashes[first][:, (n - 2) * H : (n - 1) * H]  # (distinct, H) buckets
        for j in range(H):
            _, b_inv, counts = np.unique(cols[:, j], return_inverse=True, return_counts=True)
            per_head.append((counts[b_inv] >= 2).mean())
            crowd.append(counts[b_inv][inv].mean())  # per occurrence
        # n-grams whose whole tuple of H buckets equals another n-gram's: no head tells them apart
        _, t_inv, t_counts = np.unique(cols, axis=0, return_inverse=True, return_counts=True)
        same_all = (t_counts[t_inv.reshape(-1)] >= 2).mean()
        size = float(np.mean(primes[n - 2]))
        stats[n] = {
            "distinct": int(len(uniq)),
            "table_size": size,
            "load": len(uniq) / size,
            "shared_per_head": float(np.mean(per_head)),
            "ngrams_per_bucket": float(np.mean(crowd)),
            "indistinguishable": float(same_all),
        }
        s = stats[n]
        lines.append(
            f"| {n} | {s['distinct']:,} | {s['table_size']:,.0f} | {s['load']:.1f} | "
            f"{s['shared_per_head']:.1%} | {s['ngrams_per_bucket']:.1f} | "
            f"{s['indistinguishable']:.3%} |"
        )
    body = (
        f"Engram ({cfg.name}, layer {layers[0]}) hash tables on {len(train):,} training tokens.\n\n"
        + "\n".join(lines)
    )
    atomic_write_json(
        out / "collisions.json", {"recipe": cfg.name, "tokens": int(len(train)), "orders": stats}
    )
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment collisions\n\nData: `{data_dir}`\n\n{body}\n",
    )
    print0(body)
    return out / "report.md"


def consumed_train_tokens(cfg: Any) -> np.ndarray:
    """The training tokens a run of `cfg` (a TrainConfig, one process) reads, in order: the
    loader's stream replayed for steps × accumulation micro-batches (x and the final target)."""
    from tngram.data.build import open_dataset
    from tngram.data.loader import TokenLoader
    from tngram.train.dist import grad_accum_steps

    info = open_dataset(cfg.data.dir)
    seq_len = cfg.model.sequence_len
    accum = grad_accum_steps(cfg.data.global_batch_tokens, cfg.data.micro_batch_seqs, seq_len, 1)
    loader = TokenLoader(info.train_files, cfg.data.micro_batch_seqs, seq_len, seed=cfg.data.seed)
    parts = []
    for _ in range(cfg.schedule.steps * accum):
        x, y = loader.next_batch()
        parts.append(np.concatenate([x.numpy().reshape(-1), y.numpy().reshape(-1)[-1:]]))
    return np.concatenate(parts)


def seen_fractions(
    val: np.ndarray, train: np.ndarray, orders: tuple[int, ...] = (2, 3, 4, 5)
) -> dict[int, float]:
    """Per order n: the share of val positions t whose n-gram (x_{t-n+1..t}) occurs in `train`.
    val: (L,) input tokens at the scored positions; train: (M,) tokens."""
    return {
        n: float(np.isin(ngram_keys(val, n), np.unique(ngram_keys(train, n))).mean())
        for n in orders
    }
