"""tngram: tensorized n-gram memories (TN-gram), Engram and Over-Encoding for GPT language models.

Importing the package does no work and changes nothing outside it: heavy modules load on first
use, and the Hugging Face integration is switched on by `import tngram.hf` (docs/HF.md).

    import tngram
    model, tok = tngram.load_run("runs/x")           # a trained run folder
    print(tngram.sample(model, tok, "The history of", max_new_tokens=40))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The public modules and configs, importable from the root (`from tngram import TNGram`) but loaded
# on first use (PEP 562 module __getattr__): `import tngram` stays cheap (no torch until needed).
_LAZY = {
    "TNGram": "tngram.memory.tngram",
    "TNGramConfig": "tngram.memory.tngram",
    "TNGramVariantConfig": "tngram.memory.tngram_variants",
    "Engram": "tngram.memory.engram",
    "EngramConfig": "tngram.memory.engram",
    "OverEncoding": "tngram.memory.overencoding",
    "OverEncodingConfig": "tngram.memory.overencoding",
    "GatedFusion": "tngram.memory.gating",
    "GPT": "tngram.model.gpt",
    "GPTConfig": "tngram.model.gpt",
}

__all__ = ["__version__", "build_model", "load_run", "sample", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip __getattr__
        return value
    raise AttributeError(f"module 'tngram' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def build_model(recipe_name: str, **overrides: Any) -> Any:
    """Build the model of a named recipe (see `tngram recipes`): forward(ids (B, T)) -> logits (B,
    T, V)."""
    from tngram.train.recipes import build_model as _build

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


def sample(
    model: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Prompt + sampled continuation as text (incremental decoding; temperature 0 = greedy)."""
    from tngram.data.tokenizer import BOS_ID
    from tngram.eval.sample import check_prompt, check_sampling_args, generate

    check_prompt(prompt)
    check_sampling_args(max_new_tokens, temperature, top_k, seed)
    ids = [BOS_ID] + list(tokenizer.encode(prompt))
    out = generate(model, ids, max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(ids[1:] + out)
