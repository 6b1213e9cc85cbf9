"""The command line: every `tngram COMMAND` (and `python -m tngram`) lives in this package.

The library (tngram.memory, .model, .train, .eval, ...) never imports it; each module here parses
flags and calls the library. `main.py` gathers the commands; `common.py` and `argtypes.py` hold the
flags that several commands share, so a flag means the same everywhere. Imports inside the
command functions are deliberate (start-up time: a command loads only what it runs).
"""

from tngram.cli.main import main

__all__ = ["main"]
