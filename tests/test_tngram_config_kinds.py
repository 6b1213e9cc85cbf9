"""TN-gram's two config kinds: `tngram` holds the paper's settings only (Eqs. 9-14, its ablations,
adaptive rank; at most 19 fields), `tngram-variant` adds the variants beyond the paper. Configs of
the earlier spelling, where the variants were fields of kind tngram (27 fields), still load:

- tests/assets/tngram-old-format/ holds files written by that code (make_old_format.py says how):
  a run folder, an exported folder's config.json and a `save_memory` adapter of a hybrid. Each
  loads into today's kinds with the same parameters and the outputs the old code computed.
- A `--set model.memory.<variant field>` on kind tngram moves the memory to kind tngram-variant
  (keeping the recipe's other settings); a dict with the variant fields at their defaults stays
  the paper's kind.

Stored outputs are compared at 1e-6 (absolute): fp32 summation order can differ between CPUs and
BLAS builds. Where old and new spellings are both built here, they agree bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from tngram.common import TngramError
from tngram.memory import (
    memory_config_classes,
    memory_config_from_dict,
    memory_config_to_dict,
    migrate_memory_dict,
    with_memory_fields,
)
from tngram.memory.tngram import TNGram, TNGramConfig
from tngram.memory.tngram_variants import TNGramVariant, TNGramVariantConfig
from tngram.model.gpt import GPT, GPTConfig
from tngram.train.config import apply_overrides
from tngram.train.recipes import get_recipe

ASSETS = Path(__file__).parent / "assets" / "tngram-old-format"
VARIANT_FIELDS = ("order_combine", "kv_rank", "share_factors", "hash_orders", "hash_heads",
                  "hash_embed", "hash_budget", "hash_seed")
TOL = dict(rtol=0, atol=1e-6)


def test_paper_config_has_at_most_19_fields_and_the_variant_kind_the_rest():
    paper = [f.name for f in fields(TNGramConfig)]
    assert len(paper) <= 19, paper
    assert not set(VARIANT_FIELDS) & set(paper)
    variant = [f.name for f in fields(TNGramVariantConfig)]
    assert variant == paper + list(VARIANT_FIELDS)
    assert TNGramConfig.moved_fields == dict.fromkeys(VARIANT_FIELDS, "tngram-variant")
    assert memory_config_classes()["tngram-variant"] is TNGramVariantConfig
    assert TNGramVariantConfig.moved_fields == {}


# ---- the earlier spelling: dicts, --set, config files --------------------------------------

def test_old_dict_with_a_variant_field_reads_as_the_variant_kind():
    old = {"kind": "tngram", "max_ngram": 4, "cp_rank": 16, "order_combine": "sum",
           "hash_orders": [2, 3]}
    cfg = memory_config_from_dict(old)
    assert cfg == TNGramVariantConfig(max_ngram=4, cp_rank=16, order_combine="sum", hash_orders=(2, 3))
    assert memory_config_to_dict(cfg)["kind"] == "tngram-variant"
    assert memory_config_from_dict(memory_config_to_dict(cfg)) == cfg


def test_old_dict_with_every_variant_field_at_its_default_is_the_paper():
    old = {"kind": "tngram", "cp_rank": 16, "order_combine": "concat", "kv_rank": 0,
           "share_factors": False, "hash_orders": [], "hash_heads": 4, "hash_embed": 64,
           "hash_budget": 0, "hash_seed": 0}
    assert migrate_memory_dict(old) == {"kind": "tngram", "cp_rank": 16}
    assert memory_config_from_dict(old) == TNGramConfig(cp_rank=16)
    assert type(memory_config_from_dict({"kind": "tngram"})) is TNGramConfig


def test_variant_kind_keeps_adaptive_rank_off():
    with pytest.raises(TngramError, match="model.memory.kind=tngram") as e:
        TNGramVariantConfig(order_combine="sum", prune_at_step=10)
    assert "\n" not in str(e.value)
    with pytest.raises(TngramError, match="model.memory.kind=tngram"):
        memory_config_from_dict({"kind": "tngram", "order_combine": "sum", "prune_at_step": 10})


def test_set_of_a_variant_field_on_kind_tngram_moves_the_recipe_to_the_variant_kind():
    """The docs' command lines (docs/TRAINING.md) in their earlier spelling: the recipe's TN-gram
    settings are kept, the variant field set, the kind tngram-variant."""
    base = get_recipe("mini-tngram")
    cfg = apply_overrides(base, ["model.memory.hash_orders=[4,5]", "model.memory.hash_embed=128"])
    mem = cfg.model.memory
    assert type(mem) is TNGramVariantConfig
    assert mem == TNGramVariantConfig(**{f.name: getattr(base.model.memory, f.name)
                                         for f in fields(TNGramConfig)},
                                      hash_orders=(4, 5), hash_embed=128)
    # the same with the kind named first, and in either order with a paper field
    named = apply_overrides(base, ["model.memory.kind=tngram-variant",
                                   "model.memory.hash_orders=4,5", "model.memory.hash_embed=128"])
    assert named == cfg
    shared = apply_overrides(base, ["model.memory.share_factors=true", "model.memory.cp_rank=770"])
    assert shared.model.memory == with_memory_fields(base.model.memory, share_factors=True,
                                                     cp_rank=770)
    assert apply_overrides(base, ["model.memory.cp_rank=770", "model.memory.share_factors=true"]) \
        == shared


def test_kind_switch_between_tngram_and_variant_keeps_the_shared_fields():
    hsum = get_recipe("mini-tngram-hsum")
    assert hsum.model.memory.kind == "tngram-variant"
    paper = apply_overrides(hsum, ["model.memory.kind=tngram"]).model.memory
    assert type(paper) is TNGramConfig and paper.cp_rank == hsum.model.memory.cp_rank == 64
    # another kind still starts from its defaults
    eng = apply_overrides(hsum, ["model.memory.kind=engram"]).model.memory
    assert eng == memory_config_classes()["engram"]()


def test_config_file_with_the_old_spelling(tmp_path):
    """A TOML config file (tngram train --config) naming a variant field under kind tngram."""
    from tngram.train.config import apply_settings
    from tngram.train.config_file import load_config_file

    path = tmp_path / "hybrid.toml"
    path.write_text('recipe = "mini-tngram"\n[model.memory]\nkind = "tngram"\n'
                    'order_combine = "sum"\nhash_orders = [2, 3]\n')
    recipe, settings = load_config_file(path)
    cfg = apply_settings(get_recipe(recipe), settings, str(path))
    assert cfg.model.memory.kind == "tngram-variant"
    assert (cfg.model.memory.order_combine, cfg.model.memory.hash_orders) == ("sum", (2, 3))


def test_with_memory_fields_refuses_a_field_of_no_kind():
    with pytest.raises(TypeError):
        with_memory_fields(TNGramConfig(), not_a_field=1)


# ---- files written by the earlier code -------------------------------------------------------

def _old_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(ASSETS / "run", run)
    return run


def test_old_run_folder_loads_with_the_same_parameters_and_logits(tmp_path):
    from safetensors.torch import load_file

    from tngram.train.checkpoint import load_run_model

    run = _old_run(tmp_path)
    old = json.loads((run / "config.json").read_text())["model"]["memory"]
    assert old["kind"] == "tngram" and len(old) == 1 + 27          # the 27-field TNGramConfig
    model, _ = load_run_model(run)
    mem = model.config.memory
    assert type(mem) is TNGramVariantConfig
    assert {k: getattr(mem, k) for k in old if k != "kind"} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in old.items() if k != "kind"}
    assert all(type(b.memory) is TNGramVariant for b in model.blocks)
    assert model.blocks[1].memory.factors is model.blocks[0].memory.factors   # share_factors
    saved = load_file(str(run / "model.safetensors"))
    got = model.state_dict()
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    want = load_file(str(run / "expected.safetensors"))
    with torch.no_grad():
        logits = model(want["ids"])
    torch.testing.assert_close(logits, want["logits"], **TOL)
    # today's spelling of the same config computes the same logits, bit for bit
    now = GPTConfig.from_dict({**model.config.to_dict()})
    assert now.to_dict()["memory"]["kind"] == "tngram-variant"
    twin = GPT(now).eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(twin(want["ids"]), logits)


def test_old_run_resumes_with_todays_spelling(tmp_path, monkeypatch):
    """check_resume_config compares a checkpoint's config (old spelling) with the config made now
    from the same recipe and --set (today's spelling): the same run, so no difference."""
    from tngram.train import checkpoint as ckpt
    from tngram.train import trainer_setup
    from tngram.train.config import TrainConfig

    run = _old_run(tmp_path)
    saved = json.loads((run / "config.json").read_text())
    monkeypatch.setattr(ckpt, "read_checkpoint_meta", lambda _: {"config": saved})
    now = TrainConfig.from_dict(saved)
    assert now.to_dict()["model"]["memory"]["kind"] == "tngram-variant"
    trainer_setup.check_resume_config(run, run, now)   # no error
    other = apply_overrides(now, ["model.memory.hash_seed=4"])
    with pytest.raises(TngramError, match=r"model\.memory"):
        trainer_setup.check_resume_config(run, run, other)


def test_old_exported_folder_loads_with_the_same_logits(tmp_path):
    """An exported folder (tngram export RUN --hf) whose config.json `gpt` holds the old memory
    dict: transformers' from_pretrained loads it (its gpt_digest, over the saved dict, holds).
    Exports of that time recorded no weights digest: it is added as the loader's message says to
    for a trusted folder (record_weights_digest), leaving `gpt` as it was saved."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    import tngram.hf  # noqa: F401  (registers tngram_gpt with the Auto classes)
    from tngram.hf.gpt_folder import record_weights_digest
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(ASSETS / "hf-export" / "config.json", folder / "config.json")
    weights = load_file(str(ASSETS / "run" / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in weights.items()}, str(folder / "model.safetensors"))
    record_weights_digest(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert type(hf.model.config.memory) is TNGramVariantConfig
    want = load_file(str(ASSETS / "run" / "expected.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(hf(want["ids"]).logits, want["logits"], **TOL)


def test_old_memory_adapter_loads_with_the_same_outputs(tmp_path):
    """A save_memory adapter of a hybrid TN-gram (spec memory: kind tngram with variant fields):
    load_memory checks its spec and digest and attaches tngram-variant modules computing what the
    old ones did."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import tiny_model
    from tngram.hf import load_memory, memory_modules
    from tngram.hf.adapter import DIGEST_KEY, SPEC_FILE, WEIGHTS_FILE, base_identity

    folder = tmp_path / "memory"
    shutil.copytree(ASSETS / "hf-memory", folder)
    model = tiny_model("llama")
    meta = json.loads((folder / SPEC_FILE).read_text())
    assert meta["spec"]["memory"]["kind"] == "tngram" and "hash_orders" in meta["spec"]["memory"]
    # the base's identity hashes its transformers config, whose fields vary across the
    # transformers range we support: the tiny llama is the base it was saved from
    meta["base"]["config_hash"] = base_identity(model)["config_hash"]
    # memories of that time recorded no weights digest: added as for a trusted folder (the sha256
    # of the safetensors payload, after its 8-byte length and JSON header); the spec is untouched
    data = (folder / WEIGHTS_FILE).read_bytes()
    payload = data[8 + int.from_bytes(data[:8], "little"):]
    meta[DIGEST_KEY] = hashlib.sha256(payload).hexdigest()
    (folder / SPEC_FILE).write_text(json.dumps(meta))
    load_memory(model, folder)
    mods = memory_modules(model)
    assert len(mods) == 2 and all(type(m) is TNGramVariant for m in mods.values())
    cfg = next(iter(mods.values())).config
    assert (cfg.kind, cfg.order_combine, cfg.hash_orders, cfg.hash_budget) == (
        "tngram-variant", "sum", (2, 3), 13)
    want = load_file(str(folder / "expected.safetensors"))
    with torch.no_grad():
        for name, mod in mods.items():
            torch.testing.assert_close(mod(want["h"], want["ids"]), want[f"y.{name}"], **TOL)


def test_paper_module_has_no_variant_stage():
    m = TNGramConfig(max_ngram=3, cp_rank=4).build(d_model=8, vocab_size=11)
    assert type(m) is TNGram and not hasattr(m, "hashed") and not hasattr(m, "kv_down")
