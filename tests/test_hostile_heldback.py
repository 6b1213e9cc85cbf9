"""Hostile cases found by the held-back round (docs/RELIABILITY.md): variants, in the classes of the
earlier rounds, that the earlier fixes did not cover. Each is one line naming the file and field.

- an exported tngram_gpt folder whose transformers-side fields (hidden_size, num_hidden_layers,
  num_attention_heads, max_position_embeddings) disagree with `gpt`: the model is built from
  `gpt` alone, so it loaded with the same logits while config.json told tools (generation's
  length, lm-eval's width) something else."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")
import test_hostile_hf as H  # noqa: E402
from tngram.readback import BadRecordError  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny TN-gram GPT exported as a tngram_gpt folder."""
    return H.export(H.tiny_gpt(H.tngram_mem()), tmp_path_factory.mktemp("heldback") / "tngram")


@pytest.mark.parametrize(
    "field, value, gpt_field",
    [
        ("hidden_size", 64, "n_embd"),
        ("num_hidden_layers", 5, "n_layer"),
        ("num_attention_heads", 4, "n_head"),
        ("max_position_embeddings", 0, "sequence_len"),
        ("vocab_size", 96, "vocab_size"),
    ],
)
def test_derived_fields_that_disagree_with_gpt_are_refused(
    field, value, gpt_field, exported, tmp_path
):
    folder = H.edit(exported, tmp_path / "f", lambda c: c.update({field: value}))
    with pytest.raises(BadRecordError) as e:
        H.load(folder)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg, msg
    assert f"field {field} {value} differs from gpt.{gpt_field}" in msg, msg
