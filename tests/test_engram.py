"""Engram module and tokenizer compression (DeepSeek's engram_demo_v1.py; paper App. D).

"§9" marks numbers computed with DeepSeek's reference code (engram_demo_v1.py). Everything else is
checked against slow, independently written Python computations.
"""

from __future__ import annotations

import functools
import io
import math
import os
import random

import pytest
import torch

from tngram.common import TngramError
from tngram.memory.compression import (build_compression, build_compression_from_file,
                                       compressed_vocab_size, normalize_text, token_key)
from tngram.memory.engram import Engram, EngramConfig
from tngram.memory.gating import GatedFusion
from tngram.memory.hashing import hash_multipliers

SP1024 = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures", "parameter-golf",
                      "fineweb_1024_bpe.model")


# ---------------------------------------------------------------- helpers
def python_rows(ids: list[int], mult: list[int], primes: list[list[int]], pad: int) -> list[list[int]]:
    """Slow reference: table rows per position = (XOR_k c_{t-k} m_k) mod p_{n,j} + offset."""
    flat = [p for h in primes for p in h]
    offs = [sum(flat[:i]) for i in range(len(flat))]
    out = []
    for t in range(len(ids)):
        ctx = [ids[t - k] if t >= k else pad for k in range(len(mult))]
        z = []
        for n, heads in enumerate(primes, start=2):
            mix = functools.reduce(lambda a, b: a ^ b, [ctx[k] * mult[k] for k in range(n)])
            z += [mix % p for p in heads]
        out.append([a + b for a, b in zip(z, offs)])
    return out


def small_cfg(**kw) -> EngramConfig:
    base = dict(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=8, table_budget=(37, 23),
                kernel_size=3, pad_id=0)
    base.update(kw)
    return EngramConfig(**base)


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.fixture(scope="module")
def tiny_sp_path(tmp_path_factory):
    """A tiny BPE SentencePiece model (byte fallback) trained on text built to need compression."""
    spm = pytest.importorskip("sentencepiece")
    words = ["the", "The", "THE", "other", "mother", "café", "cafe", "Café", "naïve", "naive",
             "then", "bathe"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    lines += ["tab\there  spaced\ttext", "ΑΣ σ ς", "日本語のテキスト"] * 5
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=340, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2, num_threads=1, hard_vocab_limit=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(buf.getvalue())
    return str(path)


def load_sp(path: str):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=path)


# ---------------------------------------------------------------- normaliser (§1)
@pytest.mark.parametrize("text,key", [
    (" Apple", "apple"), ("APPLE", "apple"), ("apple ", "apple"),   # case + strip (§1)
    ("á", "a"), ("ä", "a"), ("Café", "cafe"),                         # StripAccents after NFD
    ("\ufb01", "fi"),                                                 # NFKC ligature fi
    ("  ", " "), ("\t\n", " "), ("\u3000", " "),                     # whitespace-only -> one space
    ("a \t b", "a b"),                                                # runs collapse
    ("\u0915\u0903", "\u0915"),      # Devanagari visarga is Mc (a Mark with combining class 0)
    ("\u0391\u03a3", "\u03b1\u03c3"),  # per-char lowercase: no final sigma (str.lower gives ας)
    ("\x1c", "\x1c"),                # U+001C is not White_Space in Rust; str.strip() would eat it
    ("\x0b", ""),                    # U+000B is White_Space and not in [ \t\r\n]: stripped to ""
])
def test_normalize_text(text, key):
    assert normalize_text(text) == key


def test_token_key_rules():
    assert token_key("\ufffd", "<0xFB>") == "<0xFB>"    # incomplete UTF-8 -> raw piece
    assert token_key("\x0b", "<0x0B>") == "\x0b"        # empty after normalising -> raw text
    assert token_key(" The", "\u2581The") == "the"


# ---------------------------------------------------------------- compression tables (§1)
def test_compression_tiny_model(tiny_sp_path):
    sp = load_sp(tiny_sp_path)
    V = sp.get_piece_size()
    pid = {sp.id_to_piece(i): i for i in range(V)}
    lk = build_compression(sp)
    assert lk.dtype == torch.int64 and lk.shape == (V,)
    same = lambda *ps: len({int(lk[pid[p]]) for p in ps}) == 1  # noqa: E731
    assert same("\u2581the", "the", "\u2581The", "\u2581THE")                 # ' the' == 'the'
    assert same("\u2581cafe", "\u2581café", "\u2581Café")                      # accents, case
    assert same("\u2581naive", "\u2581naïve")
    assert same("\u2581", "\t", "<0x20>", "<0x09>", "<0x0A>")                 # whitespace -> ' '
    assert same("é", "e", "<0x65>", "<0x45>", "E")                            # ASCII byte = char
    assert same("ΑΣ") and not same("\u2581ς", "\u2581σ") and same("Σ", "σ", "\u2581σ")
    # specials keep their own ids, and so does every non-ASCII byte (U+FFFD rule)
    distinct = ["<pad>", "<s>", "</s>", "<unk>"] + [f"<0x{b:02X}>" for b in range(0x80, 0x100)]
    ids = [int(lk[pid[p]]) for p in distinct]
    assert len(set(ids)) == len(ids)
    assert all((lk == i).sum() == 1 for i in ids)
    # first-seen order: scanning tid = 0, 1, ... a new compressed id is always max-so-far + 1
    seen = -1
    for t in range(V):
        assert int(lk[t]) <= seen + 1
        seen = max(seen, int(lk[t]))
    assert compressed_vocab_size(lk) == seen + 1 == len(set(lk.tolist())) < V
    # extra model-vocab ids beyond the tokenizer get fresh ids after all tokenizer ids
    lk2 = build_compression(sp, V + 3)
    assert lk2[:V].tolist() == lk.tolist() and lk2[V:].tolist() == [seen + 1, seen + 2, seen + 3]
    with pytest.raises(TngramError):
        build_compression(sp, V - 1)


def test_compression_official_sp1024():
    if not os.path.isfile(SP1024):
        pytest.skip(f"parameter-golf tokenizer fixture not found at {SP1024}")
    sp = load_sp(SP1024)
    lk = build_compression_from_file(SP1024)
    P = [sp.id_to_piece(i) for i in range(1024)]
    # independent grouping for pieces made of ASCII letters (and the word mark): drop the mark,
    # lowercase. Within those pieces the compression must induce exactly this partition.
    letters = [i for i, p in enumerate(P)
               if p.replace("\u2581", "") and p.replace("\u2581", "").isascii()
               and p.replace("\u2581", "").isalpha()]
    simple = {i: P[i].replace("\u2581", "").lower() for i in letters}
    comp = {i: int(lk[i]) for i in letters}
    for i in letters:
        for j in letters:
            assert (simple[i] == simple[j]) == (comp[i] == comp[j]), (P[i], P[j])
    assert len({int(lk[i]) for i in (267, 352, 896)}) == 1    # '▁the', '▁The', 'The' (README ids)
    assert int(lk[939]) == int(lk[4 + 0x20])                    # lone '▁' == byte <0x20> (' ')
    assert len(set(lk[:4].tolist())) == 4                       # pad, BOS, EOS, unk stay apart
    hi = lk[4 + 0x80: 4 + 0x100].tolist()                       # byte pieces 0x80..0xFF
    assert len(set(hi)) == 128 and not set(hi) & set(lk[:4 + 0x80].tolist() + lk[260:].tolist())
    assert compressed_vocab_size(lk) < 1024


# ---------------------------------------------------------------- Engram hash ids (§9)
def test_engram_tiny_vector():
    # §9 tiny case: V'=1000 (raw, no compression), layer 0 of [0, 1], N=3, H=2, budget [1000, 500]
    cfg = EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=4,
                       table_budget=(1000, 500), pad_id=0)
    m = cfg.build(d_model=8, vocab_size=1000, layer_id=0, layer_ids=(0, 1))
    ids = torch.tensor([[5, 7, 9, 7]])
    assert m.hash_ids(ids).tolist() == [[[915, 68, 428, 430], [690, 892, 290, 330],
                                         [10, 369, 341, 134], [69, 283, 209, 383]]]
    assert m.offsets.tolist() == [0, 1009, 2022, 2525] and m.n_rows == 3034
    assert m.row_ids(ids).tolist() == [[[915, 1077, 2450, 2955], [690, 1901, 2312, 2855],
                                        [10, 1378, 2363, 2659], [69, 1292, 2231, 2908]]]


def test_engram_demo_size_vector():
    # §9 demo-size case: V'=99,092, layer 1 of [1, 15], budget 646,400 x 2, pad 2, H=8.
    # E=8 keeps the 10.3M-row table small (Dh = 1).
    cfg = EngramConfig(max_ngram=3, n_head_per_ngram=8, n_embed_per_ngram=8,
                       table_budget=(646400, 646400), pad_id=2)
    m = cfg.build(d_model=8, vocab_size=99_092, layer_id=1, layer_ids=(1, 15))
    assert m.n_rows == 10_344_164                                        # §9 rows, layer 1
    rows = m.row_ids(torch.tensor([[10, 20, 30, 20, 10]]))[0]
    z0 = (rows[0] - m.offsets).tolist()
    assert z0 == [472003, 417235, 28334, 123300, 169017, 54085, 384429, 68972,
                  243852, 270327, 439470, 340552, 603003, 528884, 278505, 22005]   # §9
    assert rows[4].tolist() == [330716, 1212696, 1371429, 2354709, 2978868, 3451387, 4444559,
                                4714576, 5498746, 6147065, 6854070, 7577782, 8329265, 8558645,
                                9392706, 9955187]                                   # §9


def test_engram_rows_match_python_reference_random():
    cfg = small_cfg(max_ngram=4, n_head_per_ngram=3, n_embed_per_ngram=6, table_budget=(50, 9, 31),
                    pad_id=5, seed=3)
    m = cfg.build(d_model=12, vocab_size=77, layer_id=4, layer_ids=(2, 4))
    rng = random.Random(0)
    seqs = [[rng.randrange(77) for _ in range(11)] for _ in range(2)]
    mult = hash_multipliers(77, 4, 4, seed=3).tolist()
    primes = m.primes.view(3, 3).tolist()
    assert m.row_ids(torch.tensor(seqs)).tolist() == [python_rows(s, mult, primes, 5) for s in seqs]
    # memory_vector = the rows' table entries concatenated in (order, head) order
    e = m.memory_vector(torch.tensor(seqs))
    W = m.table.weight
    want = torch.stack([torch.stack([torch.cat([W[r] for r in pos]) for pos in
                                     python_rows(s, mult, primes, 5)]) for s in seqs])
    assert e.shape == (2, 11, 18) and torch.equal(e, want)


def test_engram_compress_uses_compressed_ids_pad_and_vocab(tiny_sp_path):
    sp = load_sp(tiny_sp_path)
    V = sp.get_piece_size()
    lk = build_compression(sp)
    Vc = compressed_vocab_size(lk)
    pid = {sp.id_to_piece(i): i for i in range(V)}
    pad = pid["E"]                      # a raw pad id whose compressed id differs (same as <0x45>)
    pad_c = int(lk[pad])
    assert pad_c != pad
    cfg = small_cfg(compress=True, tokenizer_path=tiny_sp_path, pad_id=pad)
    m = cfg.build(d_model=8, vocab_size=V, layer_id=1, layer_ids=(1,))
    assert m.compressed_vocab_size == Vc and m.pad_id_compressed == pad_c
    rng = random.Random(1)
    raw = [rng.randrange(V) for _ in range(9)]
    comp = [int(lk[i]) for i in raw]
    mult = hash_multipliers(Vc, 3, 1).tolist()                           # multipliers use V'
    primes = m.primes.view(2, 2).tolist()
    assert m.row_ids(torch.tensor([raw])).tolist() == [python_rows(comp, mult, primes, pad_c)]
    # two raw ids with the same key are indistinguishable to the memory
    a = torch.tensor([[pid["\u2581the"], pid["\u2581cafe"]]])
    b = torch.tensor([[pid["\u2581THE"], pid["\u2581Café"]]])
    assert torch.equal(m.memory_vector(a), m.memory_vector(b))


# ---------------------------------------------------------------- parameter counts (§4, §9)
def test_param_count_demo_config_matches_reference():
    # §9 demo: d=1024, V=129,280, M=4, k=4, E=512, H=8, budget 646,400, layers [1, 15]
    cfg = EngramConfig(max_ngram=3, n_head_per_ngram=8, n_embed_per_ngram=512,
                       table_budget=(646400, 646400), hc_mult=4, kernel_size=4)
    assert cfg.param_count(d_model=1024, vocab_size=129_280, layer_id=1, layer_ids=(1, 15)) == 667_303_168      # §9
    assert cfg.param_count(d_model=1024, vocab_size=129_280, layer_id=15, layer_ids=(1, 15)) == 667_564_160     # §9


def test_param_count_paper_l9_engram():
    """Paper 9-layer recipe: d 512, V 1024, N 5, 8 heads, E 512, budget 5V, layers (1, 7), kernel 3.

    Independent derivation: with one budget (5120) for every order, the 64 primes are the 64
    consecutive primes > 5119, layer 1 takes the first 32 and layer 7 the next 32. Per layer the
    dense part is K and V: 2 * (2048*512 + 512), gate norms 2*512, conv norm 512, conv 512*3.
    """
    primes, p = [], 5120
    while len(primes) < 64:
        if all(p % q for q in range(2, math.isqrt(p) + 1)):
            primes.append(p)
        p += 1
    dense = 2 * (2048 * 512 + 512) + 2 * 512 + 512 + 512 * 3
    want = {1: 64 * sum(primes[:32]) + dense, 7: 64 * sum(primes[32:]) + dense}
    cfg = EngramConfig(max_ngram=5, n_head_per_ngram=8, n_embed_per_ngram=512, kernel_size=3)
    got = {layer: cfg.param_count(d_model=512, vocab_size=1024, layer_id=layer, layer_ids=(1, 7)) for layer in (1, 7)}
    assert got == want
    total = got[1] + got[7]
    assert total == 26_428_288                    # the number reported for paper-l9-engram
    assert abs(total - 26e6) <= 0.05 * 26e6       # paper Table: Engram +26M
    built = n_params(cfg.build(d_model=512, vocab_size=1024, layer_id=1, layer_ids=(1, 7)))
    assert built == got[1]


@pytest.mark.parametrize("kw", [dict(), dict(hc_mult=3, kv_bias=False), dict(n_embed_per_ngram=None),
                                dict(max_ngram=2, table_budget=(11,), kernel_size=1)])
def test_param_count_equals_module(kw):
    cfg = small_cfg(**kw)
    m = cfg.build(d_model=16, vocab_size=40, layer_id=3, layer_ids=(0, 3))
    assert n_params(m) == cfg.param_count(d_model=16, vocab_size=40, layer_id=3, layer_ids=(0, 3))


# ---------------------------------------------------------------- forward behaviour
def test_forward_shapes_zero_init_and_shared_fusion():
    m = small_cfg().build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))
    assert isinstance(m.fusion, GatedFusion)
    assert m.fusion.conv.dilation == 3 and m.fusion.conv.kernel_size == 3     # dilation None -> N
    ids = torch.randint(0, 40, (2, 7))
    y = m(torch.randn(2, 7, 16), ids)
    assert y.shape == (2, 7, 16) and torch.count_nonzero(y) == 0             # zero value -> no-op
    m4 = small_cfg(hc_mult=2, zero_init_value=False).build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))
    h = torch.randn(2, 7, 2, 16)
    y4 = m4(h, ids)
    assert y4.shape == (2, 7, 2, 16)
    assert torch.allclose(y4, m4.fusion(h, m4.memory_vector(ids)))


@pytest.mark.parametrize("hc", [1, 2])
def test_engram_causal(hc):
    torch.manual_seed(0)
    cfg = small_cfg(zero_init_value=False, zero_init_conv=False, hc_mult=hc, max_ngram=4,
                    table_budget=(13, 17, 19))
    m = cfg.build(d_model=16, vocab_size=30, layer_id=0, layer_ids=(0,))
    B, T = 2, 12
    shape = (B, T, 16) if hc == 1 else (B, T, hc, 16)
    ids, h = torch.randint(0, 30, (B, T)), torch.randn(shape)
    y = m(h, ids)
    for t in (0, 4, 10):
        ids2, h2 = ids.clone(), h.clone()
        ids2[:, t + 1:] = (ids2[:, t + 1:] + 1 + torch.randint(0, 28, (B, T - t - 1))) % 30
        h2[:, t + 1:] = torch.randn_like(h2[:, t + 1:])
        y2 = m(h2, ids2)
        assert torch.equal(y[:, : t + 1], y2[:, : t + 1])
        assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])   # the change is visible later


def test_gradients_reach_exactly_the_used_rows():
    torch.manual_seed(1)
    cfg = small_cfg(zero_init_value=False, zero_init_conv=False, table_budget=(41, 29), pad_id=3)
    m = cfg.build(d_model=16, vocab_size=50, layer_id=0, layer_ids=(0,))
    ids = torch.randint(0, 50, (2, 6))
    (m(torch.randn(2, 6, 16), ids) ** 2).sum().backward()
    mult = hash_multipliers(50, 3, 0).tolist()
    primes = m.primes.view(2, 2).tolist()
    used = {r for s in ids.tolist() for pos in python_rows(s, mult, primes, 3) for r in pos}
    nonzero = set(torch.nonzero(m.table.weight.grad.abs().sum(1)).flatten().tolist())
    assert nonzero == used and len(used) < m.n_rows
    for name, p in m.fusion.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# ---------------------------------------------------------------- errors and config
def test_engram_errors():
    m = small_cfg().build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))
    with pytest.raises(TngramError, match="vocabulary"):
        m(torch.zeros(1, 3, 16), torch.tensor([[0, 40, 1]]))
    with pytest.raises(TngramError, match="vocabulary"):
        m.hash_ids(torch.tensor([[0, -1, 1]]))
    with pytest.raises(TngramError, match="shape"):
        m(torch.zeros(1, 4, 16), torch.tensor([[0, 1, 2]]))
    with pytest.raises(TngramError, match="max_ngram"):
        EngramConfig(max_ngram=1)
    with pytest.raises(TngramError, match="multiple of n_head_per_ngram"):
        EngramConfig(n_embed_per_ngram=12, n_head_per_ngram=8)
    with pytest.raises(TngramError, match="multiple of n_head_per_ngram"):
        EngramConfig(n_head_per_ngram=3).build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))       # E = d_model = 16
    with pytest.raises(TngramError, match="not in layer_ids"):
        small_cfg().build(d_model=16, vocab_size=40, layer_id=2, layer_ids=(0, 1))
    with pytest.raises(TngramError, match="table_budget"):
        EngramConfig(max_ngram=3, table_budget=(10,))
    with pytest.raises(TngramError, match="tokenizer_path"):
        EngramConfig(compress=True)
    with pytest.raises(TngramError, match="pad_id"):
        small_cfg(pad_id=40).build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))
    with pytest.raises(TypeError, match="kind"):
        EngramConfig(kind="tngram")          # kind is a class attribute, not a field


def test_table_init_std_scales_the_reference_draw():
    """table_init_std s: the table is the default N(0, 1) draw times s (same seed), so its std is
    s and every other parameter (drawn after the table) is unchanged; None keeps N(0, 1)."""
    def build(**kw):
        torch.manual_seed(3)
        return small_cfg(**kw).build(d_model=16, vocab_size=40, layer_id=0, layer_ids=(0,))
    ref, small = build(), build(table_init_std=0.02)
    assert small_cfg().table_init_std is None
    assert torch.equal(small.table.weight, ref.table.weight * 0.02)
    rest = lambda m: {k: v for k, v in m.state_dict().items() if not k.startswith("table.")}
    assert all(torch.equal(v, rest(ref)[k]) for k, v in rest(small).items())
    for bad in (0, 0.0, -0.5, float("nan"), float("inf"), True, "0.02"):
        with pytest.raises(TngramError, match="model.memory.table_init_std"):
            small_cfg(table_init_std=bad)


def test_config_defaults_and_frozen():
    cfg = EngramConfig()
    assert (cfg.max_ngram, cfg.n_head_per_ngram, cfg.pad_id, cfg.kernel_size, cfg.hc_mult) == \
        (3, 8, 2, 4, 1)                                               # reference defaults (§4)
    assert cfg.kind == "engram" and EngramConfig.injection == "block"
    assert cfg.budgets(1024) == (5120, 5120) and cfg.conv_dilation() == 3
    with pytest.raises(Exception):
        cfg.max_ngram = 4  # frozen
    with pytest.raises(TypeError):
        EngramConfig(3)    # keyword-only
