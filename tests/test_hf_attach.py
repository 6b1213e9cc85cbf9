"""tngram.hf.add_memory: where the memory goes, causality through the integration, clear errors
(inputs_embeds only, unsupported architecture, vocab mismatch, ids >= vocab), the explicit
layer-list path for other architectures, and optimiser groups for any model."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import FAMILIES, MEMORIES, VOCAB, prompt, tiny_config, tiny_model, with_memory  # noqa: E402

import transformers  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import add_memory, memory_modules, memory_spec, remove_memory  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_is_a_child_of_its_layer_and_base_keys_unchanged(family):
    plain = tiny_model(family)
    model = with_memory(family, "tngram", layers=(0, -1))
    names = sorted(memory_modules(model))
    assert len(names) == 2 and all(n.endswith("ngram_memory") for n in names)
    assert names[0].split(".")[-2] == "0" and names[1].split(".")[-2] == "2"
    base_keys = set(plain.state_dict())
    new_keys = set(model.state_dict()) - base_keys
    assert base_keys <= set(model.state_dict())
    assert new_keys and all(".ngram_memory." in k for k in new_keys)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_causal_through_the_integration(family, kind):
    """Changing token t changes no logit before t, and does change logits at t and later."""
    model = with_memory(family, kind)
    x = prompt(2, 10)
    t = 6
    y = x.clone()
    y[:, t] = (x[:, t] + 7) % (VOCAB - 1) + 1        # another id in [1, VOCAB)
    assert not torch.equal(x[:, t], y[:, t])
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-4


def test_config_object_is_not_changed_and_the_spec_lives_on_model_config():
    """The caller's config can still build plain models; the model gets a tngram_<family>
    config copy carrying the spec (what save_pretrained writes), shared by its submodules."""
    from tngram.hf.classes import base_class

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    add_memory(model, MEMORIES["tngram"])
    assert not hasattr(config, "tngram_memory") and type(config) is transformers.LlamaConfig
    assert model.config is not config and model.config.tngram_memory == memory_spec(model)
    assert memory_spec(model)["layers"] == [1]
    assert model.config.model_type == "tngram_llama" and type(model).__name__ == "TngramLlamaForCausalLM"
    assert base_class(type(model)) is transformers.LlamaForCausalLM
    assert all(m.config is model.config for m in model.modules()
               if isinstance(m.__dict__.get("config"), transformers.PreTrainedConfig))
    assert not memory_modules(transformers.LlamaForCausalLM(config))
    again = type(model)(model.config)          # the memory class rebuilds the memory from its config
    assert set(memory_modules(again)) == set(memory_modules(model))
    assert json.loads(model.config.to_json_string())["tngram_memory"] == memory_spec(model)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_engram_tables_start_at_the_base_initializer_range(family):
    """An EngramConfig without table_init_std draws its tables N(0, r^2), r the base config's
    initializer_range (recorded in the spec): exactly the N(0, 1) draw of table_init_std=1.0
    times r, every other tensor equal; a set value is kept; TN-gram's spec has no such field."""
    import dataclasses

    cfg = MEMORIES["engram"]
    a = add_memory(tiny_model(family), cfg, layers=(0, 2), memory_seed=1)
    one = dataclasses.replace(cfg, table_init_std=1.0)
    b = add_memory(tiny_model(family), one, layers=(0, 2), memory_seed=1)
    r = a.config.initializer_range
    assert r == 0.02 and memory_spec(a)["memory"]["table_init_std"] == r
    assert memory_spec(b)["memory"]["table_init_std"] == 1.0
    for ma, mb in zip(memory_modules(a).values(), memory_modules(b).values(), strict=True):
        assert torch.equal(ma.table.weight, mb.table.weight * r)
        sa, sb = ma.state_dict(), mb.state_dict()
        assert all(torch.equal(v, sb[k]) for k, v in sa.items() if not k.startswith("table."))
    assert "table_init_std" not in memory_spec(with_memory(family, "tngram"))["memory"]


def test_default_zero_init_memory_is_a_no_op_at_start():
    """With the default configs (zero-init value projection) the model's logits are unchanged:
    adding a memory to a trained model does not disturb it before training."""
    from tngram.memory.tngram import TNGramConfig

    plain = tiny_model("llama")
    model = add_memory(tiny_model("llama"), TNGramConfig(max_ngram=3, cp_rank=8), layers=(1,))
    x = prompt()
    with torch.no_grad():
        assert torch.equal(plain(x).logits, model(x).logits)


def test_which_memories_change_the_outputs_at_start():
    """docs/HF.md: every memory kind with its defaults leaves the logits exactly as they were,
    but product keys (values N(0, 1/D), as in their paper) and Over-Encoding's average=True."""
    from tngram.memory import memory_config_classes

    x = prompt(2, 8)
    with torch.no_grad():
        ref = tiny_model("llama")(x).logits
        moved = {}
        for kind, cls in memory_config_classes().items():
            fields = cls.__dataclass_fields__
            cfg = cls(**({"pad_id": 0} if "pad_id" in fields else {}),
                      **({"n_head_per_ngram": 2, "n_embed_per_ngram": 16} if kind == "engram"
                         else {}))
            out = add_memory(tiny_model("llama"), cfg, layers=(1,))(x).logits
            moved[kind] = float((out - ref).abs().max())
    assert {k for k, d in moved.items() if d > 0} == {"pkm", "oe"}, moved
    assert moved["pkm"] > 0.05


def test_over_encoding_initial_effect():
    """docs/HF.md: with average=True (default) Over-Encoding changes the outputs from the start;
    with average=False and the zero-init projection it starts as an exact no-op."""
    from tngram.memory.overencoding import OverEncodingConfig

    x = prompt(2, 8)
    plain = tiny_model("llama")
    with torch.no_grad():
        ref = plain(x).logits
        moved = add_memory(tiny_model("llama"), OverEncodingConfig(max_ngram=3))(x).logits
        same = add_memory(tiny_model("llama"), OverEncodingConfig(max_ngram=3, average=False))(x).logits
    assert (moved - ref).abs().max() > 0.05 and torch.equal(same, ref)


def test_generate_inputs_embeds_gets_our_message():
    model = with_memory("llama", "tngram")
    with pytest.raises(TngramError, match=r"generate\(inputs_embeds=...\) is not supported"):
        model.generate(inputs_embeds=torch.zeros(1, 3, 32), max_new_tokens=2)


def test_inputs_embeds_only_is_refused():
    model = with_memory("llama", "tngram")
    emb = model.get_input_embeddings()(prompt())
    with pytest.raises(TngramError, match="needs token ids: call the model with input_ids"):
        model(inputs_embeds=emb)


def test_ids_outside_vocab_are_refused():
    model = with_memory("gpt2", "engram")
    x = prompt()
    x[0, 2] = VOCAB
    with pytest.raises(TngramError, match=rf"\[0, {VOCAB}\).*max {VOCAB}"):
        model(x)


def test_vocab_mismatch():
    with pytest.raises(TngramError, match="vocab mismatch: vocab_size=100"):
        add_memory(tiny_model("llama"), MEMORIES["tngram"], vocab_size=100)
    model = with_memory("llama", "tngram")
    model.resize_token_embeddings(VOCAB + 3)
    with pytest.raises(TngramError, match="vocab mismatch: the memory was built for 61 tokens"):
        model(prompt())


@pytest.mark.parametrize("layers,match", [
    ((0, 3), r"\[0, 3\] must be distinct decoder-layer indices in \[-3, 3\)"),
    ((1, -2), r"\[1, -2\] must be distinct"),                 # -2 is layer 1 again
    ("12", r"must be a list of decoder-layer indices \(ints\), got '12'"),   # not layers 1 and 2
    ((0.0,), r"must hold ints"), ((True,), r"must hold ints"), ((), r"must be distinct")])
def test_bad_layers(layers, match):
    with pytest.raises(TngramError, match=match):
        add_memory(tiny_model("llama"), MEMORIES["tngram"], layers=layers)


def test_bad_arguments_and_double_add():
    with pytest.raises(TngramError, match="memory_config must be a memory config"):
        add_memory(tiny_model("llama"), {"kind": "tngram"})
    with pytest.raises(TngramError, match="memory_seed must be an int"):
        add_memory(tiny_model("llama"), MEMORIES["tngram"], memory_seed=-1)
    model = with_memory("llama", "tngram")
    with pytest.raises(TngramError, match="already has an n-gram memory"):
        add_memory(model, MEMORIES["tngram"])


def tiny_opt():
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                 num_attention_heads=4, word_embed_proj_dim=32,
                                 max_position_embeddings=128, pad_token_id=0, bos_token_id=None,
                                 eos_token_id=None)
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(cfg).eval()


def test_unsupported_architecture_then_explicit_layer_list():
    with pytest.raises(TngramError, match="model_type 'opt'.*pass layers_attr="):
        add_memory(tiny_opt(), MEMORIES["tngram"])
    with pytest.raises(TngramError, match="no non-empty nn.ModuleList at 'layers'"):
        add_memory(tiny_opt(), MEMORIES["tngram"], layers_attr="layers")
    model = add_memory(tiny_opt(), MEMORIES["tngram"], layers=(1,), layers_attr="decoder.layers")
    x = prompt()
    with torch.no_grad():
        a = model.generate(x, max_new_tokens=8, do_sample=False)
        b = model.generate(x, max_new_tokens=8, do_sample=False, use_cache=False)
        c = tiny_opt().generate(x, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_layer_called_outside_the_model_is_refused():
    model = with_memory("llama", "tngram")
    layer = model.model.layers[0]
    h = torch.zeros(1, 3, 32)
    with pytest.raises(TngramError, match="ran outside its model's forward"):
        layer(h, position_embeddings=model.model.rotary_emb(h, torch.arange(3)[None]))


def test_deepcopy_and_remove_memory():
    model = with_memory("llama", "tngram")
    x = prompt()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(x).logits
        assert torch.equal(twin(x).logits, ref)
        # the copy's memory is its own: changing it leaves the original alone
        twin.model.layers[0].ngram_memory.fusion.value_proj.weight.add_(1.0)
        assert not torch.equal(twin(x).logits, ref) and torch.equal(model(x).logits, ref)
    remove_memory(model)
    assert not memory_modules(model) and memory_spec(model) is None
    with torch.no_grad():
        assert torch.equal(model(x).logits, tiny_model("llama")(x).logits)


@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_optimizer_groups_for_any_model(kind):
    from tngram.optim.groups import memory_param_groups, split_memory_params

    model = with_memory("llama", kind)
    tables, rest = split_memory_params(model)
    # independently: the table tensors by name
    leaf = "factors" if kind == "tngram" else "table.weight"
    named = {n: p for n, p in model.named_parameters()}
    expect = {id(p) for n, p in named.items() if "ngram_memory" in n and n.endswith(leaf)}
    assert {id(p) for p in tables} == expect and len(expect) == (1 if kind == "oe" else 2)
    assert not {id(p) for p in tables} & {id(p) for p in rest}
    assert {id(p) for p in tables} | {id(p) for p in rest} == {id(p) for p in model.parameters()}
    groups = memory_param_groups(model, table_lr=0.05, lr=1e-3)
    assert [g["group"] for g in groups] == ["memory_table", "rest"]
    assert groups[0]["lr"] == 0.05 and groups[0]["weight_decay"] == 0.0 and groups[1]["lr"] == 1e-3
    opt = torch.optim.AdamW(groups, lr=3e-4)      # a real optimiser accepts them
    model(prompt(), labels=prompt()).loss.backward()
    opt.step()


def test_train_only_the_memory():
    """Backbone frozen, memory trained: gradients reach the memory, the backbone does not move."""
    from tngram.optim.groups import memory_param_groups

    model = with_memory("gpt2", "tngram").train()
    for n, p in model.named_parameters():
        p.requires_grad_("ngram_memory" in n)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.Adam(memory_param_groups(model, table_lr=0.05, lr=1e-2))
    x = prompt(4, 12)
    losses = []
    for _ in range(5):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_nothing_below_the_integration_imports_it():
    """Layers point one way: the library core never imports tngram.hf or transformers
    (only the integration itself, the CLI and the bench/experiment tools on top may)."""
    import ast

    pkg = Path(__file__).resolve().parents[1] / "tngram"
    below = ("memory", "model", "optim", "data", "train", "eval", "report", "kernels")
    bad = []
    for area in below:
        for f in sorted((pkg / area).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{f.relative_to(pkg.parent)}: {n}" for n in names
                        if n.startswith(("tngram.hf", "transformers"))]
    assert not bad, bad


def test_transformers_version_is_in_the_supported_range():
    """The hf extra is a range; `make test` runs these tests at both ends (Makefile TF_LOWEST /
    TF_NEWEST) and names the version it expects for the lowest run."""
    import os
    import tomllib

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["hf"]
    spec = next(SpecifierSet(r[len("transformers"):]) for r in extra if r.startswith("transformers"))
    assert Version(transformers.__version__) in spec, (transformers.__version__, str(spec))
    expect = os.environ.get("TNGRAM_EXPECT_TRANSFORMERS")
    if expect:
        assert transformers.__version__ == expect
