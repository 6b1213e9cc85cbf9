"""The tables section of `python -m research bench gpu`: the candidates of one vocabulary timed
interleaved.

At each vocabulary V the candidates are the raw step and, for Engram and TN-gram, one optimiser
step per `optim.memory_update` (dense / sparse / rowwise), each as `gpu_parts.table_setup` builds
it. The goal's points are ratios between them (a memory step against the raw step, `sparse`
against `dense`), so they are timed in one process, interleaved: every candidate's warm-up first,
then `reps` rounds in which each candidate steps once, round r starting at candidate r mod n
(`gpu_parts.interleaved_ms`). A drift of the card's clocks or of the host's load then lands on
every candidate alike, and no candidate always follows the same other one. (At commit 7608a19
each candidate's 10 steps ran in a row; the spread inside one candidate, e.g. TN-gram `sparse`
at V 32,768: 88.9 to 134.3 ms around a median of 121.4, was as large as the differences the
goal asks about.)

Candidates interleave only when they are alive at once, so they are packed, in order, into
groups whose parameters and optimiser state fit the free memory less one step's activations
(`activation_reserve_gib`); a candidate that does not fit even alone is skipped with the reason
(`gpu_parts.memory_shortfall`). A group that runs out of memory all the same is run again one
candidate at a time, and its items say so ("interleaved_with" lists the others of the group an
item was timed with; absent: timed alone).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from research.bench import gpu_parts as parts
from tngram.optim.memory_update import MEMORY_UPDATES

MODELS = ("raw", "engram", "tngram")
# one step's activations at the table shapes, beyond the parameters and their state: the peak of
# the raw step less its weights and Adam state, measured at commit 7608a19 on the H200
# (gpu-h200-7608a19-c.json, 16,384 tokens): 32.9 GB at V 131,072 with 1.3 GB of parameters and
# state, i.e. 14.7 bytes per token and vocabulary entry (the logits in bf16 and fp32 and their
# gradient), rounded up to 16; and 4.3 GB at V 1,024, the rest of the step, rounded up to a
# reserve of 8 GiB on a card (1 GiB on the CPU, where the shapes are tiny)
LOGIT_BYTES = 16
REST_GIB = {"cuda": 8.0, "cpu": 1.0}


@dataclass(frozen=True)
class Candidate:
    model: str  # raw | engram | tngram (paper-l9-MODEL)
    V: int
    update: str  # dense | sparse | rowwise (raw: dense)

    @property
    def key(self) -> str:
        return f"raw@{self.V}" if self.model == "raw" else f"{self.model}@{self.V}/{self.update}"


def candidates(V: int) -> list[Candidate]:
    """The candidates at V, in the results file's order: raw, then each memory's updates."""
    return [
        Candidate(m, V, u) for m in MODELS for u in (MEMORY_UPDATES if m != "raw" else ("dense",))
    ]


def activation_reserve_gib(V: int, shapes: Any) -> float:
    """GiB one table step at V needs beyond its parameters and state (LOGIT_BYTES, REST_GIB)."""
    tokens = shapes.table_batch * parts.config("paper-l9-raw", shapes).model.sequence_len
    return tokens * V * LOGIT_BYTES / parts.GIB + REST_GIB.get(shapes.device, 8.0)


def pack(needs: list[float], room: float | None) -> list[list[int]]:
    """Consecutive groups of the indices of `needs` (GiB each) whose sums stay within `room`; a
    need above `room` gets a group of its own. room None (free memory unknown): one each."""
    groups: list[list[int]] = []
    total = 0.0
    for i, need in enumerate(needs):
        if groups and room is not None and total + need <= room:
            groups[-1].append(i)
            total += need
        else:
            groups.append([i])
            total = need
    return groups


def plan(V: int, shapes: Any) -> list[tuple[list[Candidate], str]]:
    """The tables section at V in order: (candidates timed together, "") or ([one], why it is
    skipped: it does not fit in memory even alone)."""
    free = parts.free_gib(shapes.device)
    room = None if free is None else free - activation_reserve_gib(V, shapes)
    out: list[tuple[list[Candidate], str]] = []
    run: list[tuple[Candidate, float]] = []

    def flush() -> None:
        for g in pack([need for _, need in run], room):
            out.append(([run[i][0] for i in g], ""))
        run.clear()

    for c in candidates(V):
        why = parts.memory_shortfall(c.model, V, shapes)
        if why:
            flush()
            out.append(([c], why))
        else:
            run.append((c, parts.table_step_need(c.model, V, shapes)[1]))
    flush()
    return out


def time_group(group: list[Candidate], shapes: Any, profile: bool = False) -> dict[str, Any]:
    """key -> result of each candidate of `group`, all built at once and timed `interleaved`
    (one alone: the same, a group of one). Peak memory is the group's (its items say
    "peak_gb_group" when more than one). A group that runs out of memory is freed and re-run
    one candidate at a time. profile: each candidate's steps under torch.profiler after the
    timing (research.bench.gpu_profile)."""
    try:
        return _time_together(group, shapes, profile)
    except torch.cuda.OutOfMemoryError:
        if len(group) == 1:
            raise
    gc.collect()
    if shapes.device == "cuda":
        torch.cuda.empty_cache()
    out: dict[str, Any] = {}
    for c in group:
        try:
            out.update(_time_together([c], shapes, profile))
        except Exception as e:  # one failed candidate must not lose the others' numbers
            out[c.key] = {"error": f"{type(e).__name__}: {e}"[:400]}
        out[c.key]["alone_after_oom"] = True
    return out


def _time_together(group: list[Candidate], shapes: Any, profile: bool) -> dict[str, Any]:
    dev = shapes.device
    built = {c.key: parts.table_setup(c.model, c.V, c.update, shapes) for c in group}
    parts.reset_peak(dev)
    steps = {k: step for k, (step, _) in built.items()}
    times = parts.interleaved_ms(steps, shapes.reps, shapes.warmup, dev)
    peak = parts.peak_gb(dev)
    out: dict[str, Any] = {}
    for k, (step, facts) in built.items():
        row = {**times[k], **facts}
        if len(group) > 1:
            row["interleaved_with"] = [o for o in built if o != k]
            row["peak_gb_group"] = peak
        else:
            row["peak_gb"] = peak
        if profile:  # after every candidate's timing
            from research.bench.gpu_profile import profile_steps

            row["profile"] = profile_steps(step, dev)
        out[k] = row
    return out


__all__ = [
    "Candidate",
    "activation_reserve_gib",
    "candidates",
    "pack",
    "plan",
    "time_group",
]
