"""Worker for tests/test_dist_fsdp.py: a tiny transformers Llama with a TN-gram memory
(tngram.hf.add_memory) trained a few AdamW steps, under FSDP2 when launched by torchrun with
2 processes (each process takes half of every batch), plainly in 1 process. Prints one JSON line
{"losses": [...], "sharded": bool} on the main process.

    python tests/fsdp_hf_worker.py                    (1 process)
    torchrun --nproc_per_node=2 tests/fsdp_hf_worker.py
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


def main(steps: int = 4) -> list[float]:
    from hf_tiny import VOCAB, tiny_model
    from tngram.hf import add_memory
    from tngram.memory.tngram import TNGramConfig
    from tngram.train.fsdp import apply_fsdp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=0).train()
    add_memory(model, TNGramConfig(max_ngram=3, cp_rank=8, zero_init_value=False,
                                   zero_init_conv=False), layers=[1])
    if world > 1:
        apply_fsdp(model, torch.device("cpu"), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (4, 16), generator=gen)
        mine = ids.chunk(world)[rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    if rank == 0:
        from torch.distributed.tensor import DTensor
        mem = [p for n, p in model.named_parameters() if "factors" in n]
        print(json.dumps({"losses": losses, "sharded": bool(mem) and isinstance(mem[0], DTensor)}))
    if world > 1:  # the model's FSDP state holds the group: it goes first (dist.release_ddp)
        del model, opt
        gc.collect()
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
