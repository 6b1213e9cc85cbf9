"""`tngram recipes` and `tngram params RECIPE [--json]`: the named recipes
(tngram.train.recipes)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tngram.cli.common import add_config_arguments, add_json_argument
from tngram.train.recipes import (
    DESCRIPTIONS,
    RECIPES,
    get_recipe,
    param_summary,
    resolve_config,
)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "recipes",
        help="list the named recipes, one line each: what it is and its size",
        description="The named recipes, one line each: what it is, its shape (layers, width, "
        "vocabulary, sequence length) and its schedule. `tngram train RECIPE` trains one; "
        "`--set` changes any key. The mini-* recipes train in minutes on a CPU on the offline "
        "default corpus; the paper-* recipes read 3.1 B (L9) or 5.2 B (L18) tokens, so they "
        "need FineWeb (`tngram data fineweb --train-shards 32`, then --data; docs/GPU.md).",
    )
    add_json_argument(p)
    p.set_defaults(func=_cmd_recipes)
    p = sub.add_parser(
        "params",
        help="parameter counts of a recipe (delta against its raw GPT)",
        description="Total, memory and delta parameters (delta = total minus the same "
        "backbone without memory) of a recipe, a --config file or both, with --set applied.",
    )
    p.add_argument(
        "recipe",
        nargs="?",
        default=None,
        metavar="RECIPE",
        help="a named recipe (optional when --config names one)",
    )
    add_config_arguments(p)
    add_json_argument(p)
    p.set_defaults(func=_cmd_params)


def _cmd_recipes(args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        print(json.dumps({name: get_recipe(name).to_dict() for name in RECIPES}, indent=1))
        return 0
    width = max(map(len, RECIPES))
    for name in RECIPES:
        cfg = get_recipe(name)
        m = cfg.model
        print(
            f"{name:{width}s}  {DESCRIPTIONS[name]}  [L{m.n_layer} d{m.n_embd} V{m.vocab_size} "
            f"T{m.sequence_len}, {cfg.schedule.steps} steps x "
            f"{cfg.data.global_batch_tokens} tokens]"
        )
    return 0


def _cmd_params(args: argparse.Namespace) -> int:
    s = param_summary(resolve_config(args.recipe, args.overrides, config_file=args.config))
    if args.json:
        print(json.dumps(s))
    else:
        for k, v in s.items():
            print(f"{k:14s} {v:,}" if isinstance(v, int) else f"{k:14s} {v}")
    return 0
