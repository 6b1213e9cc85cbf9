"""engram-peft beside tngram.hf on one tiny offline Llama: the same base, data, steps and lr.

    pip install --target /tmp/peer --no-deps engram-peft==1.2.7 jaxtyping wadler-lindig \\
        typeguard python-dotenv
    PYTHONPATH=/tmp/peer OMP_NUM_THREADS=1 python -m research.experiments.hf_peer \\
        --out research/results/hf-peer.json
    python -m research report doc docs/HF.md        # the table in docs/HF.md

engram-peft is the PyPI package of a PEFT-style DeepSeek Engram; it is never a dependency of
tngram (install it apart, as above; on Python 3.11 `typing.override` is taken from
typing_extensions for it, since it imports the 3.12 name). Each side trains with its own
Trainer (engram-peft's EngramTrainer, tngram's MemoryTrainer) at the same learning rate, tables
at 5x (engram-peft's default `learning_rate_multiplier`), backbone frozen; tngram's Engram both
with its default table update (Trainer's AdamW) and with memory_update="sparse" (LazyAdam, as
engram-peft's SparseAdam), and again with its tables drawn N(0, 1) as DeepSeek's reference
(`table_init_std=1.0`; tngram.hf's default is the base's initializer_range, 0.02 here, which is
also engram-peft's). Measured:

- hash agreement: the fraction of (position, head) bucket ids equal to DeepSeek's reference
  hashing (engram_demo_v1.py's NgramHashMapping, re-derived in `reference_hashes`) on the same
  ids, both sides given the reference's per-head prime budget (engram-peft takes a budget per
  order and divides it by the heads: it is given budget x heads, so its primes equal the
  reference's, `primes_equal`);
- cached vs uncached: after training (the conv kernels are no longer zero), greedy decoding with
  the KV cache against one forward over the same tokens without it (max |diff| of the logits);
- resume: N steps straight against N/2, save, a fresh model resumed from the checkpoint for the
  rest (max |diff| of the trainable weights and of the last logged loss);
- eval loss after N steps on held-out sequences of the same synthetic source, and the trainable
  parameter count;
- features, each run on both sides through its public API ("not offered" where a side has no
  API for it; a check that raises is "no" with its error): two named memories on one base (add,
  switch, disable, save and load each, logits compared exactly); a few memory-only steps on a
  bitsandbytes 8-bit and 4-bit base on the CPU (the memory moves, the quantized backbone does
  not); the compression table from a PreTrainedTokenizerFast / tokenizer.json against DeepSeek's
  mapping re-derived from the tokenizer's decode; a few TRL SFTTrainer steps; the trainable
  report's backbone and memory counts against the counted parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import math
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# the tiny base: a random Llama built offline (no hub download)
BASE: dict[str, Any] = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
LAYERS = (1, 3)
MAX_NGRAM = 3
HEADS = 4
BUDGET = 499  # per-head prime budget of each order (the reference's engram_vocab_size)
EMBED = 32  # per order (tngram n_embed_per_ngram; engram-peft embedding_dim = (N-1) x this)
SEQ = 64
RULE_IDS = 32  # the ids the trigram rule of the synthetic data emits
TN_CP_RANK = 40  # TN-gram's rank: a few % fewer trainable parameters than the Engrams
TABLE_LR_MULT = 5.0  # engram-peft's default learning_rate_multiplier for its tables


# ---- DeepSeek's reference hashing (engram_demo_v1.py), re-derived -----------------------------
def reference_primes(budgets: tuple[int, ...], n_head: int, layer_ids: tuple[int, ...]):
    """{layer: [[prime per head] per order]}: per layer (in the given order), per order, each head
    takes the next prime above the previous one (the first above budget - 1) not yet taken by any
    layer (sympy.nextprime, as the reference)."""
    from sympy import nextprime

    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        out[layer] = []
        for budget in budgets:
            heads, p = [], budget - 1
            for _ in range(n_head):
                p = int(nextprime(p))
                while p in seen:
                    p = int(nextprime(p))
                seen.add(p)
                heads.append(p)
            out[layer].append(heads)
    return out


def reference_multipliers(vocab_size: int, max_ngram: int, layer_id: int, seed: int) -> np.ndarray:
    """Odd multipliers 2r+1, r ~ numpy default_rng(seed + 10007 * layer) below the no-overflow
    bound half of int64 max // vocab."""
    half = max(1, (np.iinfo(np.int64).max // vocab_size) // 2)
    r = np.random.default_rng(int(seed + 10007 * layer_id)).integers(
        0, half, size=(max_ngram,), dtype=np.int64
    )
    return r * 2 + 1


def reference_hashes(
    ids: np.ndarray,
    *,
    vocab_size: int,
    max_ngram: int,
    n_head: int,
    budgets: tuple[int, ...],
    layer_ids: tuple[int, ...],
    pad_id: int,
    seed: int = 0,
) -> dict[int, np.ndarray]:
    """{layer: (B, T, (N-1) * H)} bucket ids: for order n, (XOR_{k<n} c_{t-k} * m_k) mod p, c
    shifted right by k with pad_id before the start, heads of order 2 first."""
    x = np.asarray(ids, dtype=np.int64)
    T = x.shape[1]
    shifts = [x] + [
        np.pad(x, ((0, 0), (k, 0)), constant_values=pad_id)[:, :T] for k in range(1, max_ngram)
    ]
    primes = reference_primes(budgets, n_head, layer_ids)
    out = {}
    for layer in layer_ids:
        m = reference_multipliers(vocab_size, max_ngram, layer, seed)
        cols = []
        for n in range(2, max_ngram + 1):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
            cols += [mix % p for p in primes[layer][n - 2]]
        out[layer] = np.stack(cols, axis=-1)
    return out


def agreement(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> float:
    """The fraction of bucket ids equal to the reference's, over every layer, position and head."""
    if sorted(got) != sorted(want):
        raise ValueError(f"layers {sorted(got)} differ from the reference's {sorted(want)}")
    same = sum(int((np.asarray(got[k]) == want[k]).sum()) for k in want)
    return same / sum(want[k].size for k in want)


# ---- data: a synthetic source an n-gram memory can learn --------------------------------------
def synthetic_tokens(n_seq: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """(n_seq, seq) ids in [1, vocab): each token follows the two before it by a fixed random
    trigram rule over ids 1..RULE_IDS (seed 1234, shared by every split) 80% of the time, and is
    uniform over the whole vocabulary otherwise."""
    rule = np.random.default_rng(1234).integers(1, RULE_IDS + 1, size=(vocab, vocab))
    g = np.random.default_rng(seed)
    x = g.integers(1, vocab, size=(n_seq, seq))
    follow = g.random((n_seq, seq)) < 0.8
    for t in range(2, seq):
        x[:, t] = np.where(follow[:, t], rule[x[:, t - 2], x[:, t - 1]], x[:, t])
    return torch.from_numpy(x).long()


class Sequences(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_base(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**BASE)).eval()


# ---- the measures (any side) ------------------------------------------------------------------
def cached_gap(model: Any, prompt: torch.Tensor, new_tokens: int) -> float:
    """max |diff| between the logits of greedy decoding with the KV cache and those of one forward
    without a cache over the same tokens (prompt + generated)."""
    model.eval()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=BASE["pad_token_id"],
        )
        cached = torch.stack(out.logits, dim=1)  # (B, new, V)
        full = model(input_ids=out.sequences, use_cache=False).logits
    P = prompt.shape[1]
    uncached = full[:, P - 1 : P - 1 + new_tokens]
    return float((cached.float() - uncached.float()).abs().max())


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def n_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def eval_loss(model: nn.Module, ids: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy over the held-out sequences."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = ids[i : i + batch]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            total += float(
                nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
                )
            )
            count += x[:, 1:].numel()
    return total / count


@dataclass
class Side:
    """One implementation: `build()` a fresh model (memory on the tiny base, backbone frozen),
    `trainer(model, args, data)` its Trainer, `hashes(model, ids)` its bucket ids per layer."""

    name: str
    build: Callable[[], nn.Module]
    trainer: Callable[[nn.Module, Any, Any], Any]
    hashes: Callable[[nn.Module, torch.Tensor], dict[int, np.ndarray]] | None = None
    primes: Callable[[nn.Module], dict[int, list[int]]] | None = None


def train_args(out_dir: str, steps: int, lr: float, save_steps: int | None = None) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        learning_rate=lr,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        seed=0,
        data_seed=0,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def last_loss(trainer: Any) -> float:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]


def resume_gap(side: Side, data: Any, steps: int, lr: float, work: str) -> dict[str, float]:
    """Train `steps` straight (saving at steps/2) against a fresh model resumed from the checkpoint
    at steps/2: max |diff| of the trainable weights and of the last logged loss."""
    half = steps // 2
    a = side.build()
    ta = side.trainer(a, train_args(f"{work}/a", steps, lr, save_steps=half), data)
    ta.train()
    b = side.build()
    tb = side.trainer(b, train_args(f"{work}/a", steps, lr, save_steps=half), data)
    tb.train(resume_from_checkpoint=f"{work}/a/checkpoint-{half}")
    wa, wb = trainable_state(a), trainable_state(b)
    if sorted(wa) != sorted(wb):
        raise RuntimeError(f"{side.name}: trainable parameters differ after resume")
    return {
        "weights_max_abs_diff": max(float((wa[k] - wb[k]).abs().max()) for k in wa),
        "loss_abs_diff": abs(last_loss(ta) - last_loss(tb)),
    }


def measure(side: Side, *, steps: int, lr: float, work: str) -> dict[str, Any]:
    """Every measure of one side (module docstring)."""
    train = Sequences(synthetic_tokens(64, SEQ, BASE["vocab_size"], seed=1))
    held = synthetic_tokens(32, SEQ, BASE["vocab_size"], seed=2)
    row: dict[str, Any] = {"name": side.name}
    model = side.build()
    row["trainable_params"] = n_trainable(model)
    if side.hashes is not None:
        ids = synthetic_tokens(4, SEQ, BASE["vocab_size"], seed=3)
        want = reference_hashes(
            ids.numpy(),
            vocab_size=BASE["vocab_size"],
            max_ngram=MAX_NGRAM,
            n_head=HEADS,
            budgets=(BUDGET,) * (MAX_NGRAM - 1),
            layer_ids=LAYERS,
            pad_id=BASE["pad_token_id"],
        )
        row["hash_agreement"] = agreement(side.hashes(model, ids), want)
    if side.primes is not None:
        ref = reference_primes((BUDGET,) * (MAX_NGRAM - 1), HEADS, LAYERS)
        flat = {k: [p for order in v for p in order] for k, v in ref.items()}
        row["primes_equal"] = side.primes(model) == flat
    row["eval_loss_start"] = eval_loss(model, held)
    trainer = side.trainer(model, train_args(f"{work}/train", steps, lr), train)
    trainer.train()
    row["train_loss_last"] = last_loss(trainer)
    row["eval_loss"] = eval_loss(model, held)
    row["conv_max_abs"] = max(
        (
            float(p.detach().abs().max())
            for n, p in model.named_parameters()
            if n.endswith("conv.weight")
        ),
        default=0.0,
    )
    prompt = synthetic_tokens(2, 12, BASE["vocab_size"], seed=4)
    row["cached_vs_uncached_max_abs_diff"] = cached_gap(model, prompt, new_tokens=16)
    row["resume"] = resume_gap(side, train, steps, lr, f"{work}/resume")
    return row


# ---- tngram.hf --------------------------------------------------------------------------------
def tngram_engram_config() -> Any:
    from tngram.memory.engram import EngramConfig

    return EngramConfig(
        max_ngram=MAX_NGRAM,
        n_head_per_ngram=HEADS,
        n_embed_per_ngram=EMBED,
        table_budget=(BUDGET,) * (MAX_NGRAM - 1),
        pad_id=BASE["pad_token_id"],
    )


def tngram_side(
    name: str,
    config_fn: Callable[[], Any],
    lr: float,
    memory_update: str = "dense",
) -> Side:
    """tngram.hf's side: the memory `config_fn()` at LAYERS, the backbone frozen."""
    from tngram.hf import MemoryTrainer, add_memory, memory_modules

    def build() -> nn.Module:
        return add_memory(tiny_base(), config_fn(), layers=LAYERS, trainable="memory")

    def trainer(model: nn.Module, args: Any, data: Any) -> Any:
        return MemoryTrainer(
            model=model,
            args=args,
            train_dataset=data,
            memory_table_lr=lr * TABLE_LR_MULT,
            memory_update=memory_update,
        )

    def by_layer(model: nn.Module) -> dict[int, Any]:
        return {m.layer_id: m for m in memory_modules(model).values()}

    def hashes(model: Any, ids: torch.Tensor) -> dict[int, np.ndarray]:
        return {k: m.hash_ids(ids).numpy() for k, m in by_layer(model).items()}

    def primes(model: Any) -> dict[int, list[int]]:
        return {k: m.primes.tolist() for k, m in by_layer(model).items()}

    engram = config_fn().kind == "engram"
    return Side(name, build, trainer, hashes if engram else None, primes if engram else None)


# ---- engram-peft ------------------------------------------------------------------------------
def import_peer() -> Any:
    """engram_peft, importable on Python 3.11 (it imports typing.override, a 3.12 name)."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    try:
        import engram_peft
    except ImportError as e:
        raise SystemExit(
            f"engram-peft is not importable ({e}); install it apart from tngram: pip install "
            "--target /tmp/peer --no-deps engram-peft==1.2.7 jaxtyping wadler-lindig typeguard "
            "python-dotenv, then run with PYTHONPATH=/tmp/peer"
        ) from None
    return engram_peft


def peer_model(base_fn: Callable[[], nn.Module]) -> Any:
    """engram-peft's Engram at the comparison's shapes on the base `base_fn()` builds, backbone
    frozen; its layers draw from torch's RNG as it stands after the base is built under seed 0."""
    ep = import_peer()
    cfg = ep.EngramConfig(
        ngram_sizes=list(range(2, MAX_NGRAM + 1)),
        max_ngram_size=MAX_NGRAM,
        n_head_per_ngram=HEADS,
        engram_vocab_size_per_ngram=[BUDGET * HEADS] * (MAX_NGRAM - 1),
        embedding_dim=EMBED * (MAX_NGRAM - 1),
        target_layers=list(LAYERS),
        hc_mult=1,
        enable_tokenizer_compression=False,
        learning_rate_multiplier=TABLE_LR_MULT,
    )
    torch.manual_seed(0)
    return ep.get_engram_model(base_fn(), cfg, train_mode="engram_only")


def peer_side(lr: float) -> Side:
    ep = import_peer()

    def build() -> nn.Module:
        return peer_model(tiny_base)

    def trainer(model: nn.Module, args: Any, data: Any) -> Any:
        return ep.EngramTrainer(model=model, args=args, train_dataset=data)

    def hashes(model: Any, ids: torch.Tensor) -> dict[int, np.ndarray]:
        return {int(k): v for k, v in model.hash_mapping.hash(ids.numpy()).items()}

    def primes(model: Any) -> dict[int, list[int]]:
        return {
            int(k): [p for order in v for p in order]
            for k, v in model.hash_mapping.prime_tables.items()
        }

    return Side("engram-peft", build, trainer, hashes, primes)


# ---- features: each checked by running it on both sides -------------------------------------
# A check returns {"result": "yes" | "no" | "not offered" | "skipped", "checked": what ran, ...
# its numbers}; a check that raises is "no" with the error (`feature`).
FEATURE_STEPS = 4  # training steps of the quantized-base and SFTTrainer checks
TEXT = [
    "The Café serves CAFÉ au lait; the cafe's naïve Naïve coffee costs 3.50 € today.",
    "Über die Brücke, über DIE brücke!  Straße   and  STRASSE\tand\ttabs.",
    "Ünïcödé ÀÉÎÕÜ àéîõü, 東京 と 大阪, emoji 🙂 and 🚀, déjà vu, résumé, RÉSUMÉ, ﬁle, file.",
] * 40


def feature(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one check; an exception is the answer "no", with its first line."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - any failure of the other side's API is a "no"
        return {"result": "no", "error": f"{type(e).__name__}: {str(e).splitlines()[0]:.200}"}


def yes_if(ok: bool, checked: str, **numbers: Any) -> dict[str, Any]:
    return {"result": "yes" if ok else "no", "checked": checked, **numbers}


def logits(model: Any, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits.float()


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def randomize(params: Any, seed: int) -> None:
    """Draw every memory parameter N(0, 0.1^2): a memory that changes the logits (both sides'
    inits zero a projection, so a fresh memory is a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


NAMED_CHECK = (
    "two memories added under two names on one base differ; switching back gives the first's "
    "logits exactly; disabling gives the base's; each saved, then loaded onto a fresh base, gives "
    "its logits exactly"
)


def named_result(la, lb, back, off, plain, re_a, re_b) -> dict[str, Any]:
    ok = gap(la, lb) > 1e-3 and gap(back, la) == 0 and gap(off, plain) == 0
    ok = ok and gap(re_a, la) == 0 and gap(re_b, lb) == 0
    return yes_if(
        ok,
        NAMED_CHECK,
        a_vs_b=gap(la, lb),
        switch_back=gap(back, la),
        disabled_vs_base=gap(off, plain),
        reload_a=gap(re_a, la),
        reload_b=gap(re_b, lb),
    )


def word_tokenizer() -> Any:
    """A word-level PreTrainedTokenizerFast over the tiny base's ids: <pad> 0, <eos> 1, w2 .."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(2, BASE["vocab_size"])]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def sft_data() -> Any:
    from datasets import Dataset

    ids = synthetic_tokens(16, 24, BASE["vocab_size"], seed=5)
    texts = [" ".join(f"w{int(i)}" if i > 1 else "w2" for i in row) for row in ids]
    return Dataset.from_list([{"text": t} for t in texts])


def sft_config(out_dir: str) -> Any:
    from trl import SFTConfig

    return SFTConfig(
        output_dir=out_dir,
        max_steps=FEATURE_STEPS,
        learning_rate=3e-3,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        seed=0,
    )


def moved(before: dict[str, torch.Tensor], model: nn.Module, memory: Callable[[str], bool]):
    """(the memory tensors that changed / all of them, the backbone tensors that changed)."""
    now = dict(model.named_parameters())
    mem = [n for n in before if memory(n)]
    changed = {n for n in before if not torch.equal(now[n], before[n])}
    return len(changed & set(mem)), len(mem), sorted(changed - set(mem))


def training_result(before, model, memory, losses, what: str) -> dict[str, Any]:
    n_moved, n_mem, backbone = moved(before, model, memory)
    ok = n_moved == n_mem > 0 and not backbone and all(math.isfinite(v) for v in losses)
    return yes_if(
        ok,
        what,
        memory_tensors_moved=f"{n_moved}/{n_mem}",
        backbone_tensors_moved=len(backbone),
        losses=losses,
    )


def quantized_base(work: str, bits: int) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = f"{work}/base-{bits}"
    if not Path(path).exists():
        base: Any = tiny_base()
        base.save_pretrained(path)
    q = BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu")


SFT_CHECK = "every memory tensor changes, no backbone tensor does, the losses are finite"
QUANT_CHECK = (
    "{steps} steps of the memory alone on a bitsandbytes {bits}-bit base on the CPU: every "
    "memory tensor changes, no backbone tensor (the quantized weights) does, the losses are finite"
)


def quantized_steps(trainer_cls: Any, model: Any, work: str, bits: int, memory: Any) -> dict:
    """FEATURE_STEPS steps of `trainer_cls` (each side's memory trainer) on the quantized `model`,
    judged by training_result against QUANT_CHECK."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = train_args(f"{work}/q{bits}", FEATURE_STEPS, 3e-3)
    data = Sequences(synthetic_tokens(8, 32, 257, 1))
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    what = QUANT_CHECK.format(steps=FEATURE_STEPS, bits=bits)
    return training_result(before, model, memory, losses, what)


def expected_compression(tok: Any) -> list[int]:
    """DeepSeek's compression (engram_demo_v1.py's CompressedTokenizer), re-derived with
    unicodedata: key = the decoded token under NFKC, NFD, accents stripped, lower case, runs of
    whitespace as one space and stripped (a lone space kept); the raw token where decoding gives
    U+FFFD, the decoded text where the key is empty; ids numbered by first key."""
    import re
    import unicodedata

    keys: dict[str, int] = {}
    out = []
    for tid in range(len(tok)):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = str(tok.convert_ids_to_tokens(tid))
        else:
            s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
            s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
            s = re.sub(r"[ \t\r\n]+", " ", s)
            key = (s if s == " " else s.strip()) or text
        out.append(keys.setdefault(key, len(keys)))
    return out


def compression_tokenizer(work: str) -> tuple[Any, Path, Path]:
    """A SentencePiece model trained on TEXT (case, accents, ligatures, byte pieces), converted
    to a PreTrainedTokenizerFast saved as a folder with tokenizer.json: (fast, sp model, folder)."""
    from tngram.data.tokenizer import train_tokenizer
    from tngram.hf.tokenizer import build_fast_tokenizer

    sp_path = train_tokenizer(TEXT, f"{work}/sp", vocab_size=400)
    fast = build_fast_tokenizer(sp_path)
    fast.save_pretrained(f"{work}/hf-tokenizer")
    return fast, Path(sp_path), Path(f"{work}/hf-tokenizer")


COMPRESSION_CHECK = (
    "the compression table built from a PreTrainedTokenizerFast (and from its tokenizer.json) "
    "equals DeepSeek's mapping re-derived from the tokenizer's decode"
)
TRAINABLE_CHECK = (
    "the printed report's backbone and memory counts equal the counted parameters, with the "
    "memory and one backbone tensor (the final norm) trainable"
)


def report_numbers(line: str) -> list[int]:
    import re

    counts = line.split("trainable%")[0]  # the counts, before the percentage
    return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", counts)]


class TngramFeatures:
    """The feature checks on tngram.hf's side (its Engram at the comparison's shapes)."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.x = synthetic_tokens(2, 16, BASE["vocab_size"], seed=6)

    @staticmethod
    def mem_params(model: nn.Module) -> list[torch.Tensor]:
        from tngram.hf import memory_modules

        return [p for m in memory_modules(model).values() for p in m.parameters()]

    @staticmethod
    def is_mem(name: str) -> bool:
        return "ngram_memory" in name.split(".")

    def named(self) -> dict[str, Any]:
        from tngram.hf import add_memory, disable_memory, load_memory, save_memory, set_memory

        cfg = tngram_engram_config()
        model = tiny_base()
        plain = logits(model, self.x)
        add_memory(model, cfg, layers=LAYERS, trainable="memory", name="a")
        randomize(self.mem_params(model), 1)
        la = logits(model, self.x)
        add_memory(model, cfg, layers=LAYERS, trainable="memory", name="b")
        randomize(self.mem_params(model), 2)
        lb = logits(model, self.x)
        save_memory(model, f"{self.work}/named-b")
        set_memory(model, "a")
        back = logits(model, self.x)
        with disable_memory(model):
            off = logits(model, self.x)
        save_memory(model, f"{self.work}/named-a")
        fresh = load_memory(tiny_base(), f"{self.work}/named-a", name="a")
        re_a = logits(fresh, self.x)
        load_memory(fresh, f"{self.work}/named-b", name="b")
        return named_result(la, lb, back, off, plain, re_a, logits(fresh, self.x))

    def quantized(self, bits: int) -> dict[str, Any]:
        from tngram.hf import MemoryTrainer, add_memory

        model = quantized_base(self.work, bits)
        add_memory(model, tngram_engram_config(), layers=LAYERS, trainable="memory")
        return quantized_steps(MemoryTrainer, model, self.work, bits, self.is_mem)

    def compression(self) -> dict[str, Any]:
        import sentencepiece as spm

        from tngram.memory.compression import build_compression, build_compression_from_file

        fast, sp_path, folder = compression_tokenizer(self.work)
        want = torch.tensor(expected_compression(fast))
        sp = build_compression(spm.SentencePieceProcessor(model_file=str(sp_path)))
        got = [build_compression(fast), build_compression_from_file(folder / "tokenizer.json")]
        return yes_if(
            all(torch.equal(g, want) for g in got) and torch.equal(sp, got[0]),
            COMPRESSION_CHECK + "; tngram's also equals its SentencePiece path on the same model",
            vocab=len(fast),
            compressed=int(want.max()) + 1,
            ids_equal=float((got[0] == want).float().mean()),
            equals_sentencepiece_path=bool(torch.equal(sp, got[0])),
        )

    def sft(self) -> dict[str, Any]:
        from trl import SFTTrainer

        from tngram.hf import add_memory, memory_optimizer

        model = add_memory(tiny_base(), tngram_engram_config(), layers=LAYERS, trainable="memory")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = sft_config(f"{self.work}/sft")
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=sft_data(),
            processing_class=word_tokenizer(),
            optimizers=(memory_optimizer(model, args, table_lr=3e-3 * TABLE_LR_MULT), None),
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        what = f"TRL SFTTrainer, {FEATURE_STEPS} steps on text: " + SFT_CHECK
        return training_result(before, model, self.is_mem, losses, what)

    def trainable(self) -> dict[str, Any]:
        from tngram.hf import add_memory, print_trainable_parameters

        model = add_memory(tiny_base(), tngram_engram_config(), layers=LAYERS, trainable="memory")
        model.model.norm.weight.requires_grad_(True)
        with contextlib.redirect_stdout(io.StringIO()):
            line = print_trainable_parameters(model)
        mem = sum(p.numel() for p in self.mem_params(model))
        total = sum(p.numel() for p in model.parameters())
        norm = model.model.norm.weight.numel()
        # "trainable params: T || memory params: M (trainable Mt) || all params: A || ..."
        t, m, mt, a = report_numbers(line)
        ok = (t - mt, mt, a - m, m) == (norm, mem, total - mem, mem)
        return yes_if(ok, TRAINABLE_CHECK + " (backbone = all − memory)", report=line)


def bnb_guard(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return {"result": "skipped", "checked": "bitsandbytes is not installed"}
    return feature(check)


def trl_guard(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return {"result": "skipped", "checked": "trl is not installed"}
    return feature(check)


class PeerFeatures:
    """The same checks through engram-peft's public API, where it offers the feature."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.x = synthetic_tokens(2, 16, BASE["vocab_size"], seed=6)
        self.ep = import_peer()

    @staticmethod
    def is_mem(name: str) -> bool:
        return name.startswith("adapters.")

    def named(self) -> dict[str, Any]:
        plain = logits(tiny_base(), self.x)
        model = peer_model(tiny_base)
        randomize(model.adapters["default"].parameters(), 1)
        la = logits(model, self.x)
        model.add_adapter("b", copy.deepcopy(model.peft_config["default"]))
        model.set_adapter("b")
        randomize(model.adapters["b"].parameters(), 2)
        lb = logits(model, self.x)
        model.save_pretrained_engram(f"{self.work}/named-b")
        model.set_adapter("default")
        back = logits(model, self.x)
        model.unload_engram()  # its disable: the hooks go (load_engram puts them back)
        off = logits(model, self.x)
        model.load_engram()
        model.save_pretrained_engram(f"{self.work}/named-a")
        fresh = self.ep.EngramModel.from_pretrained(tiny_base(), f"{self.work}/named-a")
        re_a = logits(fresh, self.x)
        fresh.add_adapter("b", copy.deepcopy(fresh.peft_config["default"]))
        fresh.set_adapter("b")
        fresh.load_engram(f"{self.work}/named-b")
        return named_result(la, lb, back, off, plain, re_a, logits(fresh, self.x))

    def quantized(self, bits: int) -> dict[str, Any]:
        model = peer_model(lambda: quantized_base(self.work, bits))
        return quantized_steps(self.ep.EngramTrainer, model, self.work, bits, self.is_mem)

    def compression(self) -> dict[str, Any]:
        from engram_peft.compression import CompressedTokenizer

        fast, _, folder = compression_tokenizer(self.work)
        want = torch.tensor(expected_compression(fast))
        got = [CompressedTokenizer(tokenizer=fast).lookup, CompressedTokenizer(str(folder)).lookup]
        n = min(len(want), len(got[0]))
        return yes_if(
            all(torch.equal(g, want) for g in got),
            COMPRESSION_CHECK,
            vocab=len(fast),
            table_length=len(got[0]),
            compressed=int(want.max()) + 1,
            ids_equal=float((got[0][:n] == want[:n]).float().mean()),
        )

    def sft(self) -> dict[str, Any]:
        model = peer_model(tiny_base)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = self.ep.create_engram_sft_trainer(
                model, word_tokenizer(), sft_data(), args=sft_config(f"{self.work}/sft")
            )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        what = f"TRL SFTTrainer (create_engram_sft_trainer), {FEATURE_STEPS} steps on text: "
        return training_result(before, model, self.is_mem, losses, what + SFT_CHECK)

    def trainable(self) -> dict[str, Any]:
        model = peer_model(tiny_base)
        model.base_model.model.norm.weight.requires_grad_(True)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            model.print_trainable_parameters()
        line = out.getvalue().strip()
        mem = sum(p.numel() for p in model.adapters.parameters())
        total = sum(p.numel() for p in model.parameters())
        norm = model.base_model.model.norm.weight.numel()
        # "trainable params: T (backbone: B, engram: E) || all params: A || trainable%: ..."
        t, b, e, a = report_numbers(line)
        ok = (t, b, e, a) == (norm + mem, norm, mem, total)
        return yes_if(ok, TRAINABLE_CHECK, report=line)


def features(checks: Any) -> dict[str, dict[str, Any]]:
    """Every feature check of one side (TngramFeatures or PeerFeatures)."""
    return {
        "named": feature(checks.named),
        "quantized_8bit": bnb_guard(lambda: checks.quantized(8)),
        "quantized_4bit": bnb_guard(lambda: checks.quantized(4)),
        "hf_tokenizer_compression": feature(checks.compression),
        "trl_sft": trl_guard(checks.sft),
        "trainable_split": feature(checks.trainable),
    }


# ---- the results file -------------------------------------------------------------------------
def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    pkgs = ("engram-peft", "transformers", "peft", "torch", "tngram", "trl", "bitsandbytes")
    for pkg in pkgs:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    import os

    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU, {platform.system()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )


def run(steps: int, lr: float, peer: bool = True) -> dict[str, Any]:
    from tngram.memory.tngram import TNGramConfig

    sides = [tngram_side("tngram Engram", tngram_engram_config, lr)]
    # the tables' optimiser of engram-peft (SparseAdam: Adam on the rows a batch reads)
    sides.append(tngram_side("tngram Engram, sparse", tngram_engram_config, lr, "sparse"))
    # DeepSeek's reference table init, N(0, 1) (tngram.hf's default: the base's initializer_range)
    reference_init = lambda: replace(tngram_engram_config(), table_init_std=1.0)
    sides.append(tngram_side("tngram Engram, tables N(0, 1)", reference_init, lr))
    tn_config = functools.partial(TNGramConfig, max_ngram=MAX_NGRAM, cp_rank=TN_CP_RANK)
    sides.append(tngram_side("tngram TN-gram", tn_config, lr))
    if peer:
        sides.insert(0, peer_side(lr))
    prompt = synthetic_tokens(2, 12, BASE["vocab_size"], seed=4)
    base_gap = cached_gap(tiny_base(), prompt, new_tokens=16)  # the base alone, for scale
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, side in enumerate(sides):
            print(f"[hf-peer] {side.name} ...", file=sys.stderr, flush=True)
            rows.append(measure(side, steps=steps, lr=lr, work=f"{work}/{i}"))
        print("[hf-peer] features ...", file=sys.stderr, flush=True)
        feats = {"tngram.hf": features(TngramFeatures(f"{work}/features-tngram"))}
        if peer:
            feats = {"engram-peft": features(PeerFeatures(f"{work}/features-peer")), **feats}
    return {
        "kind": "hf-peer",
        "base": {**BASE, "layers": list(LAYERS), "seq": SEQ},
        "memory": {
            "max_ngram": MAX_NGRAM,
            "heads": HEADS,
            "budget": BUDGET,
            "embed": EMBED,
            "tn_cp_rank": TN_CP_RANK,
        },
        "steps": steps,
        "learning_rate": lr,
        "table_lr_multiplier": TABLE_LR_MULT,
        "feature_steps": FEATURE_STEPS,
        "base_cached_vs_uncached_max_abs_diff": base_gap,
        "versions": versions(),
        "sides": rows,
        "features": feats,
    }


def main(argv: list[str] | None = None) -> int:
    from tngram.common import atomic_write_text

    p = argparse.ArgumentParser(prog="python -m research.experiments.hf_peer", description=__doc__)
    p.add_argument("--steps", type=int, default=60, help="training steps (even; default 60)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (tables: 5x)")
    p.add_argument("--out", type=Path, default=None, help="write the results file here")
    args = p.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        p.error(f"--steps must be an even number >= 2, got {args.steps}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} exists; remove it or name another file")
    res = run(args.steps, args.lr)
    cmd = "python -m research.experiments.hf_peer " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    res = {
        "kind": res.pop("kind"),
        "command": "PYTHONPATH=/tmp/peer OMP_NUM_THREADS=1 " + cmd.strip(),
        "commit": commit(),
        "machine": machine(),
        **res,
    }
    text = json.dumps(res, indent=2) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
