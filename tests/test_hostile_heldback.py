"""Hostile cases found by the held-back round (docs/RELIABILITY.md): variants, in the classes of the
earlier rounds, that the earlier fixes did not cover. Each is one line naming the file and field.

- an exported tngram_gpt folder whose transformers-side fields (hidden_size, num_hidden_layers,
  num_attention_heads, max_position_embeddings) disagree with `gpt`: the model is built from
  `gpt` alone, so it loaded with the same logits while config.json told tools (generation's
  length, lm-eval's width) something else;
- a checkpoint's meta.json `tokens` that is not step x data.global_batch_tokens;
- `sample --num-samples` beyond 10000;
- `bench decode` prompt + tokens longer than the model's context;
- bench `--reps` beyond 10000 and `--warmup` beyond 1000 (1e15 timed for ever);
- an exported folder's model.safetensors truncated or empty (the error named no file);
- an exported folder without its gpt_digest (a rope_base edit then loaded with other logits)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")
import test_hostile_hf as H  # noqa: E402
from test_hostile_ckpt import rowwise_half  # noqa: E402,F401
from test_train_support import tiny_data  # noqa: E402,F401
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


# - a checkpoint's meta.json `tokens` forged to 10^30 (or to any count its steps did not train):
#   it resumed and the run's summary reported the forged count


@pytest.mark.parametrize("tokens", [10**30, 3 * 512, 0])
def test_checkpoint_tokens_other_than_steps_times_batch_are_refused(
    tokens, rowwise_half, tiny_data, tmp_path, capsys
):
    """Every step adds data.global_batch_tokens (512 here) and --resume refuses another batch,
    so step_000002's tokens must be 2 x 512."""
    import json
    import shutil

    from test_hostile import cli, one_line_exit_2, tree_digest
    from test_hostile_ckpt import ROWWISE, forge_manifest
    from test_train_support import cli_args

    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    c = run / "checkpoints" / "step_000002"
    meta = json.loads((c / "meta.json").read_text())
    assert meta["tokens"] == 2 * meta["config"]["data"]["global_batch_tokens"] == 2 * 512
    meta["tokens"] = tokens
    (c / "meta.json").write_text(json.dumps(meta))
    forge_manifest(c)
    before = tree_digest(run)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, ROWWISE), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "meta.json: field 'tokens' must be step x data.global_batch_tokens" in err, err
    assert tree_digest(run) == before


# - `sample --num-samples 1e15`: accepted, and it sampled for ever (313 samples in a minute on the
#   tiny run); now bounded like compare's --seeds


@pytest.mark.parametrize("n", [str(10**15), "10001"])
def test_sample_num_samples_beyond_the_bound_is_one_line(n, tmp_path, capsys):
    from test_hostile import cli, one_line_exit_2

    rc, err = cli(["sample", str(tmp_path), "--prompt", "the", "--num-samples", n], capsys)
    one_line_exit_2(rc, err)
    assert f"--num-samples must be in [1, 10000], got {n}" in err, err


# - `bench decode --tokens 1e15` decoded for a minute to the model's context and then failed;
#   `--prompt 1e15` tried to allocate the prompt (out of memory): both refused before any model


@pytest.mark.parametrize(
    "flag, expect",
    [("--tokens", "--prompt 16 + --tokens {n}"), ("--prompt", "--prompt {n} + --tokens 64")],
)
def test_bench_decode_longer_than_the_context_is_one_line_before_work(flag, expect, capsys):
    from test_hostile import cli, one_line_exit_2

    n = 10**15
    argv = ["bench", "decode", "--shapes", "mini", "--methods", "raw", flag, str(n)]
    rc, err = cli([*argv, "--reps", "1", "--warmup", "0"], capsys)
    # the bench's header note (its torch threads) comes first, as for every bench
    one_line_exit_2(rc, "\n".join(x for x in err.splitlines() if "tngram: threads:" not in x))
    assert expect.format(n=n) + " must be at most the mini model's sequence_len 256" in err, err


# - an exported folder's model.safetensors truncated or empty: safetensors' "invalid header
#   length" / "header too small", naming no file


@pytest.mark.parametrize("keep", [1000, 8, 0])
def test_truncated_exported_weights_name_the_file(keep, exported, tmp_path):
    folder = H.edit(exported, tmp_path / "f", lambda c: None)
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:keep])
    with pytest.raises(BadRecordError) as e:
        H.load(folder)
    msg = str(e.value)
    assert "\n" not in msg and f"{w}: corrupt or truncated safetensors file" in msg, msg


# - an exported folder with gpt_digest removed and rope_base edited (every shape kept): it loaded
#   with logits off by 0.0087; a folder without its digest is now refused after the other checks


def test_exported_folder_without_its_digest_is_refused(exported, tmp_path):
    def change(c):
        c.pop("gpt_digest")
        c["gpt"]["rope_base"] = 500.0

    folder = H.edit(exported, tmp_path / "f", change)
    with pytest.raises(BadRecordError) as e:
        H.load(folder)
    msg = str(e.value)
    assert "\n" not in msg and "config.json: field gpt_digest is missing" in msg, msg


def test_with_the_digest_recomputed_the_rope_edit_loads_with_other_logits(tmp_path):
    """Negative control: the digest is the only check that sees this edit. (The weights are
    moved off their init, whose zero attention projections would make rope_base invisible.)"""
    import torch

    from tngram.hf.gpt_folder import gpt_digest

    model = H.tiny_gpt(H.tngram_mem())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    exported = H.export(model, tmp_path / "moved")

    def change(c):
        c["gpt"]["rope_base"] = 500.0
        c["gpt_digest"] = gpt_digest(c["gpt"], c.get("cp_ranks"))

    ids = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = H.load(exported)(ids).logits
        got = H.load(H.edit(exported, tmp_path / "f", change))(ids).logits
    assert (got - ref).abs().max() > 1e-4


# - bench `--reps 1e15` / `--warmup 1e15`: accepted, and the timing loop ran for ever; bounded in
#   every bench subcommand that takes them (research.cli.bench_args.MAX_REPS / MAX_WARMUP)


@pytest.mark.parametrize("sub", ["modules", "threads", "contention", "step", "vocab", "decode"])
@pytest.mark.parametrize("flag, hi", [("--reps", 10_000), ("--warmup", 1_000)])
def test_bench_reps_and_warmup_beyond_their_bound_are_one_line(sub, flag, hi, capsys):
    from test_hostile import cli, one_line_exit_2

    for n in (str(10**15), str(hi + 1)):
        rc, err = cli(["bench", sub, flag, n], capsys)
        one_line_exit_2(rc, err)
        assert f"argument {flag}: must be an int >= " in err and f"<= {hi}, got '{n}'" in err, err
