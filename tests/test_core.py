"""CORE protocol: rendering, few-shot draws, spans, scoring, centring, bundle reading and errors.

Toy tokenizer/models/bundle: tests/test_core_fixtures.py (its docstring derives the expected
accuracies 7/8, 5/6, 4/6 of the toy tasks).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from test_core_fixtures import (BOS, CharTokenizer, OracleLM, expected_correct, known_texts,
                                mc_items, uniform_logits, write_toy_bundle)
from tngram.common import TngramError
from tngram.eval.core import (centered_accuracy, continuation_spans, core_metric, crop_left,
                              evaluate_core, fewshot_indices, format_core_table, plan_batches,
                              prepare_examples, render_lm, render_mc, render_schema, score_batch,
                              select_examples)
from tngram.eval.bundle_read import BundleTask, load_bundle, parse_core_yaml
from tngram.eval.tasks import LM, MC, SCHEMA, TASKS_BY_LABEL


# ---------------------------------------------------------------- centring vs the public nanochat log
# nanochat's published CORE log for a base model, per task
# (raw accuracy, centred) as printed by nanochat; LM tasks have baseline 0 so centred == raw.
NANOCHAT_LOG = {
    "hellaswag_zeroshot": (0.304023, 0.072031), "jeopardy": (0.009920, 0.009920),
    "bigbench_qa_wikidata": (0.320407, 0.320407), "arc_easy": (0.510522, 0.347363),
    "arc_challenge": (0.258532, 0.011377), "copa": (0.600000, 0.200000),
    "commonsense_qa": (0.285012, 0.106265), "piqa": (0.620239, 0.240479),
    "openbook_qa": (0.296000, 0.061333), "lambada_openai": (0.252086, 0.252086),
    "hellaswag": (0.304621, 0.072827), "winograd": (0.553114, 0.106227),
    "winogrande": (0.516180, 0.032360), "bigbench_dyck_languages": (0.143000, 0.143000),
    "agi_eval_lsat_ar": (0.269565, 0.086956), "bigbench_cs_algorithms": (0.368939, 0.368939),
    "bigbench_operators": (0.109524, 0.109524), "bigbench_repeat_copy_logic": (0.000000, 0.000000),
    "squad": (0.035478, 0.035478), "coqa": (0.078542, 0.078542),
    "boolq": (0.542813, -0.203123), "bigbench_language_identification": (0.252300, 0.177448),
}


def test_centering_matches_nanochat_log_with_v1_baselines() -> None:
    # e.g. arc_easy: (0.510522 - 0.25) / 0.75 = 0.347363;  boolq: (0.542813 - 0.62) / 0.38 = -0.203124
    # (log prints -0.203123: its inputs are 6-decimal roundings, so allow 2e-6 = 5e-7 / 0.38 + slack)
    assert set(NANOCHAT_LOG) == set(TASKS_BY_LABEL)
    for label, (raw, cen) in NANOCHAT_LOG.items():
        assert centered_accuracy(raw, TASKS_BY_LABEL[label].baseline) == pytest.approx(cen, abs=2e-6), label


def test_baselines_implied_by_the_log_are_v1() -> None:
    # Invert centred = (a - b)/(1 - b):  b = (a - c)/(1 - c). commonsense_qa: (0.285012-0.106265)/
    # (1-0.106265) = 0.2000 (v1; v2 would be 0.403); language_id: (0.2523-0.177448)/0.822552 = 0.0910.
    for label, (raw, cen) in NANOCHAT_LOG.items():
        if raw != cen:
            implied = 100 * (raw - cen) / (1 - cen)
            assert implied == pytest.approx(TASKS_BY_LABEL[label].baseline, abs=0.01), label


def test_core_is_the_mean_of_centred_values() -> None:
    # sum of the 22 centred values in the log = 2.629439 -> / 22 = 0.1195200 (the printed CORE 0.119520)
    core = core_metric({k: c for k, (_, c) in NANOCHAT_LOG.items()})
    assert core == pytest.approx(0.119520, abs=1e-6)
    # recomputing every centred value from raw accuracies and v1 baselines gives the same CORE
    recomputed = core_metric({k: centered_accuracy(a, TASKS_BY_LABEL[k].baseline) for k, (a, _) in NANOCHAT_LOG.items()})
    assert recomputed == pytest.approx(0.119520, abs=1e-6)
    with pytest.raises(TngramError):
        centered_accuracy(0.5, 100.0)


# ---------------------------------------------------------------- rendering, few-shot, spans
def test_render_mc_matches_nanochat_template() -> None:
    # DCLM/nanochat CORE few-shot format: D = "\nAnswer: ", 2 shots -> 'FQ1\nAnswer: x\n\nFQ2\nAnswer: y\n\nQ1?\nAnswer: a'
    shots = [{"query": "FQ1", "choices": ["x", "z"], "gold": 0}, {"query": "FQ2", "choices": ["w", "y"], "gold": 1}]
    item = {"query": "Q1?", "choices": ["a", "b"], "gold": 0}
    assert render_mc(item, "\nAnswer: ", shots) == ["FQ1\nAnswer: x\n\nFQ2\nAnswer: y\n\nQ1?\nAnswer: a",
                                                    "FQ1\nAnswer: x\n\nFQ2\nAnswer: y\n\nQ1?\nAnswer: b"]
    assert render_mc(item, " ", []) == ["Q1? a", "Q1? b"]


def test_render_schema_and_lm() -> None:
    shot = {"context_options": ["A1", "A2"], "continuation": "c0.", "gold": 1}
    item = {"context_options": ["B1", "B2"], "continuation": "c1.", "gold": 0}
    assert render_schema(item, " ", [shot]) == ["A2 c0.\n\nB1 c1.", "A2 c0.\n\nB2 c1."]
    # LM: contexts are trimmed; "without" is stripped (drops the delimiter's trailing space)
    shot_lm = {"context": "  ctx0 \n", "continuation": "y0"}
    item_lm = {"context": "ctx1  ", "continuation": "y1"}
    assert render_lm(item_lm, " ", [shot_lm]) == ["ctx0 y0\n\nctx1", "ctx0 y0\n\nctx1 y1"]


@pytest.mark.parametrize("n", [2, 5, 30, 2000])
def test_fewshot_draw_equals_nanochat_formula(n: int) -> None:
    # nanochat: Random(1234 + idx).sample([j for j in range(n) if j != idx], k). Our lazy version must
    # give the same indices, for the small-population (list) and large (set) branches of sample().
    for idx in {0, 1, n // 2, n - 1}:
        for k in (0, 1, 3, 10):
            kk = min(k, n - 1)
            naive = random.Random(1234 + idx).sample([j for j in range(n) if j != idx], kk)
            assert fewshot_indices(n, idx, k) == naive
            assert idx not in fewshot_indices(n, idx, k)


def test_spans_follow_the_three_task_types() -> None:
    # MC: common prefix of [1,5,6,7] and [1,5,6,8,9] is 3 tokens -> spans [3:4] and [3:5]
    assert continuation_spans(MC, [[1, 5, 6, 7], [1, 5, 6, 8, 9]]) == ([[1, 5, 6, 7], [1, 5, 6, 8, 9]], [3, 3], [4, 5])
    # schema: common suffix [9, 9] (2 tokens) -> spans [3:5] and [2:4]
    assert continuation_spans(SCHEMA, [[1, 2, 3, 9, 9], [1, 4, 9, 9]])[1:] == ([3, 2], [5, 4])
    # LM: "without" [1,2,3] is a prefix of "with" [1,2,3,4,5] -> one row, span [3:5]
    assert continuation_spans(LM, [[1, 2, 3], [1, 2, 3, 4, 5]]) == ([[1, 2, 3, 4, 5]], [3], [5])
    # LM, tokenisation not a clean prefix: score from the common prefix (2), not crash
    assert continuation_spans(LM, [[1, 2, 7], [1, 2, 3, 4]]) == ([[1, 2, 3, 4]], [2], [4])


def test_crop_left_keeps_the_end() -> None:
    seq = list(range(10))
    # 10 tokens, max 5 -> drop 5 from the left; span [6:10] -> [1:5]
    assert crop_left(seq, 6, 10, 5) == ([5, 6, 7, 8, 9], 1, 5)
    # span starting inside the cut part is clamped to 1 (position 0 has no prediction)
    assert crop_left(seq, 3, 10, 5) == ([5, 6, 7, 8, 9], 1, 5)
    assert crop_left(seq, 6, 10, None) == (seq, 6, 10)


# ---------------------------------------------------------------- scoring
def _task(ttype: str, shots: int = 0, delim: str = " ") -> BundleTask:
    return BundleTask("t", "t.jsonl", ttype, shots, delim, 25.0, Path("t.jsonl"))


def bias_x_logits(ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(ids.shape[0], ids.shape[1], 256)
    out[..., ord("x") + 2] = 4.0
    return out


def test_mc_uses_mean_not_sum_of_continuation_loss() -> None:
    # logits +4 on 'x', 0 elsewhere (V=256): p(x) = e^4/(e^4+255) = 0.1764 -> 1.735 nats; any other
    # char: ln(e^4+255) = 5.735 nats. Choice A "xxxxxxxxq" (span = 9 chars after the common "pick "):
    # mean (8*1.735 + 5.735)/9 = 2.180, sum 19.62.  Choice B "q": mean = sum = 5.735.
    # Mean picks A (index 0); a sum would pick B.
    tok = CharTokenizer()
    for gold, want in ((0, True), (1, False)):
        data = [{"query": "pick", "choices": ["xxxxxxxxq", "q"], "gold": gold}]
        ex = prepare_examples(_task(MC), data, tok, None)
        assert score_batch(bias_x_logits, ex, BOS, MC) == [want]


def test_mc_ties_pick_the_first_option() -> None:
    # uniform logits: every option costs ln 256 per token -> tie -> option 0
    tok = CharTokenizer()
    data = [{"query": "q", "choices": ["ab", "cd", "ef"], "gold": g} for g in range(3)]
    ex = prepare_examples(_task(MC), data, tok, None)
    assert score_batch(uniform_logits, ex, BOS, MC) == [True, False, False]


def test_batching_does_not_change_results(tmp_path: Path) -> None:
    bundle = write_toy_bundle(tmp_path)
    one = evaluate_core(OracleLM(known_texts()), CharTokenizer(), bundle, batch_tokens=1, progress=False)
    big = evaluate_core(OracleLM(known_texts()), CharTokenizer(), bundle, batch_tokens=1 << 20, progress=False)
    assert {k: v["accuracy"] for k, v in one["tasks"].items()} == {k: v["accuracy"] for k, v in big["tasks"].items()}


def test_plan_batches_respects_the_token_budget() -> None:
    tok = CharTokenizer()
    ex = prepare_examples(_task(MC, 2), mc_items(), tok, None)
    for budget in (1, 200, 400, 10_000):
        batches = plan_batches(ex, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(ex)))
        for b in batches:
            rows = sum(len(ex[i].seqs) for i in b)
            if len(b) > 1:
                assert rows * max(ex[i].longest for i in b) <= budget


# ---------------------------------------------------------------- the toy bundle end to end
def test_toy_bundle_accuracies_and_core(tmp_path: Path) -> None:
    # fixture docstring: mc 7/8, schema 5/6, lm 4/6. Centred: (0.875-0.25)/0.75 = 0.833333,
    # (5/6-0.5)/0.5 = 0.666667, 4/6 = 0.666667 -> CORE = 2.166667/3 = 0.722222
    res = evaluate_core(OracleLM(known_texts()), CharTokenizer(), write_toy_bundle(tmp_path), progress=False)
    acc = {k: v["accuracy"] for k, v in res["tasks"].items()}
    assert acc == pytest.approx({"mc_toy": 7 / 8, "schema_toy": 5 / 6, "lm_toy": 4 / 6})
    assert res["tasks"]["mc_toy"]["centered"] == pytest.approx(0.833333, abs=1e-6)
    assert res["core"] == pytest.approx(0.722222, abs=1e-6)
    assert [res["tasks"][k]["n"] for k in acc] == [8, 6, 6]
    assert res["bundle"]["flavor"].startswith("external")
    assert "CORE 0.7222 over 3 tasks" in format_core_table(res)
    json.dumps(res)  # JSON-serialisable


def test_max_per_task_sample_is_deterministic(tmp_path: Path) -> None:
    bundle = write_toy_bundle(tmp_path)
    a = evaluate_core(OracleLM(known_texts()), CharTokenizer(), bundle, max_per_task=4, progress=False)
    b = evaluate_core(OracleLM(known_texts()), CharTokenizer(), bundle, max_per_task=4, progress=False)
    assert {k: v["accuracy"] for k, v in a["tasks"].items()} == {k: v["accuracy"] for k, v in b["tasks"].items()}
    # the sample is nanochat's: shuffle with Random(1337), keep the first 4; its accuracy is the mean
    # of the fixture's per-item correctness over exactly those items
    want = expected_correct()
    for label, res in a["tasks"].items():
        items = list(range(len(want[label])))
        chosen = select_examples(items, 4, 1337)
        shuffled = list(items)
        random.Random(1337).shuffle(shuffled)
        assert chosen == shuffled[:4]
        assert res["n"] == 4
        assert res["accuracy"] == pytest.approx(sum(want[label][i] for i in chosen) / 4)


def test_prompts_are_cropped_to_max_seq_len(tmp_path: Path) -> None:
    # longest toy prompt is ~118 chars; with max_seq_len 40 the few-shot prefix is cut away but the
    # item text (<= 32 chars + continuation) survives, so the oracle's answers are unchanged
    model = OracleLM(known_texts())
    res = evaluate_core(model, CharTokenizer(), write_toy_bundle(tmp_path), max_seq_len=40, progress=False)
    assert model.max_t <= 40
    assert {k: v["accuracy"] for k, v in res["tasks"].items()} == pytest.approx(
        {"mc_toy": 7 / 8, "schema_toy": 5 / 6, "lm_toy": 4 / 6})


def test_logits_fn_max_seq_len_attribute_is_used(tmp_path: Path) -> None:
    model = OracleLM(known_texts())
    model.max_seq_len = 33  # type: ignore[attr-defined]
    evaluate_core(model, CharTokenizer(), write_toy_bundle(tmp_path), progress=False)
    assert model.max_t <= 33


# ---------------------------------------------------------------- core.yaml (PyYAML)
def test_parse_core_yaml_dclm_style() -> None:
    text = (
        "epoch: 1.25T\nmodel:\n  name: open_lm\n  init_device: cpu\n\n"
        "icl_tasks:\n-\n  label: jeopardy\n  dataset_uri: world_knowledge/jeopardy_all.jsonl # c\n"
        "  num_fewshot: [10]\n  icl_task_type: language_modeling\n"
        "  continuation_delimiter: \"\\nAnswer: \" # this separates questions from answers\n"
        "  has_categories: true\n"
        "- label: 'copa'\n  dataset_uri: commonsense_reasoning/copa.jsonl\n  num_fewshot: [0]\n"
        "  icl_task_type: multiple_choice\n  metric_names:\n    - InContextLearningMCAccuracy\n"
        "  continuation_delimiter: ' # not a comment'\n"
        "other_top_level: 3\n"
    )
    tasks = parse_core_yaml(text)
    assert tasks == [
        {"label": "jeopardy", "dataset_uri": "world_knowledge/jeopardy_all.jsonl", "num_fewshot": [10],
         "icl_task_type": "language_modeling", "continuation_delimiter": "\nAnswer: ", "has_categories": True},
        {"label": "copa", "dataset_uri": "commonsense_reasoning/copa.jsonl", "num_fewshot": [0],
         "icl_task_type": "multiple_choice", "metric_names": ["InContextLearningMCAccuracy"],
         "continuation_delimiter": " # not a comment"},
    ]
    with pytest.raises(TngramError, match="icl_tasks"):
        parse_core_yaml("tasks: []\n", "x/core.yaml")
    with pytest.raises(TngramError, match="x/core.yaml: not valid YAML"):
        parse_core_yaml("icl_tasks:\n- label: [unclosed\n", "x/core.yaml")
    with pytest.raises(TngramError, match="list of task entries"):
        parse_core_yaml("icl_tasks: 3\n", "x/core.yaml")


# ---------------------------------------------------------------- corrupt / partial bundles: one clear error
def _never_called(ids: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the model must not run on a broken bundle")


def _expect(bundle: Path, *needles: str) -> None:
    with pytest.raises(TngramError) as e:
        evaluate_core(_never_called, CharTokenizer(), bundle, progress=False)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_missing_folder_and_core_yaml(tmp_path: Path) -> None:
    _expect(tmp_path / "nope", str(tmp_path / "nope"), "does not exist")
    b = write_toy_bundle(tmp_path / "b")
    (b / "core.yaml").unlink()
    _expect(b, str(b / "core.yaml"), "missing")


def test_missing_jsonl_names_the_file(tmp_path: Path) -> None:
    b = write_toy_bundle(tmp_path)
    (b / "eval_data" / "toy" / "schema.jsonl").unlink()
    _expect(b, str(b / "eval_data" / "toy" / "schema.jsonl"), "schema_toy")


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    b = write_toy_bundle(tmp_path)
    f = b / "eval_data" / "toy" / "lm.jsonl"
    lines = f.read_text().splitlines()
    lines[2] = lines[2][:-5]                        # truncate line 3
    f.write_text("\n".join(lines) + "\n")
    _expect(b, str(f), "line 3", "malformed JSON")


def test_bad_record_names_file_and_line(tmp_path: Path) -> None:
    b = write_toy_bundle(tmp_path)
    f = b / "eval_data" / "toy" / "mc.jsonl"
    lines = f.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["gold"] = 7                                  # 3 choices -> gold must be in [0, 3)
    lines[1] = json.dumps(rec)
    f.write_text("\n".join(lines) + "\n")
    _expect(b, str(f), "line 2", "'gold'")


def test_unknown_task_type(tmp_path: Path) -> None:
    b = write_toy_bundle(tmp_path)
    y = b / "core.yaml"
    y.write_text(y.read_text().replace("icl_task_type: schema", "icl_task_type: generation"))
    _expect(b, str(y), "unknown icl_task_type 'generation'", "schema_toy")


def test_missing_baseline_and_meta_file(tmp_path: Path) -> None:
    b = write_toy_bundle(tmp_path)
    m = b / "eval_meta_data.csv"
    m.write_text("\n".join(ln for ln in m.read_text().splitlines() if not ln.startswith("lm_toy")) + "\n")
    _expect(b, str(m), "lm_toy", "Random baseline")
    m.unlink()
    _expect(b, str(m), "missing")


def test_load_bundle_reads_tasks(tmp_path: Path) -> None:
    bundle = load_bundle(write_toy_bundle(tmp_path))
    assert [(t.label, t.task_type, t.shots, t.delimiter, t.baseline) for t in bundle.tasks] == [
        ("mc_toy", MC, 3, "\nAnswer: ", 25.0), ("schema_toy", SCHEMA, 0, " ", 50.0), ("lm_toy", LM, 2, " ", 0.0)]


# ---------------------------------------------------------------- SentencePiece adapter
def test_sentencepiece_adapter_end_to_end(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    from tngram.eval.core import SentencePieceTokenizer
    corpus = [f"{it['query']} {' '.join(it['choices'])}" for it in mc_items()] * 20 + \
             ["the secret word is apple bread chair delta eagle flute sat on mat"] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=120, model_type="bpe", bos_id=1, eos_id=2, pad_id=0, unk_id=3,
                                   character_coverage=1.0, minloglevel=2)
    tok = SentencePieceTokenizer(tmp_path / "sp.model")
    assert tok.bos_id == 1
    ids = tok.encode("pick a word")
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.encode_batch(["pick a word", "red"]) == [ids, tok.encode("red")]
    # uniform logits: MC/schema ties pick option 0, LM argmax is id 0 (pad, never produced) ->
    # accuracy = share of gold == 0: mc golds [1,0,2,0,0,2,1,2] -> 3/8; schema [0,1,0,0,0,1] -> 4/6; lm 0
    res = evaluate_core(lambda ids: uniform_logits(ids, 120), tok, write_toy_bundle(tmp_path / "b"), progress=False)
    assert {k: v["accuracy"] for k, v in res["tasks"].items()} == pytest.approx(
        {"mc_toy": 3 / 8, "schema_toy": 4 / 6, "lm_toy": 0.0})
    with pytest.raises(TngramError, match="not found"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    assert math.isfinite(res["core"])
