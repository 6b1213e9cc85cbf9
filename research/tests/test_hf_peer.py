"""The engram-peft comparison (research.experiments.hf_peer): its measures on tngram's side, the
DeepSeek reference hashing it checks against, and the table of docs/HF.md it renders."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("sympy", reason="the reference hashing uses sympy.nextprime")

from research.experiments import hf_peer as hp  # noqa: E402
from research.report.docblocks import current_block, render  # noqa: E402
from research.report.peer_blocks import FEATURES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIDE_ARGS = dict(layers=hp.LAYERS, trainable="memory")


# ---- the reference hashing --------------------------------------------------------------------
def test_reference_primes_equal_deepseek_demo_vectors():
    # the prime table sizes of engram_demo_v1.py's demo config (budget 5 x 129280 = 646400, 8
    # heads, layers 1 and 15), as computed with DeepSeek's code (tests/test_hashing.py, §9)
    p = hp.reference_primes((646400, 646400), 8, (1, 15))
    assert p[1] == [[646403, 646411, 646421, 646423, 646433, 646453, 646519, 646523],
                    [646537, 646543, 646549, 646571, 646573, 646577, 646609, 646619]]
    assert p[15][1][-1] == 646879


def test_reference_hashes_equal_a_python_loop():
    V, N, H, pad, layers = 97, 4, 3, 5, (0, 2)
    ids = np.random.default_rng(0).integers(0, V, size=(2, 11))
    got = hp.reference_hashes(ids, vocab_size=V, max_ngram=N, n_head=H, budgets=(13, 7, 29),
                              layer_ids=layers, pad_id=pad)
    primes = hp.reference_primes((13, 7, 29), H, layers)
    for layer in layers:
        m = [int(x) for x in hp.reference_multipliers(V, N, layer, 0)]
        assert all(x % 2 == 1 and x * (V - 1) < 2**63 for x in m)   # odd, no int64 overflow
        for b in range(2):
            for t in range(11):
                ctx = [int(ids[b, t - k]) if t >= k else pad for k in range(N)]
                want = []
                for n in range(2, N + 1):
                    mix = functools.reduce(lambda a, c: a ^ c, [ctx[k] * m[k] for k in range(n)])
                    want += [mix % p for p in primes[layer][n - 2]]
                assert got[layer][b, t].tolist() == want


def test_agreement_counts_equal_ids():
    want = {1: np.array([[[1, 2], [3, 4]]]), 3: np.array([[[5, 6], [7, 8]]])}
    got = {1: np.array([[[1, 0], [3, 4]]]), 3: np.array([[[5, 6], [0, 0]]])}
    assert hp.agreement(got, want) == 5 / 8
    with pytest.raises(ValueError, match="layers"):
        hp.agreement({1: want[1]}, want)


# ---- tngram's side ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engram_side():
    return hp.tngram_side("tngram Engram", hp.tngram_engram_config, 1e-3)


def test_tngram_engram_hashes_equal_the_reference(engram_side):
    model = engram_side.build()
    ids = hp.synthetic_tokens(3, 40, hp.BASE["vocab_size"], seed=7)
    kw = dict(vocab_size=hp.BASE["vocab_size"], max_ngram=hp.MAX_NGRAM, n_head=hp.HEADS,
              budgets=(hp.BUDGET,) * (hp.MAX_NGRAM - 1), layer_ids=hp.LAYERS,
              pad_id=hp.BASE["pad_token_id"])
    assert hp.agreement(engram_side.hashes(model, ids), hp.reference_hashes(ids.numpy(), **kw)) == 1
    # another seed's multipliers: the measure sees it (chance level ~ 1 / 500)
    other = hp.reference_hashes(ids.numpy(), seed=1, **kw)
    assert hp.agreement(engram_side.hashes(model, ids), other) < 0.05
    ref = hp.reference_primes((hp.BUDGET,) * (hp.MAX_NGRAM - 1), hp.HEADS, hp.LAYERS)
    assert engram_side.primes(model) == {k: [p for o in v for p in o] for k, v in ref.items()}


def _live_engram():
    """The comparison's Engram with value and conv not zero, so the memory changes the logits."""
    from tngram.hf import add_memory

    cfg = hp.tngram_engram_config()
    cfg = dataclasses.replace(cfg, zero_init_value=False, zero_init_conv=False)
    return add_memory(hp.tiny_base(), cfg, **SIDE_ARGS)


def test_cached_gap_is_small_for_tngram_and_sees_a_perturbed_decode_step():
    model = _live_engram()
    prompt = hp.synthetic_tokens(2, 6, hp.BASE["vocab_size"], seed=4)
    assert hp.cached_gap(model, prompt, new_tokens=5) < 1e-5
    # a decode step (one token) shifted by 0.01: the measure reports 0.01 (prefill untouched)
    handle = model.register_forward_hook(
        lambda m, a, kw, out: setattr(out, "logits", out.logits + 0.01)
        if kw["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    try:
        assert hp.cached_gap(model, prompt, new_tokens=5) == pytest.approx(0.01, abs=1e-5)
    finally:
        handle.remove()


def test_eval_loss_of_uniform_logits_is_log_vocab():
    class Uniform(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 50)})()

    ids = torch.randint(0, 50, (5, 9), generator=torch.Generator().manual_seed(0))
    assert hp.eval_loss(Uniform(), ids, batch=2) == pytest.approx(np.log(50), rel=1e-6)


def test_synthetic_tokens_follow_their_rule():
    x = hp.synthetic_tokens(64, 64, hp.BASE["vocab_size"], seed=1).numpy()
    rule = np.random.default_rng(1234).integers(1, hp.RULE_IDS + 1, size=(257, 257))
    follows = (x[:, 2:] == rule[x[:, :-2], x[:, 1:-1]]).mean()
    # 80% by the rule, plus a uniform draw that hits the rule's id by chance (1/256 of 20%)
    assert abs(follows - (0.8 + 0.2 / 256)) < 0.02
    assert x.min() >= 1 and x.max() < 257


def test_tngram_resume_is_exact(engram_side, tmp_path):
    data = hp.Sequences(hp.synthetic_tokens(16, 16, hp.BASE["vocab_size"], seed=1))
    gap = hp.resume_gap(engram_side, data, steps=4, lr=1e-3, work=str(tmp_path))
    assert gap == {"weights_max_abs_diff": 0.0, "loss_abs_diff": 0.0}


def test_peer_hashes_against_the_reference():
    try:
        ep = hp.import_peer()
    except SystemExit as e:
        pytest.skip(f"engram-peft is not installed apart from tngram ({e})")
    assert ep is not None
    side = hp.peer_side(1e-3)
    model = side.build()
    ref = hp.reference_primes((hp.BUDGET,) * (hp.MAX_NGRAM - 1), hp.HEADS, hp.LAYERS)
    assert side.primes(model) == {k: [p for o in v for p in o] for k, v in ref.items()}
    # what docs/HF.md says of its hashes: the window c_{t-2}, c_{t-1}, c_t is read from its
    # oldest token, so the bigram at t is (c_{t-2}, c_{t-1}) and multiplier m_0 takes c_{t-2}
    ids = hp.synthetic_tokens(2, 30, hp.BASE["vocab_size"], seed=3)
    got = side.hashes(model, ids)
    x = np.pad(ids.numpy(), ((0, 0), (2, 0)), constant_values=hp.BASE["pad_token_id"])
    for layer in hp.LAYERS:
        m = hp.reference_multipliers(hp.BASE["vocab_size"], 3, layer, 0)
        bi = (x[:, :-2] * m[0]) ^ (x[:, 1:-1] * m[1])
        tri = bi ^ (x[:, 2:] * m[2])
        want = np.stack([bi % p for p in ref[layer][0]] + [tri % p for p in ref[layer][1]], -1)
        assert np.array_equal(got[layer], want)


# ---- the feature checks ----------------------------------------------------------------------
def test_expected_compression_by_hand():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "Cat", "cat", "CAFÉ", "cafe", "\ufb01le", "file", "Naïve", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    # case folded, accents stripped, the ligature fi (NFKC) as "fi"; numbered by first key
    assert hp.expected_compression(fast) == [0, 1, 1, 2, 2, 3, 3, 4, 5]


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return hp.TngramFeatures(str(tmp_path_factory.mktemp("features")))


def test_named_memories(ours):
    r = hp.feature(ours.named)
    assert r["result"] == "yes", r
    assert r["a_vs_b"] > 0.01  # two live memories, two networks
    assert r["switch_back"] == r["disabled_vs_base"] == r["reload_a"] == r["reload_b"] == 0


def test_compression_from_a_hugging_face_tokenizer(ours):
    pytest.importorskip("sentencepiece")
    r = hp.feature(ours.compression)
    assert r["result"] == "yes", r
    assert r["equals_sentencepiece_path"] and r["ids_equal"] == 1.0
    assert r["compressed"] < r["vocab"] == 400  # case and accents merged some ids


def test_trainable_report(ours):
    r = hp.feature(ours.trainable)
    assert r["result"] == "yes", r
    # the Engram of the comparison has 88,416 parameters (the table's row); the norm 64
    assert "trainable params: 88,480 || memory params: 88,416 (trainable 88,416)" in r["report"]


def test_memory_only_steps_on_an_8_bit_base(ours):
    pytest.importorskip("bitsandbytes")
    r = hp.bnb_guard(lambda: ours.quantized(8))
    assert r["result"] == "yes", r
    assert r["backbone_tensors_moved"] == 0 and r["losses"][-1] < r["losses"][0]


def test_sft_trainer_steps(ours):
    pytest.importorskip("trl")
    r = hp.trl_guard(ours.sft)
    assert r["result"] == "yes", r
    assert r["backbone_tensors_moved"] == 0 and len(r["losses"]) == hp.FEATURE_STEPS


def test_the_checks_can_say_no():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert hp.named_result(a, b, a, a, a, a, b)["result"] == "yes"
    assert hp.named_result(a, b, a + 1e-7, a, a, a, b)["result"] == "no"  # switch-back off
    assert hp.named_result(a, a, a, a, a, a, a)["result"] == "no"  # the two do not differ
    model = torch.nn.Linear(2, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    memory = lambda n: n == "weight"  # noqa: E731
    assert hp.training_result(before, model, memory, [1.0], "")["result"] == "no"  # not moved
    with torch.no_grad():
        model.weight.add_(1)
    assert hp.training_result(before, model, memory, [1.0], "")["result"] == "yes"
    with torch.no_grad():
        model.bias.add_(1)
    r = hp.training_result(before, model, memory, [1.0], "")
    assert r["result"] == "no" and r["backbone_tensors_moved"] == 1  # the bias moved too
    r = hp.training_result(before, model, lambda n: True, [1.0, float("nan")], "")
    assert r["result"] == "no"
    r = hp.feature(lambda: {}["missing"])
    assert r == {"result": "no", "error": "KeyError: 'missing'"}


def test_report_numbers_of_both_reports():
    ours = ("trainable params: 88,480 || memory params: 88,416 (trainable 88,416) || all params: "
            "269,344 || trainable%: 32.8502")
    peer = ("trainable params: 88,224 (backbone: 64, engram: 88,160) || all params: 269,088 || "
            "trainable%: 32.7863")
    assert hp.report_numbers(ours) == [88480, 88416, 88416, 269344]
    assert hp.report_numbers(peer) == [88224, 64, 88160, 269088]


def test_peer_feature_checks(tmp_path):
    try:
        hp.import_peer()
    except SystemExit as e:
        pytest.skip(f"engram-peft is not installed apart from tngram ({e})")
    peer = hp.PeerFeatures(str(tmp_path))
    named = hp.feature(peer.named)
    assert named["result"] == "yes" and named["switch_back"] == named["reload_b"] == 0, named
    r = hp.feature(peer.trainable)  # its Engram: 88,160 (the table's row); the norm 64
    assert r["result"] == "yes" and "(backbone: 64, engram: 88,160)" in r["report"], r


# ---- the table --------------------------------------------------------------------------------
def _snap() -> dict:
    side = {"name": "tngram Engram", "trainable_params": 88416, "hash_agreement": 1.0,
            "primes_equal": True, "eval_loss_start": 5.5, "eval_loss": 4.25,
            "cached_vs_uncached_max_abs_diff": 7.7e-7,
            "resume": {"weights_max_abs_diff": 0.0, "loss_abs_diff": 0.0}}
    peer = {**side, "name": "engram-peft", "trainable_params": 88160, "hash_agreement": 0.0103,
            "cached_vs_uncached_max_abs_diff": 3.5e-3,
            "resume": {"weights_max_abs_diff": 6e-3, "loss_abs_diff": 5e-4}}
    tn = {k: v for k, v in side.items() if k not in ("hash_agreement", "primes_equal")}
    yes = {k: {"result": "yes"} for _, k in FEATURES}
    return {"kind": "hf-peer", "command": "python -m research.experiments.hf_peer",
            "commit": "abc1234",
            "machine": "2-core CPU", "steps": 60, "learning_rate": 3e-3, "table_lr_multiplier": 5.0,
            "base": {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 257, "layers": [1, 3],
                     "seq": 64},
            "base_cached_vs_uncached_max_abs_diff": 4.8e-7,
            "versions": {"engram-peft": "1.2.7", "transformers": "5.24.0", "peft": "0.21.2",
                         "torch": "2.13.0", "python": "3.11.7"},
            "sides": [peer, side, {**tn, "name": "tngram TN-gram"}], "feature_steps": 4,
            "features": {"engram-peft": {**yes, "trl_sft": {"result": "no",
                                                             "error": "AttributeError: x"}},
                         "tngram.hf": {**yes, "quantized_4bit": {"result": "skipped"}}}}


def test_table_rows_from_the_file():
    text = render(_snap(), "hf-peer")
    assert "| measure | engram-peft 1.2.7 | tngram Engram | tngram TN-gram |" in text
    assert "| bucket ids equal to DeepSeek's reference hashing | 1.0% | 100.0% | – |" in text
    assert "| prime table sizes equal to the reference's | yes | yes | – |" in text
    assert ("| cached vs uncached generation after training, max \\|Δ logits\\| (the base alone: "
            "4.8e\u221207) | 3.5e\u221203 | 7.7e\u221207 | 7.7e\u221207 |") in text
    assert ("| Trainer resume (30 + 30 steps) vs 60 straight, max \\|Δ weights\\| | 6.0e\u221203 "
            "| 0.0e+00 | 0.0e+00 |") in text
    assert "| eval loss after 60 steps (before: 5.5000) | 4.2500 | 4.2500 | 4.2500 |" in text
    assert "| trainable parameters | 88,160 | 88,416 | 88,416 |" in text
    assert "lr 0.003 (tables 0.015)" in text
    assert text.endswith("at commit abc1234; 2-core CPU).")
    assert "| feature, checked by running it | engram-peft 1.2.7 | tngram.hf |" in text
    assert ("| two named memories on one base: they differ, switching back and disabling are "
            "exact, each saved and loaded back is exact | yes | yes |") in text
    assert "| TRL SFTTrainer, 4 steps: the memory alone moves | no (AttributeError) | yes |" in text
    assert "| the same on a 4-bit base | yes | skipped |" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + 7 + 1 + 6


def test_table_refuses_an_unknown_feature_result():
    snap = _snap()
    snap["features"]["tngram.hf"]["named"] = {"result": "maybe"}
    with pytest.raises(Exception, match=r"features\.\*\.named\.result must be one of"):
        render(snap, "hf-peer")


def test_table_refuses_sides_from_different_starts():
    snap = _snap()
    snap["sides"][0]["eval_loss_start"] = 5.6
    with pytest.raises(Exception, match="different eval losses"):
        render(snap, "hf-peer")


def test_docs_table_equals_its_results_file():
    doc = ROOT / "docs" / "HF.md"
    snap = json.loads((ROOT / "research" / "results" / "hf-peer.json").read_text())
    block = current_block(doc.read_text(encoding="utf-8"), "hf-peer")
    assert block == render(snap, "hf-peer")
    snap["sides"][0]["eval_loss"] += 0.01          # a number of the file changed: the table differs
    assert block != render(snap, "hf-peer")
