"""What a row-sparse table gradient costs the optimiser on the CPU, two ways it could be made.

    OMP_NUM_THREADS=1 .venv/bin/python research/scripts/sparse_grad_costs.py [--out FILE.json]

A TN-gram factor table of paper-l9 at V 32,768 (N 5, cp_rank 1,024) gets the row-sparse gradient
of one batch of uniform random tokens (the rows `tngram.kernels.sparse_rows` would build):

- `step`: LazyAdam's step with that gradient marked coalesced (what the optimiser gets since the
  hook `sparse_rows._remark`) and the same tensor marked uncoalesced (what torch's AccumulateGrad
  left before it: the optimiser coalesces it again), interleaved, one thread.
- `accumulate`: 8 micro-steps' gradients added one after another by torch (what autograd does
  with `p.grad`) against concatenated once (`sparse_rows._summed`, the trainer's
  `accumulate_at_exit`), each then coalesced as the optimiser does; interleaved.

CPU numbers: on the CPU torch's sparse add merges rows, on CUDA it concatenates them
(ATen's add_out_sparse_cuda), so the GPU's costs differ and are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tngram.common import atomic_write_json
from tngram.kernels.sparse_rows import _summed, sparse_row_grad
from tngram.optim.row_adams import LazyAdam
from tngram.train.metrics import git_info

N, V, R = 5, 32768, 1024  # paper-l9-tngram's factors of one layer at V 32,768
STEP_TOKENS, MICRO_TOKENS, MICRO_STEPS, REPS = 16384, 4096, 8, 7


def row_grad(shape: tuple[int, int, int], tokens: int, seed: int) -> torch.Tensor:
    """The coalesced row-sparse gradient of `tokens` uniform random tokens: one row of each
    factor per token, random values."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, V, (tokens,), generator=g) + k * V for k in range(N)])
    rows = torch.unique(ids)
    return sparse_row_grad(rows, torch.randn(rows.numel(), R, generator=g), shape)


def ms(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="research/results/sparse-grad-costs.json")
    out = Path(ap.parse_args().out)
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(N, V, R))
    opt = LazyAdam([p], lr=1e-3)
    grad = row_grad((N, V, R), STEP_TOKENS, 1)

    def step(marked: bool) -> None:
        grad._coalesced_(marked)
        p.grad = grad
        opt.step()

    micro = [row_grad((N, V, R), MICRO_TOKENS, 10 + i) for i in range(MICRO_STEPS)]

    def one_by_one() -> None:
        acc = micro[0]
        for g in micro[1:]:
            acc = acc + g
        acc.coalesce()

    def once() -> None:
        _summed(micro).coalesce()

    times: dict[str, list[float]] = {k: [] for k in ("marked", "unmarked", "added", "once")}
    step(True)  # warm-up: the first step allocates the optimiser's state
    step(False)
    one_by_one()
    once()
    for r in range(REPS):  # interleaved, the order alternating
        pairs = [("marked", lambda: step(True)), ("unmarked", lambda: step(False))]
        pairs += [("added", one_by_one), ("once", once)]
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            times[name].append(ms(fn))
    med = {k: round(statistics.median(v), 1) for k, v in times.items()}
    info = git_info(Path(__file__).parent)
    res = {
        "kind": "sparse-grad-costs",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python research/scripts/sparse_grad_costs.py",
        "commit": (info["commit"] or "?")[:7]
        + (" (with uncommitted changes)" if info["dirty"] else ""),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, no GPU",
        "torch": torch.__version__,
        "threads": 1,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "table": {"N": N, "V": V, "cp_rank": R},
        "step": {
            "tokens": STEP_TOKENS,
            "rows": grad._nnz(),
            "marked_ms": med["marked"],
            "unmarked_ms": med["unmarked"],
            "reps": REPS,
        },
        "accumulate": {
            "micro_steps": MICRO_STEPS,
            "tokens_per_micro_step": MICRO_TOKENS,
            "rows_per_micro_step": [g._nnz() for g in micro],
            "added_one_by_one_ms": med["added"],
            "concatenated_once_ms": med["once"],
            "reps": REPS,
        },
    }
    atomic_write_json(out, res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
