"""The sections of `tngram bench gpu`, in the order they run (tngram.bench.gpu); kept apart so that
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
