"""`python -m tngram.cli ...`: the same as the `tngram` command."""

import sys

from tngram.cli.main import main

sys.exit(main())
