"""The sections of `python -m research bench gpu`, in the order they run (research.bench.gpu); kept
apart so that
the CLI's --help lists them without importing torch."""

SECTIONS = (
    "doctor",
    "lookup",
    "kernels",
    "attention",
    "optim",
    "fwdbwd",
    "tables",
    "trainer",
)
