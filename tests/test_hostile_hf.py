"""Hostile exported `tngram_gpt` folders (docs/RELIABILITY.md, "Files read back"): a config.json
edited after export, a memory tokenizer_path outside the folder, weights that do not match:
one BadRecordError naming the file and the field, before a model with wrong logits exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from tngram.model.gpt import GPT, GPTConfig  # noqa: E402
from tngram.readback import BadRecordError  # noqa: E402
from test_train_support import tiny_data  # noqa: E402,F401


def tiny_gpt(memory, vocab: int = 97) -> GPT:
    cfg = GPTConfig(
        vocab_size=vocab,
        n_layer=4,
        n_embd=32,
        n_head=2,
        n_kv_head=1,
        sequence_len=32,
        memory=memory,
        memory_layers=(1, 3),
    )
    torch.manual_seed(0)
    return GPT(cfg).eval()


def engram(**kw):
    from tngram.memory.engram import EngramConfig

    return EngramConfig(max_ngram=3, zero_init_value=False, zero_init_conv=False, **kw)


def tngram_mem(**kw):
    from tngram.memory.tngram import TNGramConfig

    return TNGramConfig(max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False, **kw)


def export(model: GPT, out: Path) -> Path:
    from tngram.hf.gpt_model import from_gpt

    from_gpt(model).save_pretrained(str(out))
    return out


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-hf")
    return {
        "engram": (m := tiny_gpt(engram()), export(m, root / "engram")),
        "tngram": (t := tiny_gpt(tngram_mem()), export(t, root / "tngram")),
    }


def edit(folder: Path, dst: Path, fn) -> Path:
    shutil.copytree(folder, dst)
    c = json.loads((dst / "config.json").read_text())
    fn(c)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_an_untouched_export_loads_with_the_same_logits(folders):
    ids = torch.arange(20).remainder(97).view(1, 20)
    for model, folder in folders.values():
        hf = load(folder)
        with torch.no_grad():
            assert torch.equal(
                hf(ids).logits, model(ids)[0] if isinstance(model(ids), tuple) else model(ids)
            )


CASES = [
    ("engram", lambda c: c["gpt"]["memory"].update(seed=1), "edited after export"),
    ("tngram", lambda c: c["gpt"]["memory"].update(pad_id=5), "edited after export"),
    ("tngram", lambda c: c["gpt"].update(memory_layers=[1, 2]), "edited after export"),
    ("tngram", lambda c: c["gpt"].update(rope_base=5000.0), "edited after export"),
    ("tngram", lambda c: c["gpt"]["memory"].update(cp_rank=352.0), "gpt.memory.cp_rank must be"),
    ("tngram", lambda c: c["gpt"].update(memory_layers=[1, 9]), "gpt.memory_layers"),
    ("tngram", lambda c: c["gpt"].update(memory_layers=[1, 1]), "gpt.memory_layers"),
    ("tngram", lambda c: c["gpt"].update(n_layer="4"), "gpt.n_layer must be"),
    ("tngram", lambda c: c.update(cp_ranks=[4.0, 4]), "cp_ranks must be"),
    ("tngram", lambda c: c.update(pad_token_id=10**6), "pad_token_id must be"),
    ("tngram", lambda c: c.update(gpt="x"), "field gpt must be an object"),
]


@pytest.mark.parametrize("kind, change, needle", CASES)
def test_edited_config_is_refused_naming_the_field(kind, change, needle, folders, tmp_path):
    folder = edit(folders[kind][1], tmp_path / "f", change)
    with pytest.raises(BadRecordError, match="config.json") as e:
        load(folder)
    assert needle in str(e.value), e.value


def test_edit_with_the_digest_removed_is_caught_by_the_weights(folders, tmp_path):
    """Without gpt_digest (a forger deleted it, or an older export), memory_layers moved to
    other blocks still fails: the weights of block 3's memory are unexpected, block 2's missing."""

    def change(c):
        c.pop("gpt_digest")
        c["gpt"]["memory_layers"] = [1, 2]

    folder = edit(folders["tngram"][1], tmp_path / "f", change)
    with pytest.raises(BadRecordError, match=r"model.safetensors: the weights do not match"):
        load(folder)


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.model", "sub/tok.model", ".."])
def test_engram_tokenizer_path_never_leaves_the_folder(path, folders, tmp_path):
    """compress on + tokenizer_path naming a file outside the folder: refused before anything
    opens it (the victim file outside the folder is never read as a tokenizer)."""
    (tmp_path / "outside.model").write_bytes(b"not a tokenizer")

    def change(c):
        c.pop("gpt_digest")  # even a folder without a digest
        c["gpt"]["memory"].update(compress=True, tokenizer_path=path)

    folder = edit(folders["engram"][1], tmp_path / "f", change)
    with pytest.raises(BadRecordError, match="tokenizer_path must be a file name inside"):
        load(folder)


def test_engram_tokenizer_path_as_a_link_out_of_the_folder_is_refused(folders, tmp_path):
    (tmp_path / "outside.model").write_bytes(b"not a tokenizer")

    def change(c):
        c.pop("gpt_digest")
        c["gpt"]["memory"].update(compress=True, tokenizer_path="tok.model")

    folder = edit(folders["engram"][1], tmp_path / "f", change)
    (folder / "tok.model").symlink_to(tmp_path / "outside.model")
    with pytest.raises(BadRecordError, match="not a regular file inside the folder"):
        load(folder)


def test_engram_with_compression_exports_and_loads_from_its_own_folder(tmp_path, tiny_data):
    """The supported case: the compression tokenizer travels inside the folder under a plain
    name, and the loaded model computes what the original does."""
    from tngram.hf.gpt_folder import MEMORY_TOKENIZER, memory_tokenizer_for_export
    from tngram.hf.gpt_model import from_gpt

    tok = tmp_path / "tokenizer.model"
    tok.write_bytes((tiny_data / "tokenizer.model").read_bytes())
    mem = engram(compress=True, tokenizer_path=str(tok))
    model = tiny_gpt(mem, vocab=512)
    out = tmp_path / "hf"
    hf = from_gpt(model)
    src = memory_tokenizer_for_export(hf)  # what `tngram export` does
    hf.save_pretrained(str(out))
    shutil.copy(src, out / MEMORY_TOKENIZER)
    tok.unlink()  # the folder holds all it needs
    loaded = load(out)
    assert loaded.config.gpt["memory"]["tokenizer_path"] == MEMORY_TOKENIZER
    ids = torch.arange(20).remainder(512).view(1, 20)
    with torch.no_grad():
        want = model(ids)
        want = want[0] if isinstance(want, tuple) else want
        assert torch.equal(loaded(ids).logits, want)


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.model"])
def test_family_spec_tokenizer_path_never_leaves_the_folder(path, tmp_path):
    """The same rule for an add_memory model's spec (config.tngram_memory.memory)."""
    from hf_tiny import with_memory
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "f"
    with_memory("llama", "engram").save_pretrained(str(folder))
    c = json.loads((folder / "config.json").read_text())
    c["tngram_memory"]["memory"].update(compress=True, tokenizer_path=path)
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(BadRecordError, match="tngram_memory.memory.tokenizer_path must be a file"):
        AutoModelForCausalLM.from_pretrained(str(folder))


def _poison_file(w: Path) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(w)
    k = next(k for k, v in sorted(tensors.items()) if v.is_floating_point() and "memory" in k)
    tensors[k].view(-1)[0] = float("nan")
    save_file(tensors, w, metadata={"format": "pt"})
    return k


def test_exported_weights_must_match_their_payload_digest(folders, tmp_path):
    """A random payload under the valid header (every shape kept): refused before loading."""
    folder = edit(folders["tngram"][1], tmp_path / "f", lambda c: None)
    w = folder / "model.safetensors"
    data = w.read_bytes()
    n = 8 + int.from_bytes(data[:8], "little")
    w.write_bytes(data[:n] + torch.randn((len(data) - n) // 4).numpy().tobytes())
    with pytest.raises(BadRecordError, match=r"model.safetensors: the payload does not match"):
        load(folder)


def test_exported_folder_from_before_the_digest_loads_with_a_warning(folders, tmp_path):
    """An export by an older tngram has no weights_sha256: it loads with the same logits and one
    warning; a weights_sha256 that is not a mapping is refused."""
    original = folders["tngram"][1]
    folder = edit(original, tmp_path / "f", lambda c: c.pop("weights_sha256"))
    with pytest.warns(UserWarning, match="no weights_sha256 in config.json"):
        loaded = load(folder)
    ids = torch.arange(20).remainder(97).view(1, 20)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, load(original)(ids).logits)
    bad = edit(original, tmp_path / "g", lambda c: c.update({"weights_sha256": "x"}))
    with pytest.raises(BadRecordError, match="field weights_sha256 must map"):
        load(bad)


def test_non_finite_weights_never_load_from_either_folder_kind(folders, tmp_path):
    """NaN in a memory table, the digest rewritten to match (a forger's work): an exported
    tngram_gpt folder and a family model saved with its memory are both refused by value."""
    from hf_tiny import with_memory
    from transformers import AutoModelForCausalLM

    from tngram.common import TngramError
    from tngram.hf.gpt_folder import record_weights_digest

    folder = edit(folders["tngram"][1], tmp_path / "f", lambda c: None)
    k = _poison_file(folder / "model.safetensors")
    record_weights_digest(folder)
    with pytest.raises(BadRecordError, match=f"non-finite values in {k}"):
        load(folder)
    family = tmp_path / "llama"
    with_memory("llama", "tngram").save_pretrained(str(family))
    k = _poison_file(family / "model.safetensors")
    record_weights_digest(family)
    with pytest.raises(TngramError, match=f"non-finite values in {k}"):
        AutoModelForCausalLM.from_pretrained(str(family))


def test_family_weights_must_match_their_payload_digest(tmp_path):
    """A family model saved with its memory: one payload byte flipped under the valid header
    (shapes kept) is refused in one line naming the weights file, before a model is built."""
    from hf_tiny import with_memory
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "llama"
    with_memory("llama", "tngram").save_pretrained(str(folder))
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 5] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(BadRecordError, match=r"^\S*model.safetensors: the payload does not match"):
        AutoModelForCausalLM.from_pretrained(str(folder))


def test_family_folder_from_before_the_digest_loads_with_a_warning(tmp_path):
    """A family model saved before weights_sha256 existed loads with the same logits, bit for
    bit, and one warning to save it again."""
    from hf_tiny import prompt, with_memory
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "llama"
    model = with_memory("llama", "engram").eval()
    model.save_pretrained(str(folder))
    old = edit(folder, tmp_path / "old", lambda c: c.pop("weights_sha256"))
    with pytest.warns(UserWarning, match="no weights_sha256 in config.json") as seen:
        loaded = AutoModelForCausalLM.from_pretrained(str(old)).eval()
    assert sum("weights_sha256" in str(w.message) for w in seen) == 1
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, model(prompt()).logits)
