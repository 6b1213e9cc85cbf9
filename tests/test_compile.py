"""One compiled graph and no host syncs: torch.compile(fullgraph=True) and torch._dynamo.explain on
the GPT with each memory, and where token ids are checked instead of every forward.

Any data-dependent read in a forward (`int(ids.max())`, `.item()`, a Python branch on a tensor
value) is a graph break under dynamo and a device->host sync on a GPU, so "zero graph breaks"
is the CPU-checkable proof that the forward and backward issue none. Compiled with the
"aot_eager" backend: dynamo + AOT autograd tracing of forward and backward without Inductor's
C++ build, so the tests stay fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tngram.common import TngramError
from tngram.kernels import c_unavailable_reason, triton_available
from tngram.memory.engram import EngramConfig
from tngram.memory.ngrams import check_ids_in_forward, ids_checked_in_forward
from tngram.memory.overencoding import OverEncodingConfig
from tngram.memory.tngram import TNGramConfig
from tngram.model.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
V = 64
MEMORIES = {"raw": None, "engram": EngramConfig(max_ngram=3, n_head_per_ngram=2, pad_id=0),
            "tngram": TNGramConfig(max_ngram=3, cp_rank=8), "oe": OverEncodingConfig(table_rows=97)}
NO_C = pytest.mark.skipif(c_unavailable_reason() is not None,
                          reason=f"C kernel unavailable: {c_unavailable_reason()}")
CASES = [pytest.param("raw", "auto", id="raw"), pytest.param("engram", "auto", id="engram"),
         pytest.param("oe", "auto", id="oe"), pytest.param("tngram", "torch", id="tngram-torch"),
         pytest.param("tngram", "c", id="tngram-c", marks=NO_C)]


def tiny(memory) -> GPT:  # noqa: ANN001
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, sequence_len=16,
                         memory=memory, memory_layers=(1,), memory_seed=0))


@pytest.mark.parametrize("name, impl", CASES)
def test_zero_graph_breaks_and_fullgraph_compile_matches_eager(name, impl, monkeypatch):
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", impl)
    torch._dynamo.reset()
    m = tiny(MEMORIES[name])
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    ex = torch._dynamo.explain(m)(ids, tgt)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [str(b.reason)[:200] for b in ex.break_reasons]
    loss_ref = m(ids, tgt)
    g_ref = torch.autograd.grad(loss_ref, list(m.parameters()))
    torch._dynamo.reset()
    loss = torch.compile(m, fullgraph=True, backend="aot_eager")(ids, tgt)
    g = torch.autograd.grad(loss, list(m.parameters()))
    # same ops in the same order (aot_eager runs the traced aten ops): equal to fp32 rounding
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for (pname, _), x, r in zip(m.named_parameters(), g, g_ref):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-6, msg=pname)


def test_bad_ids_get_the_same_clear_error_at_the_entry_points(monkeypatch):
    from tngram.eval.sample import generate
    m = tiny(MEMORIES["tngram"])
    bad = torch.tensor([[1, 2, V]])
    monkeypatch.delenv("TNGRAM_CHECK_IDS", raising=False)
    with pytest.raises(TngramError, match=rf"input_ids must lie in \[0, {V}\).*max {V}"):
        m(bad)                                             # CPU eager: checked, no device sync
    with pytest.raises(TngramError, match=rf"prompt token ids must lie in \[0, {V}\)"):
        generate(m, [1, V + 3], max_new_tokens=2)
    with pytest.raises(TngramError, match="integer tensor"):
        m(torch.zeros(1, 3))
    # TNGRAM_CHECK_IDS=0: the forward reads no ids; the C op / gathers still refuse (not silent)
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        m(bad)


def test_forwards_read_no_ids_off_the_cpu_unless_asked(monkeypatch):
    """Meta tensors have no data: reading one (as int(ids.max()) does) raises. On any device but
    the CPU the default check is dtype-only, so it passes; TNGRAM_CHECK_IDS=1 forces the read."""
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    monkeypatch.delenv("TNGRAM_CHECK_IDS", raising=False)
    assert not ids_checked_in_forward(ids) and ids_checked_in_forward(torch.zeros(1, dtype=torch.long))
    check_ids_in_forward(ids, V)
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "1")
    with pytest.raises(Exception):
        check_ids_in_forward(ids, V)
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    assert not ids_checked_in_forward(torch.zeros(1, dtype=torch.long))


TRITON_COMPILE = textwrap.dedent("""
    import torch
    from tngram.memory.tngram import TNGramConfig
    from tngram.model.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, sequence_len=8,
                      memory=TNGramConfig(max_ngram=3, cp_rank=8), memory_layers=(1,)))
    ids = torch.randint(0, 64, (1, 8))
    ex = torch._dynamo.explain(m)(ids, ids)
    ref = m(ids, ids)
    torch._dynamo.reset()
    loss = torch.compile(m, fullgraph=True, backend="aot_eager")(ids, ids)
    loss.backward()
    print(ex.graph_break_count, abs(loss.item() - ref.item()))
""")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton)")
def test_triton_lookup_is_one_opaque_op_under_compile():
    """The Triton lookup (run by the interpreter on CPU tensors) as a custom op: no graph break."""
    env = dict(os.environ, TRITON_INTERPRET="1", TNGRAM_LOOKUP_IMPL="triton")
    out = subprocess.run([sys.executable, "-c", TRITON_COMPILE], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    breaks, diff = out.stdout.split()
    assert int(breaks) == 0 and float(diff) < 1e-5
