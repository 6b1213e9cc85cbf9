"""Text sampling with incremental decoding (the command is `tngram sample`, tngram/cli/sample.py).

The model keeps a cache between calls (attention keys/values, each memory module's n-gram window
and conv state), so each new token costs one position of compute; the logits equal a full
recomputation over the whole sequence (tests/test_sample.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError

if TYPE_CHECKING:
    from tngram.model.gpt import GPTConfig


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    """Sample continuation ids after `prompt` (which should start with BOS). temperature 0 =
    greedy."""
    check_sampling_args(max_new_tokens, temperature, top_k, seed)
    if not prompt:
        raise TngramError("the prompt must contain at least one token (BOS)")
    config = cast("GPTConfig", model.config)  # a GPT's config
    vocab = config.vocab_size
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:  # checked here, once: the forwards skip reading ids on a GPU (no host syncs)
        raise TngramError(
            f"prompt token ids must lie in [0, {vocab}) (the vocabulary size); got {bad[:5]}"
        )
    limit = config.sequence_len
    if len(prompt) + max_new_tokens > limit:
        raise TngramError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's sequence_len {limit}"
        )
    gen = torch.Generator().manual_seed(seed)  # on CPU: the same samples on every device
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    cache: dict[str, Any] | None = {} if use_cache else None
    out: list[int] = []
    feed = ids
    for _ in range(max_new_tokens):
        logits = model(feed, cache=cache)[:, -1].float() if use_cache else model(ids)[:, -1].float()
        nxt = pick(logits.cpu(), temperature, top_k, gen).to(device)
        out.append(int(nxt))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        feed = nxt.view(1, 1)
    return out


def check_prompt(prompt: Any, what: str = "prompt") -> str:
    """A prompt is a str of UTF-8 text (a command line's undecodable bytes arrive as surrogate
    escapes, which no tokenizer encodes): else one TngramError naming the byte."""
    if not isinstance(prompt, str):
        raise TngramError(f"{what} must be a str, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start : e.end]
        try:
            raw = bad.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = bad.encode("utf-8", "backslashreplace")
        raise TngramError(
            f"{what} is not UTF-8 text (byte {raw!r} at character {e.start}); give the prompt "
            "in UTF-8"
        ) from None
    return prompt


def check_sampling_args(max_new_tokens: Any, temperature: Any, top_k: Any, seed: Any) -> None:
    """The checks the `sample` command's flags make, for the Python API (one TngramError each)."""
    import math

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise TngramError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise TngramError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}"
        )
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise TngramError(f"top_k must be None or an int >= 0 (0 = all tokens), got {top_k!r}")
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise TngramError(f"seed must be an int in [0, 2^63), got {seed!r}")


def pick(logits: Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> Tensor:
    """logits (1, V) -> one token id (greedy when temperature == 0)."""
    if temperature <= 0:
        return logits.argmax(-1)[0]
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[0, 0]
