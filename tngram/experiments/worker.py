"""Subprocess entry point for one run: `python -m tngram.experiments.worker CONFIG.json RUN_DIR`.

Also works under torchrun. Resumes from the run folder's last checkpoint when there is one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tngram.experiments.worker CONFIG.json RUN_DIR", file=sys.stderr)
        return 2
    from tngram.common import TngramError
    from tngram.train.checkpoint import has_checkpoint
    from tngram.train.config import TrainConfig
    from tngram.train.loop import train

    cfg = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
    run_dir = Path(argv[1])
    try:
        train(
            cfg,
            run_dir,
            resume=has_checkpoint(run_dir),  # no bars: --no-progress or stderr not a TTY
            progress=False if os.environ.get("TNGRAM_NO_PROGRESS") else None,
        )
    except TngramError as e:
        print(f"tngram: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
