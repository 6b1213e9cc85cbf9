"""`python -m research bench gpu`: the GPU numbers of issue 39 in one command and one results file.

Sections, run in this order while the time budget lasts (an item whose estimated time no longer
fits is skipped and listed with the reason, so the command stays inside one GPU call):

  doctor   `tngram doctor`'s self-checks (passed in by the CLI: the doctor's own code path)
  lookup   TN-gram's compiled lookup (Triton on CUDA, C on the CPU) against the torch path: inside
           paper-l9-tngram the loss and the memory gradients (fp32 and bf16), and the lookup of
           one paper-l9 TN-gram module alone, forward + backward, timed for each implementation
  kernels  the Triton lookup's backward variants (fused / split / sorted, two num_warps each) of
           every chosen TN-gram recipe's module at the fwdbwd batch, and the same stage without a
           hand-written kernel compiled by torch.compile (`inductor`; not with compile=False),
           interleaved, with their gradients compared; and the backward's factor-gradient adds
           alone, atomic against sorted, for uniform and Zipf ids (research.bench.gpu_kernels)
  attention the GPT's attention alone at paper-l9's shapes, forward + backward per SDPA backend
           (cuDNN, flash, memory-efficient, math) and torch's own pick
           (research.bench.gpu_attention)
  optim    the optimiser step alone of every chosen recipe: fused Adam, and Muon one matrix at a
           time against its same-shape stacks, interleaved (research.bench.gpu_optim)
  fwdbwd   forward + backward of every `paper-l9-*` recipe (research.bench.gpu_parts), eager, then
           under torch.compile (raw / Engram / TN-gram first, the other recipes last); with
           profile=True (`--profile`) each item also profiles a few steps after its timing:
           its time by kernel and kernel category (research.bench.gpu_profile)
  tables   one optimiser step with optim.memory_update dense / sparse / rowwise at V 1k / 32k /
           128k (Engram and TN-gram), beside the raw model's step at the same V, the candidates
           of one V timed interleaved, as many at once as fit the free memory; a step whose
           parameters would not fit even alone is skipped and named (research.bench.gpu_tables)
  trainer  tokens/s of N optimiser steps through the real trainer (tngram.train.loop.train),
           median of the per-step windows from step 3 on, as `tngram train --stop-after N`
           (raw / Engram / TN-gram here, the other recipes last, after their compiled fwdbwd)

With the recipes' run.compile=auto the trainer compiles on CUDA, so a trainer item costs about
as much as a compiled fwdbwd item; what the default budget leaves out is named in the file, and
a second call with --sections (another --out) measures it.

Every timed item records its peak GPU memory (torch.cuda.max_memory_allocated; none on the
CPU) and, for fwdbwd, the FLOP count it used (tngram.model.flops.train_flops, the count of
`tngram plan`) and the MFU against the card's bf16 dense peak from its spec sheet (PEAK_BF16)
and against the bf16 matmul peak measured in the same run.

Without CUDA everything runs at tiny shapes (TINY_SETS: 2 layers, d 32, seq 64), so the command
and its results file are checked on the CPU by the tests; those numbers are no GPU figures.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from research.bench.gpu_sections import SECTIONS

BASE = ("paper-l9-raw", "paper-l9-engram", "paper-l9-tngram")
GPU_VOCABS = (1024, 32768, 131072)
TINY_VOCABS = (128, 256, 512)
# the tiny shapes of a CPU run: applied with --set semantics to every recipe
TINY_SETS = (
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.sequence_len=64",
)
TINY_MEMORY_SETS = ("model.memory_layers=1",)  # only for recipes with a memory
# bf16 dense tensor-core peak (FLOP/s) from NVIDIA's spec sheets, by a substring of the card name
PEAK_BF16 = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
)
# estimated seconds per item on a GPU, from the first check (fb2264d, one H200): a compiled
# paper-l9 model 28-44 s to its first step, eager set-up 2 s + 18 steps of < 0.12 s, a trainer
# step of 524,288 tokens 0.8-1.0 s eager; a table step at V = 128k builds up to 2.8 B parameters
GPU_COST = {
    "doctor": 30,
    "lookup": 25,
    # one recipe: 7 Triton compiles (forward, 6 backward variants) of a few s each, then 13
    # rounds of 7 calls of < 0.1 s at 64 x 1024 tokens, and the row_grads adds (13 rounds of 5
    # calls of a few ms); not measured yet
    "kernels": 25,
    # its `inductor` variant (compile=True): torch.compile of the lookup stage's forward and
    # backward graphs (the model's compiled fwdbwd set-up was 25-36 s at 7608a19, this is a
    # small part of that graph), then 13 rounds of one call; not measured yet
    "kernels_inductor": 20,
    # one recipe: Newton-Schulz compiled for 2-D and 3-D inputs (a few graphs of a few s each),
    # then 13 rounds of 3 optimiser steps of < 0.05 s; not measured yet
    "optim": 40,
    # paper-l9's attention alone: 5 variants x 13 rounds of < 0.1 s (math: the B x H x T x T
    # scores in memory) and their first calls; not measured yet
    "attention": 15,
    "eager": 6,
    "compile": 50,
    "trainer": 15,
    "trainer_step": 1.2,
    "table": 3,
    # --profile, per fwdbwd or tables item: 3 steps of < 0.12 s under the profiler, the
    # profiler's start (CUPTI) and its event processing (thousands of kernels a step, eager);
    # not measured yet
    "profile": 8,
}


def card_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; 'cpu' -> 'cpu'."""
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown"


def has_tngram(recipe: str) -> bool:
    """The recipe's model has a TN-gram memory (the kernels section's items)."""
    from tngram.memory.tngram import TNGramConfig
    from tngram.train.recipes import get_recipe

    return isinstance(get_recipe(recipe).model.memory, TNGramConfig)


def paper_recipes(names: list[str]) -> list[str]:
    """Every recipe named paper-l9-*: raw, Engram, TN-gram first, the rest in name order."""
    rest = sorted(n for n in names if n.startswith("paper-l9-") and n not in BASE)
    return [n for n in BASE if n in names] + rest


def spec_peak(card: str) -> float | None:
    for key, flops in PEAK_BF16:
        if key in card:
            return flops
    return None


class Budget:
    """Seconds left of `seconds`; `fits(cost)` says whether an item estimated at `cost` s fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def fits(self, cost: float) -> bool:
        return self.left() >= cost


@dataclass(frozen=True)
class Shapes:
    """What one run measures at: the paper's on a GPU, tiny ones on the CPU."""

    device: str
    tiny: bool
    batch: int  # sequences per fwdbwd step
    lookup_batch: int  # sequences of the lookup check / timing
    table_batch: int  # sequences per tables step
    reps: int
    warmup: int
    vocabs: tuple[int, ...]

    def sets(self, has_memory: bool) -> list[str]:
        if not self.tiny:
            return []
        return list(TINY_SETS) + (list(TINY_MEMORY_SETS) if has_memory else [])

    def cost(self, what: str, steps: int = 0, vocab: int = 0, profile: bool = False) -> float:
        """Estimated seconds of one item on the GPU (GPU_COST); 0.5 s at tiny shapes.
        profile: the item also profiles a few steps (--profile: fwdbwd and tables items)."""
        if self.tiny:
            return 0.5
        extra = GPU_COST["profile"] if profile else 0
        if what == "trainer":
            return GPU_COST["trainer"] + GPU_COST["trainer_step"] * steps
        if what == "table":
            return GPU_COST["table"] * (1 + vocab / 131072) + extra
        return GPU_COST[what] + extra


def shapes_for(device: str, reps: int | None = None) -> Shapes:
    if device == "cuda":
        return Shapes("cuda", False, 64, 8, 16, reps or 10, 3, GPU_VOCABS)
    return Shapes("cpu", True, 2, 2, 2, reps or 2, 1, TINY_VOCABS)


def versions() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "card": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": None,
        "python": platform.python_version(),
        # the CUDA caching allocator's settings (e.g. expandable_segments:True), read by torch
        # when CUDA starts: a run with them set is another configuration, named in the tables
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out["card_memory_gb"] = round(props.total_memory / 2**30, 1)
        out["driver"] = _driver()
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # not installed (CPU machines) or broken: recorded as None
        pass
    return out


def _driver() -> str | None:
    import subprocess

    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return r.stdout.strip().splitlines()[0] if r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def run(
    *,
    budget_s: float = 420.0,
    recipes: list[str] | None = None,
    sections: tuple[str, ...] = SECTIONS,
    steps: int = 10,
    data: str | None = None,
    reps: int | None = None,
    compile: bool = True,
    profile: bool = False,
    trainer_sets: tuple[str, ...] = (),
    vocabs: tuple[int, ...] | None = None,
    policy: dict[str, Any] | None = None,
    doctor: Callable[[], dict[str, Any]] | None = None,
    say: Callable[[str], None] = print,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure `sections` for `recipes` (default: every paper-l9-*) inside `budget_s` seconds.
    `save(res)` runs after every item ("complete" false until the last), so a run killed from
    outside still leaves the numbers it had. policy: tngram.kernels.kernel_policy settings for
    every section but kernels (which sets its own), recorded as "kernel_policy". vocabs: the
    tables section's vocabularies (default: the device's, GPU_VOCABS or TINY_VOCABS)."""
    from tngram.kernels import kernel_policy

    with kernel_policy(**(policy or {})) as pol:
        recorded = {
            "triton_backward": pol.triton_backward,
            "triton_backward_warps": pol.triton_backward_warps,
        }
        return _run(
            budget_s=budget_s,
            recipes=recipes,
            sections=sections,
            steps=steps,
            data=data,
            reps=reps,
            compile=compile,
            profile=profile,
            trainer_sets=trainer_sets,
            vocabs=vocabs,
            policy=recorded,
            doctor=doctor,
            say=say,
            save=save,
        )


def _run(
    *,
    budget_s: float,
    recipes: list[str] | None,
    sections: tuple[str, ...],
    steps: int,
    data: str | None,
    reps: int | None,
    compile: bool,
    profile: bool,
    trainer_sets: tuple[str, ...],
    vocabs: tuple[int, ...] | None,
    policy: dict[str, Any],
    doctor: Callable[[], dict[str, Any]] | None,
    say: Callable[[str], None],
    save: Callable[[dict[str, Any]], None] | None,
) -> dict[str, Any]:
    """`run`'s body, under its kernel policy (`policy`: what the file records of it)."""
    from tngram.train.recipes import recipe_names

    budget = Budget(budget_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = _shapes_here(device, reps, vocabs, say)
    names = paper_recipes(recipes if recipes is not None else recipe_names())
    res = _new_results(budget_s, shapes, names, sections, steps, trainer_sets, profile, policy)
    runner = _Runner(res, budget, shapes, sections, say, save)
    if doctor is not None:
        _doctor_item(runner, doctor)
    _lookup_and_kernels(runner, names, compile)
    _attention_and_optim(runner, names)
    peaks = (res["flops"]["peak_bf16_spec"], res["flops"]["peak_matmul_measured"])
    _eager_fwdbwd(runner, names, peaks, profile)
    base, rest = [r for r in names if r in BASE], [r for r in names if r not in BASE]
    for r in base if compile else []:
        runner.item(*_compiled_item(shapes, r, peaks, profile))
    _tables(runner, profile)
    trainer = partial(_trainer_item, shapes, steps=steps, data=data, sets=trainer_sets)
    for r in base:
        runner.item(*trainer(r))
    for r in rest:
        if compile:
            runner.item(*_compiled_item(shapes, r, peaks, profile))
        runner.item(*trainer(r))
    res["elapsed_s"] = round(budget.elapsed(), 1)
    res["complete"] = True
    return res


def _shapes_here(
    device: str, reps: int | None, vocabs: tuple[int, ...] | None, say: Callable[[str], None]
) -> Shapes:
    """The run's shapes on `device` (said first when tiny), with `vocabs` for the tables."""
    shapes = shapes_for(device, reps)
    if shapes.tiny:
        say(
            "no CUDA device: every item runs on the CPU at tiny shapes (2 layers, d 32, seq 64), "
            "which checks the command end to end and measures nothing about a GPU"
        )
    if vocabs:
        from dataclasses import replace

        shapes = replace(shapes, vocabs=tuple(vocabs))
    return shapes


def _new_results(
    budget_s: float,
    shapes: Shapes,
    names: list[str],
    sections: tuple[str, ...],
    steps: int,
    trainer_sets: tuple[str, ...],
    profile: bool,
    policy: dict[str, Any],
) -> dict[str, Any]:
    """The results file before any item: provenance, shapes, and the FLOP peaks (one measured)."""
    from research.bench import gpu_parts as parts

    ver = versions()
    res: dict[str, Any] = {
        "benchmark": "gpu",
        **ver,
        "card_slug": card_slug(ver["card"]),
        "device": shapes.device,
        "tiny": shapes.tiny,
        "shapes": {
            "batch": shapes.batch,
            "lookup_batch": shapes.lookup_batch,
            "table_batch": shapes.table_batch,
            "reps": shapes.reps,
            "warmup": shapes.warmup,
            "vocabs": list(shapes.vocabs),
            "tiny_sets": list(TINY_SETS) if shapes.tiny else [],
            "trainer_steps": steps,
            "trainer_sets": list(trainer_sets),
            "profile": profile,
        },
        "kernel_policy": policy,
        "budget_s": budget_s,
        "recipes": names,
        "sections": {s: {} for s in sections},
        "skipped": [],
        "complete": False,
    }
    res["flops"] = {
        "count": "tngram.model.flops.train_flops: 6 x matmul params x tokens + 12 x L x d x T x "
        "tokens (the count of `tngram plan`; lookups and elementwise work not counted)",
        "peak_bf16_spec": spec_peak(ver["card"]),
        "peak_matmul_measured": parts.matmul_peak(shapes.device, shapes.tiny),
    }
    return res


class _Runner:
    """Runs a results file's items inside the time budget: skips what no longer fits (named in
    the file), records each item's result or error, and saves after every item."""

    def __init__(
        self,
        res: dict[str, Any],
        budget: Budget,
        shapes: Shapes,
        sections: tuple[str, ...],
        say: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.res, self.budget, self.shapes, self.sections = res, budget, shapes, sections
        self.say, self.save = say, save
        self.took: dict[str, float] = {}  # section -> the longest item it ran (tiny's estimate)

    def skip(self, section: str, key: str, why: str) -> None:
        """Record `key` of `section` as skipped for `why`, and say so."""
        self.res["sections"][section][key] = {"skipped": why}
        self.res["skipped"].append(f"{section} {key}: {why}")
        self.say(f"[{self.budget.elapsed():5.0f}s] skip {section} {key} ({why})")

    def over_budget(self, cost: float, section: str = "") -> str:
        """Why an item estimated at `cost` s no longer fits the budget, or "" when it fits."""
        took = self.took
        if (
            self.shapes.tiny
        ):  # no table of CPU costs: the longest item so far of its section, or any
            cost = max(cost, took.get(section, max(took.values(), default=0.0)))
        if self.budget.fits(cost):
            return ""
        b = self.budget
        return f"time budget: {b.left():.0f} s left of {b.seconds:.0f}, needs ~{cost:.1f} s"

    def timed(self, section: str, fn: Callable[[], Any]) -> Any:
        """fn(), its time kept as the section's longest item so far."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.took[section] = max(self.took.get(section, 0.0), time.perf_counter() - t0)

    def done(self) -> None:
        """After an item: the elapsed time, the CUDA cache emptied, the file saved."""
        self.res["elapsed_s"] = round(self.budget.elapsed(), 1)
        if self.shapes.device == "cuda":
            torch.cuda.empty_cache()
        if self.save is not None:
            self.save(self.res)

    def item(
        self,
        section: str,
        key: str,
        cost: float,
        fn: Callable[[], dict[str, Any]],
        short: Callable[[], str] | None = None,
    ) -> None:
        """Run fn() as res["sections"][section][key], unless the time budget or `short()` (a
        reason it would not fit in memory, or "") says skip it."""
        if section not in self.sections:
            return
        why = self.over_budget(cost, section) or (short() if short is not None else "")
        if why:
            return self.skip(section, key, why)
        self.say(f"[{self.budget.elapsed():5.0f}s] {section} {key}")
        try:
            out = self.timed(section, fn)
        except Exception as e:  # one failed item must not lose the others' numbers
            out = {"error": f"{type(e).__name__}: {e}"[:400]}
        self.res["sections"][section][key] = out
        self.done()

    def items(
        self,
        section: str,
        keys: list[str],
        costs: list[float],
        fn: Callable[[list[str]], dict[str, Any]],
        why: str = "",
    ) -> None:
        """Items measured together: fn(chosen) -> {key: result} for the longest prefix `chosen`
        of `keys` whose summed `costs` fit the time budget; the rest, or all of them when `why`
        (a reason to skip them) is given, are skipped."""
        n = 0 if why else len(keys)
        while n and self.over_budget(sum(costs[:n]), section):
            n -= 1
        why = why or self.over_budget(sum(costs[: n + 1]), section)
        chosen, out = keys[:n], {}
        if chosen:
            self.say(f"[{self.budget.elapsed():5.0f}s] {section} {', '.join(chosen)}")
            try:
                out = self.timed(section, lambda: fn(chosen))
            except Exception as e:  # one failed group must not lose the other items' numbers
                out = {k: {"error": f"{type(e).__name__}: {e}"[:400]} for k in chosen}
        for k in keys:  # in the order of `keys`
            if k in out:
                self.res["sections"][section][k] = out[k]
            else:
                self.skip(section, k, why)
        self.done()


def _doctor_item(runner: _Runner, doctor: Callable[[], dict[str, Any]]) -> None:
    """The doctor section: `tngram doctor`'s self-checks, summarised."""
    from research.bench import gpu_parts as parts

    cost = runner.shapes.cost("doctor")
    runner.item("doctor", "self_checks", cost, lambda: parts.doctor_summary(doctor()))


def _lookup_and_kernels(runner: _Runner, names: list[str], compile: bool) -> None:
    """The lookup section, then the kernels section for every TN-gram recipe of `names`."""
    from research.bench import gpu_kernels
    from research.bench import gpu_parts as parts

    shapes, res = runner.shapes, runner.res
    runner.item("lookup", "paper-l9-tngram", shapes.cost("lookup"), lambda: parts.lookup(shapes))
    no_triton = gpu_kernels.triton_runs_here(shapes.device)
    for r in [r for r in names if has_tngram(r)] if "kernels" in runner.sections else []:
        if no_triton:  # e.g. a CPU run without the Triton interpreter: listed, not an error
            res["sections"]["kernels"][r] = {"skipped": no_triton}
            res["skipped"].append(f"kernels {r}: {no_triton}")
            continue
        backwards = partial(gpu_kernels.lookup_backwards, r, shapes, compile)
        cost = shapes.cost("kernels") + (shapes.cost("kernels_inductor") if compile else 0)
        runner.item("kernels", r, cost, backwards)


def _attention_and_optim(runner: _Runner, names: list[str]) -> None:
    """The attention section (paper-l9's shapes), then the optim section per recipe."""
    from research.bench import gpu_attention, gpu_optim

    shapes = runner.shapes
    runner.item(
        "attention",
        "paper-l9",
        shapes.cost("attention"),
        partial(gpu_attention.attention_backends, shapes),
    )
    for r in names:
        runner.item("optim", r, shapes.cost("optim"), partial(gpu_optim.optimiser_steps, r, shapes))


def _eager_fwdbwd(
    runner: _Runner, names: list[str], peaks: tuple[float | None, float], profile: bool
) -> None:
    """The fwdbwd section's eager items, one per recipe."""
    from research.bench import gpu_parts as parts

    shapes = runner.shapes
    for r in names:
        runner.item(
            "fwdbwd",
            f"{r}/eager",
            shapes.cost("eager", profile=profile),
            partial(parts.fwdbwd, r, shapes, False, peaks, profile),
        )


Item = tuple[str, str, float, Callable[[], dict[str, Any]]]


def _compiled_item(
    shapes: Shapes, r: str, peaks: tuple[float | None, float], profile: bool
) -> Item:
    """The fwdbwd section's compiled item of recipe `r`: (section, key, cost, fn)."""
    from research.bench import gpu_parts as parts

    fn = lambda: parts.fwdbwd(r, shapes, True, peaks, profile)
    return ("fwdbwd", f"{r}/compile", shapes.cost("compile", profile=profile), fn)


def _trainer_item(
    shapes: Shapes, r: str, *, steps: int, data: str | None, sets: tuple[str, ...]
) -> Item:
    """The trainer section's item of recipe `r`: (section, key, cost, fn)."""
    from research.bench import gpu_parts as parts

    cost = shapes.cost("trainer", steps) + shapes.cost("compile") * parts.trainer_compiles(
        r, shapes
    )
    fn = lambda: parts.trainer(r, shapes, steps, data, list(sets))
    return ("trainer", r, cost, fn)


def _tables(runner: _Runner, profile: bool) -> None:
    """The tables section: per vocabulary, its groups of update candidates timed together."""
    from research.bench import gpu_tables

    shapes = runner.shapes
    for V in shapes.vocabs if "tables" in runner.sections else ():
        for group, why in gpu_tables.plan(V, shapes):
            keys = [c.key for c in group]
            costs = [shapes.cost("table", vocab=V, profile=profile) for _ in group]

            def fn(chosen: list[str], group: list = group) -> dict[str, Any]:
                return gpu_tables.time_group(group[: len(chosen)], shapes, profile)

            runner.items("tables", keys, costs, fn, why)


def report(res: dict[str, Any]) -> str:
    """A short text summary (the JSON file is the result)."""
    head = (
        f"python -m research bench gpu: {res['card']} (torch {res['torch']}, triton "
        f"{res['triton']}), "
        f"{'tiny shapes' if res['tiny'] else 'paper shapes'}, {res['elapsed_s']} s of "
        f"{res['budget_s']:.0f} s budget"
    )
    lines = [head]
    for sec, items in res["sections"].items():
        for key, r in items.items():
            if "skipped" in r or "error" in r:
                lines.append(f"  {sec:8s} {key:32s} {r.get('skipped') or 'ERROR ' + r['error']}")
            elif "variants" in r:  # kernels: each backward's fwd+bwd ms, the fastest named
                ms = ", ".join(
                    f"{k} {v['fwdbwd']['median_ms']:.2f}" for k, v in r["variants"].items()
                )
                lines.append(f"  {sec:8s} {key:32s} fastest {r['fastest']} (ms: {ms})")
            elif "backends" in r:  # attention: each SDPA backend's fwd+bwd ms, torch's pick
                ms = ", ".join(
                    f"{k} {v['fwdbwd']['median_ms']:.2f}"
                    for k, v in r["backends"].items()
                    if "fwdbwd" in v
                )
                lines.append(f"  {sec:8s} {key:32s} default {r['default_backend']} (ms: {ms})")
            elif "optimisers" in r:  # optim: Adam, and Muon per matrix against stacked
                ms = ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in r["optimisers"].items())
                lines.append(f"  {sec:8s} {key:32s} ms: {ms}")
            elif "median_ms" in r:
                lines.append(f"  {sec:8s} {key:32s} {r['median_ms']:9.2f} ms")
                lines += _profile_line(r.get("profile"))
            elif "tokens_per_s" in r:
                lines.append(f"  {sec:8s} {key:32s} {r['tokens_per_s']:12,.0f} tokens/s")
            else:
                lines.append(f"  {sec:8s} {key:32s} done")
    return "\n".join(lines)


def _profile_line(p: dict[str, Any] | None) -> list[str]:
    """An item's profile (fwdbwd or tables) in one line: ms per step by category (--profile)."""
    if p is None:
        return []
    if "error" in p:
        return [f"  {'':8s} {'  profile':32s} ERROR {p['error']}"]
    cats = ", ".join(f"{c} {ms:.2f}" for c, ms in p["categories"].items() if ms)
    return [f"  {'':8s} {'  profile':32s} {p['total_ms']:9.2f} ms {p['time']}: {cats}"]
