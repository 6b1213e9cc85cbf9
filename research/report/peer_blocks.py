"""The "Compared with engram-peft" table of docs/HF.md, rendered from research/results/hf-peer.json
(kind "hf-peer", written by `python -m research.experiments.hf_peer`): one column per side, one
row per measure, every cell a field of the file."""

from __future__ import annotations

from typing import Any

from tngram.common import TngramError
from research.report.markdown import md_row, render_cell

# (row label, the field of a side, cell format); a label's {…} are filled from the file's top
ROWS: tuple[tuple[str, str, str], ...] = (
    ("bucket ids equal to DeepSeek's reference hashing", "hash_agreement", "pct:.1f"),
    ("prime table sizes equal to the reference's", "primes_equal", "yesno"),
    (
        "cached vs uncached generation after training, max \\|Δ logits\\| (the base alone: "
        "{base_gap})",
        "cached_vs_uncached_max_abs_diff",
        ".1e",
    ),
    (
        "Trainer resume ({half} + {half} steps) vs {steps} straight, max \\|Δ weights\\|",
        "resume.weights_max_abs_diff",
        ".1e",
    ),
    ("the same, \\|Δ last logged loss\\|", "resume.loss_abs_diff", ".1e"),
    ("eval loss after {steps} steps (before: {start})", "eval_loss", ".4f"),
    ("trainable parameters", "trainable_params", ","),
)

# (row label, the key of a feature check in the file's "features"); {steps}: its feature_steps
FEATURES: tuple[tuple[str, str], ...] = (
    (
        "two named memories on one base: they differ, switching back and disabling are exact, "
        "each saved and loaded back is exact",
        "named",
    ),
    (
        "{steps} memory-only steps on a bitsandbytes 8-bit base (CPU): the memory moves, the "
        "quantized backbone does not",
        "quantized_8bit",
    ),
    ("the same on a 4-bit base", "quantized_4bit"),
    (
        "compression table from a PreTrainedTokenizerFast and its tokenizer.json equal to "
        "DeepSeek's mapping",
        "hf_tokenizer_compression",
    ),
    ("TRL SFTTrainer, {steps} steps: the memory alone moves", "trl_sft"),
    ("trainable report: its backbone and memory counts right", "trainable_split"),
)
RESULTS = ("yes", "no", "not offered", "skipped")


def _feature_cell(check: Any, key: str) -> str:
    if not isinstance(check, dict) or check.get("result") not in RESULTS:
        raise TngramError(
            f"features.*.{key}.result must be one of {list(RESULTS)}, got {check!r:.60}"
        )
    error = check.get("error")
    if check["result"] == "no" and isinstance(error, str):
        return f"no ({error.split(':')[0]})"  # the exception's type; the file has its message
    return str(check["result"])


def render_features(snap: dict[str, Any]) -> list[str]:
    """The feature table: one column per library, one row per check, each cell its result."""
    feats = snap.get("features")
    if feats is None:
        return []
    if not isinstance(feats, dict) or not feats:
        raise TngramError("field 'features' must be an object {library: {check: result}}")
    version = snap["versions"].get("engram-peft", "?")
    heads = [f"{k} {version}" if k == "engram-peft" else k for k in feats]
    lines = ["", "| feature, checked by running it | " + " | ".join(heads) + " |"]
    lines.append("|" + "---|" * (len(feats) + 1))
    for label, key in FEATURES:
        cells = [_feature_cell(side.get(key), key) for side in feats.values()]
        lines.append(md_row([label.format(steps=snap.get("feature_steps", "?"))] + cells))
    return lines


def _field(side: dict[str, Any], path: str) -> Any:
    v: Any = side
    for key in path.split("."):
        if not isinstance(v, dict) or key not in v:
            return None  # a measure this side has not (no hashing: TN-gram)
        v = v[key]
    return v


def _cell(v: Any, fmt: str) -> str:
    if fmt == "yesno":
        if v is None:
            return "–"
        if not isinstance(v, bool):
            raise TngramError(f"a yes/no cell needs true or false, got {v!r:.40}")
        return "yes" if v else "no"
    return render_cell(v, fmt)


def render_peer(snap: dict[str, Any]) -> str:
    sides = snap["sides"]
    if not isinstance(sides, list) or not sides:
        raise TngramError("field 'sides' must be a non-empty list")
    steps = snap["steps"]
    starts = {_field(s, "eval_loss_start") for s in sides}
    if len(starts) != 1:
        raise TngramError(f"the sides start from different eval losses {sorted(starts)}")
    fill = {
        "steps": steps,
        "half": steps // 2,
        "start": render_cell(starts.pop(), ".4f"),
        "base_gap": render_cell(snap["base_cached_vs_uncached_max_abs_diff"], ".1e"),
    }
    v = snap["versions"]
    heads = [
        f"{s['name']} {v.get('engram-peft', '?')}" if s["name"] == "engram-peft" else s["name"]
        for s in sides
    ]
    lines = ["| measure | " + " | ".join(heads) + " |", "|" + "---|" * (len(sides) + 1)]
    for label, path, fmt in ROWS:
        lines.append(md_row([label.format(**fill)] + [_cell(_field(s, path), fmt) for s in sides]))
    lines += render_features(snap)
    lr = snap["learning_rate"]
    mult = snap["table_lr_multiplier"]
    lines.append("")
    lines.append(
        f"Tiny random Llama (hidden {snap['base']['hidden_size']}, "
        f"{snap['base']['num_hidden_layers']} layers, vocab {snap['base']['vocab_size']}), "
        f"memories at layers {tuple(snap['base']['layers'])}, backbone frozen; {steps} steps of "
        f"batch 8 x {snap['base']['seq']} tokens, lr {lr:g} (tables {lr * mult:g}); transformers "
        f"{v.get('transformers', '?')}, peft {v.get('peft', '?')}, torch {v.get('torch', '?')}, "
        + (f"trl {v['trl']}, bitsandbytes {v.get('bitsandbytes', '?')}, " if "trl" in v else "")
        + f"Python {v.get('python', '?')}."
    )
    return "\n".join(lines)
