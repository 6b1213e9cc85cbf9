"""A saved add_memory spec carries a sha256 of each of its keys (tngram.hf.spec.spec_digest, written
by add_memory): an edit of any key of SPEC_KEYS that passes the field checks, and so would load
and compute other numbers (a TN-gram `memory.pad_id` moved the logits by 0.75), is refused with one
line naming the file and the key, through from_pretrained (config.json) and load_memory
(tngram_memory.json). The negative control forges the digest to match the edit: the model then
loads and its logits differ, so the digest is what refuses it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import VOCAB, prompt, tiny_model, with_memory  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import load_memory, save_memory  # noqa: E402
from tngram.hf.spec import DIGEST_KEY, SPEC_KEYS, spec_digest  # noqa: E402

# spec key -> an edit that passes every field check of tngram.hf.spec.check_spec (types, ranges,
# layer indices), on a saved TN-gram memory at layers [0, 2] of a 3-layer tiny llama
EDITS = {
    "memory": lambda s: s["memory"].update(pad_id=5),  # pad_id is 0: another n-gram window
    "layers": lambda s: s.update(layers=[2, 0]),  # the same layers, each memory at the other
    "layers_attr": lambda s: s.update(layers_attr="model.layers"),
    "memory_seed": lambda s: s.update(memory_seed=7),  # (the init seed; weights are loaded)
    "vocab_size": lambda s: s.update(vocab_size=VOCAB - 1),
}


def test_every_spec_key_has_an_edit_here():
    """A key added to SPEC_KEYS must get its edit case below (and its digest)."""
    assert set(EDITS) == set(SPEC_KEYS)
    spec = {k: {"x": 1} if k == "memory" else 1 for k in SPEC_KEYS}
    assert set(spec_digest(spec)) == set(SPEC_KEYS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("digest") / "model"
    model = with_memory("llama", "tngram")
    with torch.no_grad():
        logits = model(prompt()).logits
    model.save_pretrained(path)
    return path, json.loads((path / "config.json").read_text()), logits


def _load_with(tmp_path: Path, saved, cfg: dict) -> torch.nn.Module:
    path, _, _ = saved
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(folder)


def test_the_saved_spec_has_the_digest_of_its_keys(saved):
    _, cfg, _ = saved
    spec = cfg["tngram_memory"]
    assert spec[DIGEST_KEY] == spec_digest(spec) and set(spec[DIGEST_KEY]) == set(SPEC_KEYS)


@pytest.mark.parametrize("key", SPEC_KEYS)
def test_each_edited_spec_key_is_refused_naming_the_file_and_key(tmp_path, saved, key):
    cfg = json.loads(json.dumps(saved[1]))
    EDITS[key](cfg["tngram_memory"])
    with pytest.raises(TngramError) as e:
        _load_with(tmp_path, saved, cfg)
    msg = str(e.value)
    assert "\n" not in msg and f"tngram_memory.{key}" in msg, msg
    if key in ("memory", "layers", "memory_seed"):  # pass the field checks: the digest refuses
        assert f"edited/config.json tngram_memory.{key} was edited after saving" in msg, msg
    else:  # checked against the model first (its embedding rows, its decoder-layer list)
        assert f"config.tngram_memory.{key}" in msg, msg


def test_with_a_forged_digest_the_pad_id_edit_loads_and_computes_other_logits(tmp_path, saved):
    """Negative control: the field checks and the weights check alone let this edit through.
    (The other edits that pass the field checks, another order of `layers` and another
    `memory_seed`, leave the logits as they were: the weights are keyed by layer and loaded.)"""
    cfg = json.loads(json.dumps(saved[1]))
    spec = cfg["tngram_memory"]
    EDITS["memory"](spec)
    spec[DIGEST_KEY] = spec_digest(spec)
    model = _load_with(tmp_path, saved, cfg).eval()
    with torch.no_grad():
        got = model(prompt()).logits
    assert (got - saved[2]).abs().max() > 1e-3


def test_a_removed_digest_is_refused(tmp_path, saved):
    cfg = json.loads(json.dumps(saved[1]))
    del cfg["tngram_memory"][DIGEST_KEY]
    with pytest.raises(TngramError, match=rf"config\.json tngram_memory\.{DIGEST_KEY} must be"):
        _load_with(tmp_path, saved, cfg)


def test_untouched_folder_loads_with_the_same_logits(tmp_path, saved):
    model = _load_with(tmp_path, saved, saved[1]).eval()
    with torch.no_grad():
        assert torch.equal(model(prompt()).logits, saved[2])


def test_load_memory_refuses_an_edited_spec_file(tmp_path):
    model = with_memory("llama", "tngram")
    save_memory(model, tmp_path / "mem")
    meta_path = tmp_path / "mem" / "tngram_memory.json"
    meta = json.loads(meta_path.read_text())
    meta["spec"]["memory"]["pad_id"] = 5
    meta_path.write_text(json.dumps(meta))
    plain = tiny_model("llama")
    with pytest.raises(TngramError, match=r"tngram_memory\.json spec\.memory was edited"):
        load_memory(plain, tmp_path / "mem")
    assert not any("ngram_memory" in n for n, _ in plain.named_modules())  # left as it was
