"""Shared helpers for the trainer tests: a tiny synthetic dataset and tiny configs (no tests here).

The corpus is generated, not downloaded: a seeded second-order Markov chain over a fixed list of
made-up words, so it is identical on every machine, needs no network and has n-gram structure
for a model to learn. It is built once per test session with tngram.data.build.build_from_text
(SentencePiece BPE, vocab TINY_VOCAB) into pytest's temporary folder.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

TINY_VOCAB = 512
CORPUS_SEED = 20240520
N_DOCS, WORDS_PER_DOC = 48, 1200

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "vo", "an", "el", "or", "us",
              "ith", "ber", "gal", "mon", "qua", "zen")
_CACHE: dict[str, Path] = {}


def synthetic_documents(seed: int = CORPUS_SEED) -> list[str]:
    """N_DOCS documents of WORDS_PER_DOC words from a seeded second-order Markov chain."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)})
    # each (w1, w2) context prefers a few successors: learnable bigram/trigram statistics
    succ = {w: rng.sample(words, 6) for w in words}
    index = {w: i for i, w in enumerate(words)}
    docs = []
    for _ in range(N_DOCS):
        w1, w2 = rng.choice(words), rng.choice(words)
        out = [w1.capitalize(), w2]
        for _ in range(WORDS_PER_DOC - 2):
            if rng.random() < 0.85:  # the trigram context (w1, w2) picks among 3 of w2's successors
                nxt = succ[w2][(index[w1] + rng.randint(0, 2)) % len(succ[w2])]
            else:
                nxt = rng.choice(words)
            out.append(nxt + ("." if rng.random() < 0.08 else ""))
            w1, w2 = w2, nxt
        docs.append(" ".join(out))
    return docs


def build_tiny_dataset(root: Path) -> Path:
    """Write the corpus as text files and build a dataset from it (cached per process)."""
    key = str(root)
    if key in _CACHE:
        return _CACHE[key]
    from tngram.data.build import build_from_text
    text_dir = root / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(synthetic_documents()):
        (text_dir / f"doc{i:03d}.txt").write_text(doc + "\n")
    out = build_from_text([text_dir], root / "data", vocab_size=TINY_VOCAB, progress=False)
    _CACHE[key] = out
    return out


@contextmanager
def single_thread():
    """Train with 1 torch thread: on a busy 2-core machine 2 OpenMP threads can run 50x slower
    (spin-waiting), and subprocess runs use OMP_NUM_THREADS=1 too."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_dataset(tmp_path_factory.getbasetemp() / "tiny-dataset")


# The tiny model: d 32, 2 layers, seq 64, micro-batch 4, global batch 512 tokens
# (= 2 micro-steps of 4 x 64 on one process, or 1 micro-step on each of 2 processes).
TINY_SETS = [
    f"model.vocab_size={TINY_VOCAB}", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
    "model.n_kv_head=1", "model.sequence_len=64",
    "data.global_batch_tokens=512", "data.micro_batch_seqs=4", "data.val_tokens=2048",
    "schedule.steps=8", "schedule.warmdown_steps=4", "optim.muon_momentum_warmup_steps=4",
    "run.log_every=1", "run.val_every=4", "run.checkpoint_every=2", "run.keep_checkpoints=10",
    "run.dtype=fp32",
]
TNGRAM_SETS = ["model.memory.cp_rank=16", "model.memory.max_ngram=3"]
MEMORY_SETS = ["model.memory_layers=1"]   # only where there is a memory (refused on mini-raw)


def tiny_config(data_dir: Path, recipe: str = "mini-tngram", extra: list[str] | None = None):
    from tngram.train.recipes import resolve_config
    sets = TINY_SETS + (MEMORY_SETS if recipe != "mini-raw" else []) + (
        TNGRAM_SETS if recipe == "mini-tngram" else []) + list(extra or [])
    return resolve_config(recipe, sets, str(data_dir))


def cli_args(data_dir: Path, recipe: str, out: Path, extra: list[str] | None = None) -> list[str]:
    sets = TINY_SETS + (MEMORY_SETS if recipe != "mini-raw" else []) + (
        TNGRAM_SETS if recipe == "mini-tngram" else []) + list(extra or [])
    args = [recipe, "--out", str(out), "--data", str(data_dir)]
    for s in sets:
        args += ["--set", s]
    return args


def run_module(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`python -m tngram.train ARGS` in a fresh process (1 torch thread for a steady CPU)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tngram.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def weights(run_dir: Path, step: int | None = None) -> dict:
    from safetensors.torch import load_file
    if step is None:
        return load_file(str(run_dir / "model.safetensors"))
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def losses(run_dir: Path) -> dict[int, float]:
    from tngram.train.metrics import read_metrics
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir)}


__all__ = ["single_thread", "one_thread", "tiny_data", "tiny_config", "cli_args", "run_module", "weights", "losses", "replace"]
