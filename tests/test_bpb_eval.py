"""evaluate_bpb: uniform model gives log2(V) * tokens / bytes; 2 ranks == 1 rank; token caps."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_train_support import one_thread, tiny_data  # noqa: F401
from tngram.eval.bpb import evaluate_bpb


class Uniform(nn.Module):
    """Zero logits: every target costs ln V nats."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x, y, reduction="mean"):
        logits = torch.zeros(y.numel(), self.vocab) + 0 * self.dummy
        return F.cross_entropy(logits, y.reshape(-1), reduction=reduction)


def dataset_parts(tiny_data):
    from tngram.data.bpb import token_byte_luts
    from tngram.data.build import open_dataset
    from tngram.data.loader import load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    info = open_dataset(tiny_data)
    sp = load_tokenizer(info.tokenizer_path)
    return sp, load_val_tokens(info.val_files, 64), token_byte_luts(sp, info.vocab_size), info.vocab_size


def bytes_by_hand(sp, prev: list[int], tgt: list[int]) -> int:
    """parameter-golf's bits-per-byte rule, written as a plain loop over SentencePiece pieces."""
    def special(i):
        return sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
    total = 0
    for p, t in zip(prev, tgt):
        if special(t):
            continue
        if sp.is_byte(t):
            total += 1
            continue
        piece = sp.id_to_piece(t)
        if piece.startswith("\u2581"):
            piece = piece[1:]
            total += 0 if special(p) else 1
        total += len(piece.encode("utf-8"))
    return total


def test_uniform_model_gives_log2_vocab_times_tokens_per_byte(tiny_data):
    sp, val, luts, V = dataset_parts(tiny_data)
    r = evaluate_bpb(Uniform(V), val, 64, luts, batch_seqs=5)
    n = (val.numel() - 1) // 64 * 64
    assert r["tokens"] == n
    assert r["bytes"] == bytes_by_hand(sp, val[:n].tolist(), val[1:n + 1].tolist())
    # CE of zero logits is ln V computed in fp32 (relative error < 1e-7), summed in fp64
    assert r["val_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert r["val_bpb"] == pytest.approx(math.log2(V) * r["tokens"] / r["bytes"], rel=1e-6)


def test_max_tokens_caps_whole_windows(tiny_data):
    _, val, luts, V = dataset_parts(tiny_data)
    r = evaluate_bpb(Uniform(V), val, 64, luts, batch_seqs=3, max_tokens=1000)
    assert r["tokens"] == 960  # 15 whole windows of 64 fit in 1000 targets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(ddp_rank: int, world_size: int, port: int, tiny_data, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=ddp_rank,
                            world_size=world_size)
    try:
        _, val, luts, V = dataset_parts(tiny_data)
        model = _tiny_gpt(V)
        r = evaluate_bpb(model, val, 64, luts, batch_seqs=4, ddp_rank=ddp_rank, world_size=world_size)
        out[ddp_rank] = r
    finally:
        dist.destroy_process_group()


def _tiny_gpt(V: int):
    from tngram.model.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, sequence_len=64,
                          tied_embed_init_std=0.5))  # a large init: far from uniform predictions
    return model


@pytest.mark.dist
def test_two_ranks_equal_one_rank(tiny_data):
    import torch.multiprocessing as mp
    _, val, luts, V = dataset_parts(tiny_data)
    one = evaluate_bpb(_tiny_gpt(V), val, 64, luts, batch_seqs=4)
    assert abs(one["val_loss"] - math.log(V)) > 0.05   # a non-trivial model
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(2, _free_port(), tiny_data, out), nprocs=2, join=True)
        results = dict(out)
    for r in results.values():  # every rank gets the all-reduced totals
        assert r["tokens"] == one["tokens"] and r["bytes"] == one["bytes"]
        # fp64 sums of the same per-token fp32 losses in a different grouping: ~1e-15 relative
        assert r["val_loss"] == pytest.approx(one["val_loss"], rel=1e-12)
        assert r["val_bpb"] == pytest.approx(one["val_bpb"], rel=1e-12)
