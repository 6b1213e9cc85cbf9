"""Learning-rate and Muon-momentum schedules as pure functions of the step.

`step` is the 0-based index of the optimiser step being taken (step 0 is the first update), as in
parameter-golf's loop (train_gpt.py, "step mode"):

    lr_multiplier  = 1                                  for step <  steps - warmdown_steps
                   = (steps - step) / warmdown_steps    for steps - warmdown_steps <= step < steps
                   = 0                                  for step >= steps
    muon_momentum  = (1 - f) * start + f * end,  f = min(step / warmup_steps, 1)

There is no learning-rate warm-up (paper App. E: constant, then linear decay to zero over the
last 1200 steps). With 6000 steps and 1200 warmdown the multiplier is 1 through step 4799,
1200/1200 at step 4800 and 1/1200 at the last step 5999.
"""

from __future__ import annotations


def lr_multiplier(step: int, steps: int, warmdown_steps: int) -> float:
    """Multiplier on every group's base learning rate at 0-based optimiser step `step`."""
    if step >= steps:
        return 0.0
    if warmdown_steps <= 0 or step < steps - warmdown_steps:
        return 1.0
    return (steps - step) / warmdown_steps


def muon_momentum(step: int, start: float, end: float, warmup_steps: int) -> float:
    """Muon's Nesterov momentum, linear from `start` at step 0 to `end` at `warmup_steps`."""
    f = 1.0 if warmup_steps <= 0 else min(step / warmup_steps, 1.0)
    return (1.0 - f) * start + f * end
