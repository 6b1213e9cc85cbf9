"""The CORE metric (DCLM's centred in-context-learning average) as nanochat evaluates it.

Protocol of nanochat's CORE evaluation, re-implemented from its description (docs/EVAL.md):

* Bundle: `core.yaml` (task list), `eval_data/**.jsonl` (llm-foundry ICL records),
  `eval_meta_data.csv` ("Eval Task" -> "Random baseline", percent). nanochat's `eval_bundle` and
  our `tngram eval build-bundle` output both work.
* Per task: the jsonl list is shuffled with `random.Random(seed=1337)` and cut to `max_per_task`;
  item i draws its few-shot examples with `random.Random(1234 + i).sample(others, k)` from that
  same list (others = every index but i).
* Prompts: few-shot examples each followed by a blank line ("\\n\\n"), then the item.
    MC      one prompt per choice:  query + D + choice
    schema  one prompt per option:  option + D + continuation
    LM      context.strip() + D, stripped ("without"), and + continuation ("with")
  Every prompt is tokenised with BOS prepended; prompts longer than `max_seq_len` keep their last
  `max_seq_len` tokens.
* Scored span: MC = after the tokens common to all choices; schema = the tokens common to the end
  of all options; LM = the tokens of "with" after "without".
* Scoring: MC/schema pick the lowest *mean* cross-entropy over the span (first on ties); LM is
  correct iff the greedy argmax equals every continuation token (teacher forced).
* centred = (acc - b/100) / (1 - b/100);  CORE = mean of centred over the bundle's tasks.

Differences from nanochat, all in corner cases where nanochat asserts or returns NaN: an LM
"without" prompt whose tokens are not a prefix of "with" is scored from their common prefix; a
choice whose scored span is empty gets loss +inf; fewer than `shots` other items -> fewer shots.

Speed: several examples go into one padded forward (right padding with BOS; batches are planned
from token counts, longest first, within `batch_tokens` = rows x longest row). With N processes
the batches, not the examples, are strided over ranks and a per-example correctness vector is
summed with all_reduce, so every batch is computed exactly as on one process and the results are
identical for any N.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from tngram.common import MissingFileError, TngramError, print0
from tngram.eval.bundle_read import BundleTask, load_bundle, load_task_data
from tngram.eval.tasks import LM, MC, SCHEMA

FEWSHOT_SEED_BASE = 1234  # nanochat: random.Random(1234 + idx)
FEWSHOT_SEP = "\n\n"


class Tokenizer(Protocol):
    bos_id: int

    def encode(self, text: str) -> list[int]: ...


class SentencePieceTokenizer:
    """`encode`/`bos_id` adapter for a SentencePiece model (parameter-golf spec: BOS id 1)."""

    def __init__(self, model_file: str | Path):
        from tngram.data.tokenizer import load_tokenizer

        path = Path(model_file)
        if not path.is_file():
            raise MissingFileError(f"tokenizer model {path} not found")
        self.sp = load_tokenizer(path)  # no FIFO; a path that is not UTF-8 read as bytes
        self.bos_id = int(self.sp.bos_id())
        if self.bos_id < 0:
            raise TngramError(f"{path} has no BOS token; CORE prepends BOS to every prompt")

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self.sp.encode(texts)]


# ------------------------------------------------------------------ few-shot sampling and rendering
def fewshot_indices(n: int, idx: int, k: int) -> list[int]:
    """nanochat's draw: Random(1234 + idx).sample([j for j in range(n) if j != idx], k). sample
    draws positions alone, so sampling range(n - 1) and skipping idx draws the same, in O(k)."""
    k = min(k, n - 1)
    if k <= 0:
        return []
    return [j + (j >= idx) for j in random.Random(FEWSHOT_SEED_BASE + idx).sample(range(n - 1), k)]


def render_mc(item: dict, delim: str, shots: list[dict]) -> list[str]:
    head = "".join(f"{s['query']}{delim}{s['choices'][s['gold']]}{FEWSHOT_SEP}" for s in shots)
    return [f"{head}{item['query']}{delim}{c}" for c in item["choices"]]


def render_schema(item: dict, delim: str, shots: list[dict]) -> list[str]:
    head = "".join(
        f"{s['context_options'][s['gold']]}{delim}{s['continuation']}{FEWSHOT_SEP}" for s in shots
    )
    return [f"{head}{opt}{delim}{item['continuation']}" for opt in item["context_options"]]


def render_lm(item: dict, delim: str, shots: list[dict]) -> list[str]:
    """[prompt without continuation (stripped), prompt with continuation]."""
    head = "".join(f"{s['context'].strip()}{delim}{s['continuation']}{FEWSHOT_SEP}" for s in shots)
    base = f"{head}{item['context'].strip()}{delim}"
    return [base.strip(), base + item["continuation"]]


RENDER = {MC: render_mc, SCHEMA: render_schema, LM: render_lm}


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    m = min(len(s) for s in seqs)
    for i in range(m):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return m


def common_suffix_len(seqs: Sequence[Sequence[int]]) -> int:
    return common_prefix_len([list(reversed(s)) for s in seqs])


def continuation_spans(
    task_type: str, tokens: list[list[int]]
) -> tuple[list[list[int]], list[int], list[int]]:
    """(sequences to run, start, end): the scored targets of row r are tokens[r][start:end]."""
    if task_type == MC:
        s = common_prefix_len(tokens)
        return tokens, [s] * len(tokens), [len(t) for t in tokens]
    if task_type == SCHEMA:
        k = common_suffix_len(tokens)
        return tokens, [len(t) - k for t in tokens], [len(t) for t in tokens]
    without, with_ = tokens
    start = common_prefix_len([without, with_])  # == len(without) when it is a clean prefix
    return [with_], [start], [len(with_)]


def crop_left(
    seq: list[int], start: int, end: int, max_len: int | None
) -> tuple[list[int], int, int]:
    """Keep the last max_len tokens; shift the span. Position 0 has no prediction, so start >= 1."""
    if max_len is None or len(seq) <= max_len:
        return seq, max(start, 1), end
    cut = len(seq) - max_len
    return seq[cut:], max(start - cut, 1), end - cut


# ------------------------------------------------------------------ examples, batches, scoring
@dataclass
class Example:
    idx: int
    seqs: list[list[int]]  # token rows (BOS first)
    starts: list[int]
    ends: list[int]
    gold: int | None  # None for LM

    @property
    def longest(self) -> int:
        return max(len(s) for s in self.seqs)


def _encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(texts) if callable(batch) else [tokenizer.encode(t) for t in texts]


def prepare_examples(
    task: BundleTask, data: list[dict], tokenizer: Tokenizer, max_seq_len: int | None
) -> list[Example]:
    """Render, tokenise (BOS prepended), find spans and crop every example of a task."""
    render = RENDER[task.task_type]
    prompts = [
        render(item, task.delimiter, [data[j] for j in fewshot_indices(len(data), i, task.shots)])
        for i, item in enumerate(data)
    ]
    flat = _encode_all(tokenizer, [p for ps in prompts for p in ps])
    bos = int(tokenizer.bos_id)
    out: list[Example] = []
    pos = 0
    for i, ps in enumerate(prompts):
        toks = [[bos, *t] for t in flat[pos : pos + len(ps)]]
        pos += len(ps)
        seqs, starts, ends = continuation_spans(task.task_type, toks)
        cropped = [crop_left(s, a, b, max_seq_len) for s, a, b in zip(seqs, starts, ends)]
        seqs, starts, ends = map(list, zip(*cropped))
        gold = None if task.task_type == LM else int(data[i]["gold"])
        out.append(Example(i, seqs, starts, ends, gold))
    return out


def plan_batches(examples: list[Example], batch_tokens: int) -> list[list[int]]:
    """Group example indices (longest first) so that rows x longest row <= batch_tokens."""
    order = sorted(range(len(examples)), key=lambda i: -examples[i].longest)
    batches: list[list[int]] = []
    cur: list[int] = []
    rows = width = 0
    for i in order:
        ex = examples[i]
        r, w = len(ex.seqs), max(width, ex.longest)
        if cur and (rows + r) * w > batch_tokens:
            batches.append(cur)
            cur, rows, w = [], 0, ex.longest
        cur.append(i)
        rows, width = rows + r, w
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def score_batch(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    batch: list[Example],
    pad_id: int,
    task_type: str,
    device: torch.device | str = "cpu",
) -> list[bool]:
    """One padded forward for several examples; returns correctness per example."""
    rows = [(e, r) for e in batch for r in range(len(e.seqs))]
    T = max(len(e.seqs[r]) for e, r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # (R, T)
    for k, (e, r) in enumerate(rows):
        ids[k, : len(e.seqs[r])] = torch.tensor(e.seqs[r], dtype=torch.long)
    ids = ids.to(device)
    logits = logits_fn(ids)  # (R, T, V)
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise TngramError(
            f"logits_fn returned shape {tuple(logits.shape)} for input {tuple(ids.shape)}"
        )
    row_of: list[int] = []
    pos_of: list[int] = []
    for k, (e, r) in enumerate(rows):
        row_of += [k] * (e.ends[r] - e.starts[r])
        pos_of += range(e.starts[r] - 1, e.ends[r] - 1)  # predict t+1 from t
    seg = torch.tensor(row_of, dtype=torch.long, device=ids.device)  # (P,) row of each target
    pos_t = torch.tensor(pos_of, dtype=torch.long, device=ids.device)  # (P,)
    sel = logits[seg, pos_t].float()  # (P, V)
    tgt = ids[seg, pos_t + 1]  # (P,)
    R = len(rows)
    if task_type == LM:
        miss = (sel.argmax(-1) != tgt).long()  # (P,)
        wrong = torch.zeros(R, dtype=torch.long, device=ids.device).index_add_(0, seg, miss)
        count = torch.zeros(R, dtype=torch.long, device=ids.device).index_add_(
            0, seg, torch.ones_like(miss)
        )
        return [bool(count[k] > 0 and wrong[k] == 0) for k in range(R)]
    nll = F.cross_entropy(sel, tgt, reduction="none").double()  # (P,)
    total = torch.zeros(R, dtype=torch.float64, device=ids.device).index_add_(0, seg, nll)
    count = torch.zeros(R, dtype=torch.float64, device=ids.device).index_add_(
        0, seg, torch.ones_like(nll)
    )
    mean = torch.where(
        count > 0, total / count.clamp(min=1), torch.full_like(total, math.inf)
    ).tolist()
    out, k = [], 0
    for e in batch:
        losses = mean[k : k + len(e.seqs)]
        k += len(e.seqs)
        pred = min(range(len(losses)), key=lambda i: losses[i])  # first on ties
        out.append(pred == e.gold)
    return out


# ------------------------------------------------------------------ tasks and the CORE aggregate
def centered_accuracy(accuracy: float, baseline_percent: float) -> float:
    """DCLM centring: 0 at the random baseline, 1 at perfect accuracy."""
    b = 0.01 * baseline_percent
    if not 0.0 <= b < 1.0:
        raise TngramError(f"random baseline {baseline_percent}% must be in [0, 100)")
    return (accuracy - b) / (1.0 - b)


def core_metric(centered: dict[str, float]) -> float:
    """CORE = plain mean of the centred accuracies."""
    if not centered:
        raise TngramError("no tasks to average")
    return sum(centered.values()) / len(centered)


def select_examples(data: list[dict], max_per_task: int | None, seed: int = 1337) -> list[dict]:
    """nanochat's subset: shuffle with Random(seed), keep the first max_per_task (None/<=0: all)."""
    data = list(data)
    random.Random(seed).shuffle(data)
    return data[:max_per_task] if max_per_task and max_per_task > 0 else data


def _dist_active(world_size: int) -> bool:
    if world_size <= 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise TngramError(f"world_size={world_size} but torch.distributed is not initialised")
    return True


def evaluate_task(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Tokenizer,
    task: BundleTask,
    data: list[dict],
    max_seq_len: int | None = None,
    batch_tokens: int = 8192,
    ddp_rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """Accuracy of one task on the given (already selected) items."""
    t0 = time.perf_counter()
    examples = prepare_examples(task, data, tokenizer, max_seq_len)
    batches = plan_batches(examples, batch_tokens)
    correct = torch.zeros(len(examples), dtype=torch.float64)  # (n,)
    mine = batches[ddp_rank::world_size]
    for b in tqdm(mine, desc=task.label, leave=False, disable=not progress or ddp_rank != 0):
        ok = score_batch(
            logits_fn, [examples[i] for i in b], int(tokenizer.bos_id), task.task_type, device
        )
        for i, c in zip(b, ok):
            correct[i] = float(c)
    if _dist_active(world_size):
        backend_dev = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        buf = correct.to(backend_dev)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        correct = buf.cpu()
    n = len(examples)
    acc = float(correct.sum().item()) / n
    secs = time.perf_counter() - t0
    return {
        "accuracy": acc,
        "centered": centered_accuracy(acc, task.baseline),
        "n": n,
        "type": task.task_type,
        "shots": task.shots,
        "baseline": task.baseline,
        "seconds": round(secs, 3),
        "examples_per_s": round(n / secs, 2) if secs > 0 else None,
    }


def evaluate_core(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Tokenizer,
    bundle_dir: str | Path,
    max_per_task: int | None = None,
    seed: int = 1337,
    ddp_rank: int = 0,
    world_size: int = 1,
    max_seq_len: int | None = None,
    batch_tokens: int = 8192,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """CORE over every task of a bundle.

    logits_fn(ids (B, T) long) -> logits (B, T, V); tokenizer has encode(str) -> list[int] and
    bos_id. max_seq_len defaults to `logits_fn.max_seq_len` if present (prompts are cropped from
    the left). Returns {"core", "tasks": {label: {"accuracy", "centered", "n", ...}}, "bundle",
    ...}.
    All processes must call this (collective) when world_size > 1.
    """
    if max_seq_len is None:
        max_seq_len = getattr(logits_fn, "max_seq_len", None)
    if batch_tokens < 1:
        raise TngramError(f"batch_tokens must be >= 1, got {batch_tokens}")
    bundle = load_bundle(bundle_dir)
    datasets = {
        t.label: load_task_data(bundle, t) for t in bundle.tasks
    }  # validates everything first
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for task in bundle.tasks:
        data = select_examples(datasets[task.label], max_per_task, seed)
        results[task.label] = evaluate_task(
            logits_fn,
            tokenizer,
            task,
            data,
            max_seq_len,
            batch_tokens,
            ddp_rank,
            world_size,
            device,
            progress,
        )
        r = results[task.label]
        print0(
            f"  {task.label:<34} acc {r['accuracy']:.4f}  centered {r['centered']:+.4f}  "
            f"n {r['n']:>6}  {r['examples_per_s'] or 0:>8.1f} ex/s"
        )
    secs = time.perf_counter() - t0
    n_total = sum(r["n"] for r in results.values())
    return {
        "core": core_metric({k: v["centered"] for k, v in results.items()}),
        "tasks": results,
        "n_tasks": len(results),
        "examples": n_total,
        "seconds": round(secs, 2),
        "examples_per_s": round(n_total / secs, 2) if secs > 0 else None,
        "max_per_task": max_per_task if max_per_task and max_per_task > 0 else None,
        "seed": seed,
        "max_seq_len": max_seq_len,
        "bundle": bundle.describe(),
    }


def format_core_table(result: dict[str, Any]) -> str:
    """Plain-text table of a result dict from evaluate_core."""
    lines = [
        f"{'task':<34}{'type':>6}{'shots':>6}{'n':>7}{'acc':>9}{'base%':>7}{'centered':>10}",
        "-" * 79,
    ]
    short = {MC: "MC", SCHEMA: "schema", LM: "LM"}
    for label, r in result["tasks"].items():
        lines.append(
            f"{label:<34}{short.get(r.get('type', ''), '?'):>6}{r.get('shots', ''):>6}{r['n']:>7}"
            f"{r['accuracy']:>9.4f}{r.get('baseline', 0):>7g}{r['centered']:>+10.4f}"
        )
    b = result.get("bundle", {})
    lines.append("-" * 79)
    lines.append(
        f"CORE {result['core']:.4f} over {result.get('n_tasks', len(result['tasks']))} tasks "
        f"[{b.get('flavor', '?')}]  {result.get('examples', 0)} examples in "
        f"{result.get('seconds', 0):.1f} s ({result.get('examples_per_s') or 0:.1f} ex/s)"
    )
    if b.get("not_built"):
        lines.append("not in bundle: " + ", ".join(b["not_built"]))
    if b.get("partial"):
        lines.append(
            "partial in bundle: "
            + "; ".join(f"{k} ({v.split(':')[0]})" for k, v in b["partial"].items())
        )
    return "\n".join(lines)
