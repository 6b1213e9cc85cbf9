"""Evaluate an exported model (`tngram export RUN --hf DIR`) with lm-evaluation-harness.

lm-eval is NOT part of the `hf` extra (it pulls about 50 packages: datasets, pandas, scikit-learn,
...); install it yourself: `pip install lm-eval`. Its `hf` model type loads DIR with
AutoModelForCausalLM, which knows "tngram_gpt" only once tngram.hf is imported, so run the
harness through this module (same arguments as `lm_eval`):

    python -m tngram.hf.lmeval --model hf --model_args pretrained=DIR,add_bos_token=True \
        --tasks NAME --include_path TASK_DIR --device cpu --batch_size 8

`write_task` builds a small local multiple-choice task (JSONL + YAML, no download), and
`evaluate` runs one from Python. add_bos_token=True prepends <s> as our training data does
(every document starts with BOS).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tngram.common import TngramError, atomic_write_text

TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(task_dir: str | os.PathLike, name: str, docs: list[dict[str, Any]]) -> Path:
    """TASK_DIR/NAME.yaml + NAME.jsonl; each doc {"context": str, "choices": [str, ...], "label":
    int}."""
    if not name.replace("_", "").isalnum():
        raise TngramError(f"task name {name!r} must be letters, digits and underscores")
    for i, d in enumerate(docs):
        if set(d) != {"context", "choices", "label"} or not 0 <= int(d["label"]) < len(
            d["choices"]
        ):
            raise TngramError(
                f"doc {i} must be {{context, choices, label}} with label < len(choices), got {d}"
            )
    out = Path(task_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    atomic_write_text(data, "".join(json.dumps(d) + "\n" for d in docs))
    atomic_write_text(out / f"{name}.yaml", TASK_YAML.format(name=name, data=data.resolve()))
    return out


def evaluate(
    hf_dir: str | os.PathLike,
    task_dir: str | os.PathLike,
    task: str,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate with model "hf" on DIR; returns the harness's results dict."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ModuleNotFoundError:
        raise TngramError("lm-evaluation-harness is not installed: pip install lm-eval") from None
    import tngram.hf  # noqa: F401

    tngram.hf.register()
    return simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},add_bos_token=True,dtype=float32",
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=batch_size,
        device="cpu",
        limit=limit,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m tngram.hf.lmeval ARGS`: the lm_eval command line with tngram_gpt registered."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError:
        print(
            "tngram: error: lm-evaluation-harness is not installed: pip install lm-eval",
            file=sys.stderr,
        )
        return 2
    import tngram.hf

    tngram.hf.register()
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
