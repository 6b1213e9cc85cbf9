"""`tngram export RUN --hf DIR`: a trained run as a Hugging Face model folder (needs the `hf`
extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="export a run as a Hugging Face model folder (AutoModelForCausalLM, "
        "AutoTokenizer, pipeline)",
    )
    p.add_argument("run", type=Path, help="run folder (config.json + weights)")
    p.add_argument(
        "--hf", required=True, type=Path, metavar="DIR", help="output folder (new or empty)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="SentencePiece .model (default: the run's own)"
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weight dtype in DIR")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: Any) -> int:
    from tngram.common import TngramError

    if not (args.run / "config.json").is_file():
        raise TngramError(f"{args.run} is not a run folder (no config.json)")
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        raise TngramError('tngram export needs the hf extra: pip install "tngram[hf]"') from None
    from tngram.hf.export import check_export_target, export_run

    check_export_target(args.hf)

    out = export_run(args.run, args.hf, tokenizer=args.tokenizer, dtype=args.dtype)
    print(
        f"tngram: exported {args.run} -> {out} (import tngram.hf, then "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}))"
    )
    return 0
