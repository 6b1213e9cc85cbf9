"""`python -m research bench gpu --sections optim`: the optimiser step alone, Muon per matrix
against stacked.

A trainer step of paper-l9 is 8 micro-steps of forward + backward and one optimiser step; on the
H200 the step took about 29 ms more than 8 compiled forward + backward passes of the raw GPT
(research/GPU.md). Muon runs 5 Newton-Schulz iterations on each of its 54 matrices: about 46 ops a
matrix eager (2,490 a step; tests/test_optim_muon.py), each small for the card. This item times, for
each chosen recipe's model on the device with random gradients (their values do not change the
work):

    adam           the fused Adam step (embeddings, scalars, dense memory tables)
    muon/loop      Muon, one matrix at a time (tngram.optim.muon, stack_shapes=False)
    muon/stacked   Muon, the matrices of a shape as one stack (the CUDA default)

interleaved round by round in one process (research.bench.gpu_parts.interleaved_ms), with
Newton-Schulz compiled on CUDA as the trainer compiles it, eager on the CPU. Before the timing,
both Muons take one step from the same weights, gradients and empty momentum: `update_rel_diff`
is the largest relative Frobenius difference of any matrix's update between them (0 on the
CPU, where the two are bit-equal; on a GPU a batched matmul may round differently).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from research.bench.gpu_kernels import max_rel_diff
from research.bench.gpu_parts import config, fresh_dynamo, interleaved_ms


def _muon(groups: list[dict], o: Any, stack: bool, compiled: bool) -> torch.optim.Optimizer:
    from tngram.optim.muon import Muon

    opt = Muon(
        [dict(g) for g in groups],  # own group dicts: the two Muons share only the parameters
        lr=o.matrix_lr,
        momentum=o.muon_momentum,
        ns_steps=o.muon_ns_steps,
        stack_shapes=stack,
    )
    if compiled:
        opt.use_compiled_ns()
    return opt


def _update_rel_diff(mats: list[torch.Tensor], o: Any, compiled: bool) -> float:
    """One step of each Muon from the same state on copies of `mats` (lr 1: the change is the
    update): the largest ||U_stacked - U_loop|| / ||U_loop|| over the matrices."""
    ups = []
    for stack in (False, True):
        copies = [torch.nn.Parameter(m.detach().clone()) for m in mats]
        for c, m in zip(copies, mats):
            c.grad = m.grad
        group = {"params": copies, "lr": 1.0}
        _muon([group], o, stack, compiled).step()
        ups.append([c.detach() - m.detach() for c, m in zip(copies, mats)])
    return max_rel_diff(ups[1], ups[0])


def optimiser_steps(recipe: str, shapes: Any) -> dict[str, Any]:
    """The item of one recipe (module docstring)."""
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups

    dev = shapes.device
    cfg = config(recipe, shapes)
    o = cfg.optim
    torch.manual_seed(0)
    with torch.device(dev):
        net = GPT(cfg.model)
    g = torch.Generator(device=dev).manual_seed(0)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype)
    groups = build_param_groups(net, o)
    adam_groups = [gr for gr in groups if gr["optimizer"] == "adam"]
    muon_groups = [gr for gr in groups if gr["optimizer"] == "muon"]
    mats = [p for gr in muon_groups for p in gr["params"]]
    compiled = dev == "cuda"  # the trainer compiles Newton-Schulz where it compiles the forward
    fresh_dynamo()
    diff = _update_rel_diff(mats, o, compiled)
    adam = torch.optim.Adam(adam_groups, betas=(o.beta1, o.beta2), eps=o.adam_eps, fused=compiled)
    loop, stacked = _muon(muon_groups, o, False, compiled), _muon(muon_groups, o, True, compiled)
    t = interleaved_ms(
        {"adam": adam.step, "muon/loop": loop.step, "muon/stacked": stacked.step},
        shapes.reps,
        shapes.warmup,
        dev,
    )
    shapes_count = Counter("x".join(map(str, m.shape)) for m in mats)
    return {
        "optimisers": t,
        "muon_matrices": len(mats),
        "muon_shapes": dict(shapes_count),
        "muon_params": sum(m.numel() for m in mats),
        "adam_params": sum(p.numel() for gr in adam_groups for p in gr["params"]),
        "newton_schulz": "compiled" if compiled else "eager",
        "update_rel_diff": diff,
        "stacked_over_loop": t["muon/stacked"]["median_ms"] / t["muon/loop"]["median_ms"],
    }
