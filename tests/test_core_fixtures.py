"""Toy tokenizer, toy "models" and a toy CORE bundle shared by the CORE tests (no tests here).

CharTokenizer: one token per character, id = ord(c) + 2 (ASCII only), BOS = 1, V = 256.

OracleLM: a logits_fn that "knows" a list of texts. At position t it looks for the longest suffix
(>= 4 chars) of the decoded prefix that is also a prefix k[:j] of a known text k, and puts logit
STRENGTH on k[j] (all other logits 0). With no match all logits are 0 (uniform). Hence, per item:
  * known MC/schema item: the gold prompt costs ~0 nats/token, every other option ~20 nats on its
    first differing token (>= log 256 = 5.55 after) -> correct;
  * unknown MC/schema item: every option costs exactly log(256) per token -> a tie -> option 0
    (nanochat picks the first minimum) -> correct iff gold == 0;
  * known LM item: the oracle predicts each continuation character -> correct;
  * unknown LM item: argmax of all-zero logits is id 0, never a character -> wrong.

The toy bundle (write_toy_bundle) has three tasks; expected accuracies follow from the rules above:
  mc_toy     (MC, 3-shot, delim "\\nAnswer: ", baseline 25): 8 items, items 3 and 7 unknown,
             gold(3) = 0 (tie -> right), gold(7) = 2 (tie -> wrong)  -> acc 7/8
  schema_toy (schema, 0-shot, baseline 50): 6 items, 3 and 5 unknown, gold(3) = 0, gold(5) = 1
             -> acc 5/6
  lm_toy     (LM, 2-shot, delim " ", baseline 0): 6 items, 4 and 5 unknown -> acc 4/6
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

V = 256
BOS = 1
STRENGTH = 20.0


class CharTokenizer:
    bos_id = BOS

    def encode(self, text: str) -> list[int]:
        assert all(ord(c) < 254 for c in text), text
        return [ord(c) + 2 for c in text]


def decode(ids: list[int]) -> str:
    return "".join("\x00" if i < 2 else chr(i - 2) for i in ids)


class OracleLM:
    """logits_fn(ids (B, T)) -> (B, T, V) that knows `known` texts (see module docstring)."""

    def __init__(self, known: list[str], min_match: int = 4):
        self.known, self.min_match = known, min_match
        self.rows = 0          # rows seen (to check how work is split between processes)
        self.max_t = 0

    def predict(self, prefix: str) -> str | None:
        best, best_j = None, self.min_match - 1
        for k in self.known:
            for j in range(min(len(prefix), len(k) - 1), best_j, -1):
                if prefix.endswith(k[:j]):
                    best, best_j = k[j], j
                    break
        return best

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        self.rows += B
        self.max_t = max(self.max_t, T)
        out = torch.zeros(B, T, V)                                   # (B, T, V)
        for b in range(B):
            text = decode(ids[b].tolist())
            for t in range(T):
                nxt = self.predict(text[: t + 1])
                if nxt is not None:
                    out[b, t, ord(nxt) + 2] = STRENGTH
        return out


def uniform_logits(ids: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return torch.zeros(ids.shape[0], ids.shape[1], vocab)


MC_WORDS = [["red", "blue", "green"], ["cat", "dog", "owl"], ["one", "two", "six"], ["sun", "moon", "star"],
            ["oak", "elm", "fir"], ["salt", "milk", "rice"], ["iron", "gold", "zinc"], ["bus", "car", "van"]]
MC_GOLD = [1, 0, 2, None, 0, 2, 1, None]    # golds of the known items
MC_UNKNOWN = {3: 0, 7: 2}                   # unknown item -> its gold
SCHEMA_UNKNOWN = {3: 0, 5: 1}
LM_UNKNOWN = {4, 5}


def mc_items() -> list[dict]:
    items = []
    for i, words in enumerate(MC_WORDS):
        gold = MC_UNKNOWN.get(i, MC_GOLD[i])
        items.append({"query": f"Q{i}: pick a word", "choices": words, "gold": gold})
    return items


def schema_items() -> list[dict]:
    pairs = [("cat", "dog"), ("hat", "cap"), ("ant", "bee"), ("pen", "ink"), ("fox", "elk"), ("jam", "tea")]
    items = []
    for i, (a, b) in enumerate(pairs):
        gold = SCHEMA_UNKNOWN.get(i, i % 2)
        items.append({"context_options": [f"S{i} the {a}", f"S{i} the {b}"],
                      "continuation": f"sat on mat {i}.", "gold": gold})
    return items


def lm_items() -> list[dict]:
    words = ["apple", "bread", "chair", "delta", "eagle", "flute"]
    return [{"context": f"L{i} the secret word is ", "continuation": w} for i, w in enumerate(words)]


def known_texts() -> list[str]:
    """What the oracle knows: the gold rendering of every known item (delimiters as in the bundle)."""
    out = []
    for i, it in enumerate(mc_items()):
        if i not in MC_UNKNOWN:
            out.append(f"{it['query']}\nAnswer: {it['choices'][it['gold']]}")
    for i, it in enumerate(schema_items()):
        if i not in SCHEMA_UNKNOWN:
            out.append(f"{it['context_options'][it['gold']]} {it['continuation']}")
    for i, it in enumerate(lm_items()):
        if i not in LM_UNKNOWN:
            out.append(f"{it['context'].strip()} {it['continuation']}")
    return out


def expected_correct() -> dict[str, list[bool]]:
    """Per-item correctness under OracleLM (module docstring rules)."""
    return {
        "mc_toy": [i not in MC_UNKNOWN or MC_UNKNOWN[i] == 0 for i in range(len(MC_WORDS))],
        "schema_toy": [i not in SCHEMA_UNKNOWN or SCHEMA_UNKNOWN[i] == 0 for i in range(6)],
        "lm_toy": [i not in LM_UNKNOWN for i in range(6)],
    }


CORE_YAML = """\
# toy bundle for tests
icl_tasks:
- label: mc_toy
  dataset_uri: toy/mc.jsonl
  num_fewshot: [3]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "  # this separates questions from answers
-
  label: schema_toy
  dataset_uri: toy/schema.jsonl
  num_fewshot: [0]
  icl_task_type: schema
- label: lm_toy
  dataset_uri: toy/lm.jsonl
  num_fewshot: [2]
  icl_task_type: language_modeling
  continuation_delimiter: ' '
"""

META_CSV = """\
Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description
mc_toy,toy,multiple_choice,3,8,25,True,
schema_toy,toy,schema,0,6,50,True,
lm_toy,toy,language_modeling,2,6,0,True,
"""


def write_toy_bundle(root: Path) -> Path:
    (root / "eval_data" / "toy").mkdir(parents=True, exist_ok=True)
    (root / "core.yaml").write_text(CORE_YAML)
    (root / "eval_meta_data.csv").write_text(META_CSV)
    for name, items in (("mc", mc_items()), ("schema", schema_items()), ("lm", lm_items())):
        (root / "eval_data" / "toy" / f"{name}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in items))
    return root
