"""`python -m tngram ...`: the same as the `tngram` command."""

import sys

from tngram.cli import main

sys.exit(main())
