"""`python -m tngram.train RECIPE --out DIR ...`: the train command, launchable by torchrun.

    torchrun --standalone --nproc_per_node=2 -m tngram.train mini-tngram --out runs/x
"""

from __future__ import annotations

import sys

from tngram.argtypes import OneLineParser, report_error
from tngram.common import TngramError
from tngram.train.cli import add_train_arguments, cmd_train


def main(argv: list[str] | None = None) -> int:
    from tngram.cli_common import HelpFormatter
    parser = OneLineParser(prog="python -m tngram.train", description=__doc__, formatter_class=HelpFormatter)
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_train(args)
    except (TngramError, OSError) as e:
        print(f"tngram: error: {report_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
