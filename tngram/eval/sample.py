"""Text sampling with incremental decoding (`tngram sample RUN_DIR --prompt TEXT`).

The model keeps a cache between calls (attention keys/values, each memory module's n-gram window
and conv state), so each new token costs one position of compute; the logits equal a full
recomputation over the whole sequence (tests/test_sample.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tngram.argtypes import float_range, int_range
from tngram.common import TngramError


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int = 64, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> list[int]:
    """Sample continuation ids after `prompt` (which should start with BOS). temperature 0 = greedy."""
    if not prompt:
        raise TngramError("the prompt must contain at least one token (BOS)")
    limit = model.config.sequence_len
    if len(prompt) + max_new_tokens > limit:
        raise TngramError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                          f"the model's sequence_len {limit}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long)
    cache: dict[str, Any] | None = {} if use_cache else None
    out: list[int] = []
    feed = ids
    for _ in range(max_new_tokens):
        logits = model(feed, cache=cache)[:, -1].float() if use_cache else model(ids)[:, -1].float()
        nxt = pick(logits, temperature, top_k, gen)
        out.append(int(nxt))
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        feed = nxt.view(1, 1)
    return out


def pick(logits: Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> Tensor:
    """logits (1, V) -> one token id (greedy when temperature == 0)."""
    if temperature <= 0:
        return logits.argmax(-1)[0]
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[0, 0]


# ---- CLI: tngram sample RUN_DIR --prompt TEXT

def add_commands(sub: Any) -> None:
    p = sub.add_parser("sample", help="sample text from a trained run (incremental decoding)")
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int_range(1), default=64)
    p.add_argument("--temperature", type=float_range(0.0), default=0.8)
    p.add_argument("--top-k", type=int_range(0), default=50)
    p.add_argument("--seed", type=int_range(0), default=0)
    p.set_defaults(func=_cmd_sample)


def _cmd_sample(args: Any) -> int:
    from pathlib import Path

    from tngram.data.build import open_dataset
    from tngram.data.tokenizer import BOS_ID, load_tokenizer
    from tngram.train.checkpoint import load_run_model

    model, cfg = load_run_model(args.run_dir)
    sp = load_tokenizer(open_dataset(Path(cfg["data"]["dir"])).tokenizer_path)
    prompt = [BOS_ID] + sp.encode(args.prompt)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(sp.decode(prompt[1:] + out))
    return 0
