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
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:   # checked here, once: the forwards skip reading ids on a GPU (no host syncs)
        raise TngramError(f"prompt token ids must lie in [0, {vocab}) (the vocabulary size); "
                          f"got {bad[:5]}")
    limit = model.config.sequence_len
    if len(prompt) + max_new_tokens > limit:
        raise TngramError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                          f"the model's sequence_len {limit}")
    gen = torch.Generator().manual_seed(seed)   # on CPU: the same samples on every device
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
    from tngram.cli_common import add_device_argument
    p = sub.add_parser("sample", help="sample text from a trained run (incremental decoding)",
                       description="Sample continuations of --prompt from a trained run folder. The run's "
                       "own tokenizer (RUN_DIR/tokenizer.model) is used, so a moved run works.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `tngram train`")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float_range(0.0), default=0.8, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int_range(0), default=50, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (seeds SEED, SEED+1, ...)")
    p.add_argument("--seed", type=int_range(0), default=0, help="sampling seed")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="SentencePiece .model to use instead of the run's (older runs without one)")
    add_device_argument(p)
    p.set_defaults(func=_cmd_sample)


def _cmd_sample(args: Any) -> int:
    import tngram
    from tngram.cli_common import resolve_device

    if args.num_samples < 1:
        raise TngramError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise TngramError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model, tok = tngram.load_run(args.run_dir, device=resolve_device(args.device), tokenizer=args.tokenizer)
    for i in range(args.num_samples):
        if i:
            print("-" * 40)
        print(tngram.sample(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                            args.seed + i))
    return 0
