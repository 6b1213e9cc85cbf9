"""`python -m tngram.train RECIPE --out DIR ...`: the train command, launchable by torchrun.

    torchrun --standalone --nproc_per_node=2 -m tngram.train mini-tngram --out runs/x

An entry point, not library code: the command itself is tngram/cli/train.py (the layer contracts
in pyproject.toml allow this one upward import).
"""

import sys

from tngram.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
