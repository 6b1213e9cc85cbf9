"""add_memory(..., table_device="cpu") (tngram.hf.placement): the memory's lookup tables stay in
host memory and a call moves only the rows it reads to the model's device.

This machine has one device (the CPU), so two things are checked apart:
- the read path: `compact_reads()` makes every lookup take the path of a table on another device
  (distinct rows found and gathered on the table's device, moved, remapped), and the logits,
  the gradients of every parameter (dense and row-sparse) and cached generation are bit-equal
  to the model with its tables read in place (float64; the read hook counts that only the rows
  read were gathered);
- the placement: moving the model to another device ("meta", the one other device a CPU build
  has) leaves the tables on the CPU and moves everything else; dtype changes reach the tables;
  save_pretrained / from_pretrained and save_memory / load_memory keep the setting.
What a CPU run cannot show: the copy of the rows to an accelerator, and the speed there."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, prompt, tiny_model  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import (  # noqa: E402
    add_memory,
    load_memory,
    memory_modules,
    memory_spec,
    save_memory,
)
from tngram.hf.placement import table_bytes, table_params  # noqa: E402
from tngram.kernels.sparse_rows import compact_reads, set_read_hook  # noqa: E402
from tngram.memory.per_layer_embedding import PerLayerEmbeddingConfig  # noqa: E402
from tngram.memory.product_key import ProductKeyConfig  # noqa: E402
from tngram.optim.memory_update import set_sparse_grads  # noqa: E402

CONFIGS = {
    "engram": MEMORIES["engram"],
    "oe": MEMORIES["oe"],
    "tngram_fused": MEMORIES["tngram_fused"],
    "pkm": ProductKeyConfig(n_keys=8, key_dim=8, n_heads=2, topk=4),
    "ple": PerLayerEmbeddingConfig(ple_dim=8, zero_init_proj=False),
}


def pair(kind, dtype=torch.float64):
    """(model with tables read in place, the same model with table_device="cpu"), with every
    memory weight moved off its (often zero) init, so every path carries a signal."""
    plain = add_memory(tiny_model("llama"), CONFIGS[kind], layers=(0, 2), memory_seed=3)
    plain.to(dtype)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "ngram_memory" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    host = add_memory(tiny_model("llama"), CONFIGS[kind], layers=(0, 2), table_device="cpu")
    host.to(dtype)
    host.load_state_dict(plain.state_dict())
    return plain, host


def run(model, x, sparse):
    set_sparse_grads(model, sparse)
    model.train()
    out = model(x, labels=x, use_cache=False)
    out.loss.backward()
    return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_host_reads_are_bit_equal(kind, sparse):
    plain, host = pair(kind)
    x = prompt(2, 9)
    want_logits, want_grads = run(plain, x, sparse)
    read = []
    for p in table_params(host):
        set_read_hook(p, lambda rows, n=p.shape: read.append((rows.numel(), n)))
    with compact_reads():
        logits, grads = run(host, x, sparse)
    for p in table_params(host):
        set_read_hook(p, None)
    assert read and all(r < torch.Size(n[:-1]).numel() for r, n in read)  # only rows read
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        a, b = (t.to_dense() if t.is_sparse else t for t in (grads[name], g))
        assert grads[name].is_sparse == g.is_sparse and torch.equal(a, b), name


def test_host_generation_equals_in_place_generation():
    plain, host = pair("engram")
    plain.eval(), host.eval()
    x = prompt(2, 6)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), compact_reads():
        got = host.generate(x, **kw)
    with torch.no_grad():
        assert torch.equal(got, plain.generate(x, **kw))


def test_fp32_tngram_kernel_reads_the_gathered_rows():
    """fp32 TN-gram runs its C (or torch) kernel on the gathered rows: the same numbers."""
    plain, host = pair("tngram_fused", torch.float32)
    x = prompt(2, 9)
    want_logits, want_grads = run(plain, x, False)
    with compact_reads():
        logits, grads = run(host, x, False)
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(grads[n], g) for n, g in want_grads.items())


def test_tables_stay_on_the_cpu_when_the_model_moves():
    _, host = pair("engram")
    host(prompt(1, 5), labels=prompt(1, 5), use_cache=False).loss.backward()
    tables = {id(p) for p in table_params(host)}
    assert len(tables) == 2
    moved = copy.deepcopy(host).to("meta")
    for name, p in moved.named_parameters():
        on = "cpu" if id(p) in {id(q) for q in table_params(moved)} else "meta"
        assert p.device.type == on, name
        assert p.grad is None or p.grad.device.type == on, name
    half = copy.deepcopy(host).to(torch.float32)  # a dtype change does reach the tables
    assert {p.dtype for p in table_params(half)} == {torch.float32}
    assert {p.device.type for p in table_params(half)} == {"cpu"}
    plain = copy.deepcopy(pair("engram")[0]).to("meta")  # without the setting they move
    assert {p.device.type for p in table_params(plain)} == {"meta"}
    # what stays in host memory: each layer's rows (the sum of its heads' primes) x head_dim,
    # 8 bytes each (float64)
    mems = memory_modules(host).values()
    assert table_bytes(host) == sum(
        sum(map(sum, m.config.layer_primes(61, m.layer_id, (0, 2)))) * m.head_dim * 8 for m in mems
    )


def test_save_and_load_keep_table_device(tmp_path):
    from transformers import AutoModelForCausalLM

    _, host = pair("engram")
    host.save_pretrained(tmp_path / "full")
    assert (
        json.loads((tmp_path / "full/config.json").read_text())["tngram_memory"]["table_device"]
        == "cpu"
    )
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert memory_spec(again)["table_device"] == "cpu"
    assert {p.device.type for p in table_params(again.to("meta"))} == {"cpu"}
    save_memory(host, tmp_path / "adapter")
    base = tiny_model("llama").to(torch.float64)
    load_memory(base, tmp_path / "adapter")
    assert memory_spec(base)["table_device"] == "cpu"
    assert {p.device.type for p in table_params(base.to("meta"))} == {"cpu"}


def test_bad_settings_get_one_line(tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(TngramError, match="table_device must be null .* got 'cuda'"):
        add_memory(tiny_model("llama"), MEMORIES["engram"], table_device="cuda")
    with pytest.raises(TngramError, match="needs TNGramConfig\\(fused=True\\)"):
        add_memory(tiny_model("llama"), MEMORIES["tngram"], table_device="cpu")
    _, host = pair("engram")
    host.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tngram_memory"]["table_device"] = "gpu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TngramError, match="tngram_memory.table_device must be null"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
