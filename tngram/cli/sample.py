"""`tngram sample RUN_DIR --prompt TEXT`: text from a trained run (tngram.eval.sample.generate)."""

from __future__ import annotations

import argparse
from typing import Any

from tngram.cli.argtypes import float_range, int_range
from tngram.cli.common import (
    add_device_argument,
    add_threads_argument,
    apply_threads,
    use_threads,
)
from tngram.common import TngramError
from tngram.eval.sample import check_prompt


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "sample",
        help="sample text from a trained run (incremental decoding)",
        description="Sample continuations of --prompt from a trained run folder. The run's "
        "own tokenizer (RUN_DIR/tokenizer.model) is used, so a moved run works.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `tngram train`")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample")
    p.add_argument(
        "--temperature", type=float_range(0.0), default=0.8, help="softmax temperature; 0 = greedy"
    )
    p.add_argument(
        "--top-k",
        type=int_range(0),
        default=50,
        help="sample among the k most likely tokens; 0 = all",
    )
    p.add_argument(
        "--num-samples", type=int, default=1, help="independent samples (seeds SEED, SEED+1, ...)"
    )
    p.add_argument(
        "--seed",
        type=int_range(0, 2**63 - 1),
        default=0,
        help="sampling seed, below 2^63 (default: 0)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="SentencePiece .model to use instead of the run's (older runs without one)",
    )
    add_device_argument(p)
    add_threads_argument(p)
    p.set_defaults(func=_cmd_sample)


MAX_SAMPLES = 10_000


def _cmd_sample(args: argparse.Namespace) -> int:
    import tngram
    from tngram.train.dist import resolve_device  # lazy: torch loads when the command runs

    if not 1 <= args.num_samples <= MAX_SAMPLES:  # a typo of 1e15 sampled for ever
        raise TngramError(f"--num-samples must be in [1, {MAX_SAMPLES}], got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise TngramError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.seed + args.num_samples - 1 >= 2**63:
        raise TngramError(
            "--seed + --num-samples - 1 must stay below 2^63, got "
            f"{args.seed + args.num_samples - 1}"
        )
    check_prompt(args.prompt, "--prompt")  # undecodable bytes arrive as surrogate escapes
    device = str(resolve_device(args.device, flag="--device"))
    apply_threads(args.threads)  # an explicit count checked now; said when the work starts
    model, tok = tngram.load_run(args.run_dir, device=device, tokenizer=args.tokenizer)
    use_threads(args.threads, device, "sampling")  # after every input check
    for i in range(args.num_samples):
        if i:
            print("-" * 40)
        print(
            tngram.sample(
                model,
                tok,
                args.prompt,
                args.max_new_tokens,
                args.temperature,
                args.top_k,
                args.seed + i,
            )
        )
    return 0
