"""CORE on 2 processes (gloo, torch.multiprocessing spawn, CPU) equals CORE on 1 process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_core_fixtures import CharTokenizer, OracleLM, known_texts, write_toy_bundle
from tngram.eval.core import evaluate_core


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, bundle: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = OracleLM(known_texts())
        res = evaluate_core(model, CharTokenizer(), bundle, ddp_rank=rank, world_size=world,
                            batch_tokens=200, progress=False)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"res": res, "rows": model.rows}))
    finally:
        dist.destroy_process_group()


def _summary(res: dict) -> dict:
    return {"core": res["core"], **{k: (v["accuracy"], v["centered"], v["n"]) for k, v in res["tasks"].items()}}


@pytest.mark.dist
def test_two_processes_match_one(tmp_path: Path) -> None:
    bundle = str(write_toy_bundle(tmp_path / "bundle"))
    single = OracleLM(known_texts())
    one = evaluate_core(single, CharTokenizer(), bundle, batch_tokens=200, progress=False)

    mp.spawn(_worker, args=(2, _free_port(), bundle, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert _summary(r["res"]) == _summary(one)           # identical, not just close
    # the work was split: each rank ran a strict subset of the rows, together exactly all of them
    assert all(0 < r["rows"] < single.rows for r in ranks)
    assert sum(r["rows"] for r in ranks) == single.rows
