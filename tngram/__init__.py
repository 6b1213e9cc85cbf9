"""tngram: tensorized n-gram memories (TN-gram), Engram and Over-Encoding for GPT language models.

Importing the package does no work; heavy modules load on first use.

    import tngram
    model, tok = tngram.load_run("runs/x")           # a trained run folder
    print(tngram.sample(model, tok, "The history of", max_new_tokens=40))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "build_model", "load_run", "sample"]


def build_model(recipe_name: str, **overrides: Any) -> Any:
    """Build the model of a named recipe (see `tngram recipes`): forward(ids (B, T)) -> logits (B, T, V)."""
    from tngram.recipes import build_model as _build

    return _build(recipe_name, **overrides)


def load_run(run_dir: str, device: str = "cpu", tokenizer: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a trained run folder: the GPT in eval mode on `device` with its newest
    weights, and the run's SentencePiece tokenizer (RUN/tokenizer.model, or `tokenizer` if given).
    Works on a moved or copied run folder (no dataset needed)."""
    from tngram.data.tokenizer import load_tokenizer
    from tngram.train.checkpoint import load_run_model
    from tngram.train.portable import run_tokenizer_path

    model, cfg = load_run_model(run_dir, device=device)
    return model, load_tokenizer(run_tokenizer_path(run_dir, cfg, tokenizer))


def sample(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
           top_k: int | None = 50, seed: int = 0) -> str:
    """Prompt + sampled continuation as text (incremental decoding; temperature 0 = greedy)."""
    from tngram.data.tokenizer import BOS_ID
    from tngram.eval.sample import generate

    ids = [BOS_ID] + list(tokenizer.encode(prompt))
    out = generate(model, ids, max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(ids[1:] + out)


# transformers integration: tngram.hf registers itself when transformers is imported (not here;
# importing tngram never imports transformers). See tngram/_hf_hook.py.
from tngram import _hf_hook  # noqa: E402

_hf_hook.install()
