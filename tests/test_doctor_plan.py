"""`tngram doctor` (versions, lookups, self-checks, advice) and `tngram plan` (GPU memory/time).

plan is checked for plausibility against the paper's setting (App. E: L9, 4 x A100 80 GB,
global batch 524,288 tokens of length 1024) and its activation tracing against the memory a
real CPU forward of the mini recipe holds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tngram.kernels.choice as choice
from tngram.cli import main
from tngram.kernels import c_unavailable_reason
from tngram.kernels.tngram_c import c_lookup



@pytest.mark.skipif(c_unavailable_reason() is not None, reason="C kernel unavailable")
def test_doctor_reports_lookups_self_checks_and_what_to_install(fresh_lookup_choice, capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tngram_lookup"]["cpu/float32"] == "c"
    assert info["tngram_lookup"]["cpu/bfloat16"].startswith("torch")
    assert info["self_checks"]["c/float32"]["passed"] and info["c_kernel"]["openmp"]
    assert any("no CUDA device" in a for a in info["advice"])      # this machine has no GPU
    # paper-l9's attention in the CPU's training dtype: torch's CPU flash kernel; Muon per matrix
    assert info["attention"] == {"cpu/float32": "flash"} and info["muon"] == {"cpu": "loop"}
    # a kernel that fails its self-check: exit 1, FAILED in the table, advice to report it
    fresh_lookup_choice.setattr(choice, "_CHOICE", {})
    fresh_lookup_choice.setattr(choice, "SELF_CHECKS", {})
    fresh_lookup_choice.setitem(choice.IMPL_FNS, "c", lambda *a: c_lookup(*a) * 1.01)
    with pytest.warns(RuntimeWarning):
        assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "attention kernel torch picks for paper-l9 (run.sdpa=auto): cpu/float32 -> flash" in out
    assert "Muon's Newton-Schulz: cpu -> loop (TNGRAM_MUON_IMPL=auto)" in out
    assert "c/float32" in out and "FAILED" in out and "TN-gram cpu/float32    -> torch (c kernel failed" in out


def test_plan_is_plausible_for_the_papers_l9_on_4_a100(capsys):
    from tngram.train.recipes import get_recipe, param_summary
    assert main(["plan", "paper-l9-tngram", "--gpus", "4", "--gpu-mem", "80", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["params"] == param_summary(get_recipe("paper-l9-tngram"))["total_params"]
    assert r["adam_params"] + r["muon_params"] == r["params"]
    # static: fp32 weights + grads + DDP buckets (12 B/param) + Adam 8 B + Muon 4 B per param
    assert r["static_total_bytes"] == 12 * r["params"] + 8 * r["adam_params"] + 4 * r["muon_params"]
    f = r["no_checkpointing"]
    # the paper trained this on 4 x A100 80 GB: it must fit, with the global batch exact
    assert f["fits"] and f["micro_batch_seqs"] >= 16
    assert 4 * f["micro_batch_seqs"] * f["grad_accum"] * 1024 == 524_288
    assert f["peak_bytes"] <= 80e9
    # activations in d-sized bf16 vectors per layer per token: a standard block saves ~17
    # (Korthikanti et al. 2022, "34 s h" bytes per layer in half precision); the memory layers'
    # (N-1) R = 8 d vectors and the fp32 logits add some. Measured 34; outside 8..200 is a bug.
    assert 8 < f["activation_bytes_per_seq"] / (1024 * 9 * 512 * 2) < 200
    ck = r["block_checkpointing"]
    assert ck["activation_bytes_per_seq"] < f["activation_bytes_per_seq"]
    # 6 x 35.9M params x 524,288 tokens ~ 1.1e14 FLOPs: 0.05..5 s at 35% of 312 TFLOP/s x 4
    assert 1e14 < r["flops_per_step"] < 1.3e14 and 0.05 < r["step_seconds"] < 5


def test_plan_rejects_bad_arguments_and_reports_what_does_not_fit(capsys):
    assert main(["plan", "paper-l9-raw", "--gpus", "0"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["plan", "nope", "--gpus", "1"]) == 2
    assert main(["plan", "mini-raw", "--gpus", "1", "--gpu-mem", "1.2", "--dtype", "fp32"]) == 0
    assert "does NOT fit" in capsys.readouterr().out   # 1.2 GB - 10% - 1 GiB CUDA context < 0


RSS = textwrap.dedent("""
    import json, torch
    from research.bench.common import vm_rss_bytes
    from tngram.model.gpt import GPT
    from tngram.cli.plan import activation_bytes
    from tngram.train.recipes import get_recipe
    torch.set_num_threads(1)
    m = get_recipe("mini-tngram").model
    traced = activation_bytes(m, 8, "fp32")["total"]
    torch.manual_seed(0)
    model = GPT(m)
    ids = torch.randint(0, m.vocab_size, (8, m.sequence_len))
    model(ids[:1, :8], ids[:1, :8]).backward()      # warm-up: kernels built, allocator primed
    model.zero_grad(set_to_none=True)
    base = vm_rss_bytes()
    loss = model(ids, ids)
    print(json.dumps({"traced": traced, "held": vm_rss_bytes() - base}))
""")


def test_plan_activation_tracing_matches_memory_a_cpu_forward_holds():
    """After a forward, the process holds at least the saved tensors (traced) and at most those
    plus freed temporaries glibc keeps mapped; measured 1.1-1.45x at mini on this machine, and
    in CI runs once 0.89x and once 0.79x (beside two training runs; pages the warm-up had left
    resident were reused): hence 0.75, still well above what an over-count would give."""
    out = subprocess.run([sys.executable, "-c", RSS], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MALLOC_MMAP_MAX_": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.75 * r["traced"] <= r["held"] <= 1.6 * r["traced"], r


RESULTS = Path(__file__).resolve().parents[1] / "research" / "results"
FIRST_CHECK_SETS = {"": ["run.compile=false"], "compile": ["run.compile=true"],
                    "sparse": ["run.compile=false", "optim.memory_update=sparse"]}


def h200_trainer_runs() -> list[tuple[str, str, list[str], float]]:
    """(file, recipe, --set items, tokens/s) of every `tngram train` run on the H200 in the
    committed results: the bench's trainer items (compiled, run.compile=auto on CUDA) and the
    first check's runs (eager, the trainer's default at that commit; +compile, +sparse)."""
    runs = []
    for f in sorted(RESULTS.glob("gpu-h200-*.json")):
        d = json.loads(f.read_text())
        sets = list(d.get("shapes", {}).get("trainer_sets") or [])
        for recipe, r in d.get("sections", {}).get("trainer", {}).items():
            if "tokens_per_s" in r:             # (items measured wrongly hold only an error)
                assert r["compile"]["ran"] == "compiled"
                runs.append((f.name, recipe, sets + AS_RUN.get((f.name, recipe), []),
                             r["tokens_per_s"]))
        for key, r in d.get("train", {}).get("runs", {}).items():
            name, _, extra = key.partition("+")
            runs.append((f.name, f"paper-l9-{name}", FIRST_CHECK_SETS[extra],
                         r["median_tokens_per_s"]))
    return runs


# the recipe as that run had it: paper-l9-tngram-sum had R 1535 at 226f92a (R 1520 since,
# 6928007); the file's fwdbwd item records the model's parameters, checked below
AS_RUN = {
    ("gpu-h200-226f92a-b-variants.json", "paper-l9-tngram-sum"): ["model.memory.cp_rank=1535"]
}
# runs the plan misses by more than 15%, each with the measurement that says why (checked below)
SLOWER_THAN_FLOPS = {
    ("gpu-h200-7608a19-a.json", "paper-l9-tngram-sum"): "per-order norm + absorption passes",
    ("gpu-h200-226f92a-b-variants.json", "paper-l9-tngram-sum"): "R 1535: misaligned lookup",
}


def lookup_elementwise_flops(cfg) -> float:
    """TN-gram's lookup work per token that train_flops leaves out, from Eqs. 10-11 and the
    variant's sum: per memory layer and order n = 2..N, the prefix product and the absorption
    product (R each), RMSNorm (square, sum, scale: 3R) and s_n (R); the sum of the N-1 orders
    ((N-2)R adds); backward twice the forward (the 6 = 2 + 4 of the matmul count)."""
    mem = cfg.model.memory
    R, orders = mem.cp_rank, mem.max_ngram - 1
    fwd = orders * R * (1 + mem.use_absorption + 3 * mem.use_norm + mem.learn_scales)
    fwd += (orders - 1) * R * (getattr(mem, "order_combine", "concat") == "sum")
    return 3.0 * fwd * len(cfg.model.memory_layers)


def fwdbwd(name: str, item: str) -> dict:
    return json.loads((RESULTS / name).read_text())["sections"]["fwdbwd"][item]


@pytest.mark.skipif(not RESULTS.is_dir(), reason="research/results/ is not beside the tests")
def test_plan_on_the_h200_is_within_15_percent_of_every_trainer_run_measured_there():
    from tngram.cli.plan import MFU_COMPILED, MFU_EAGER, speed
    from tngram.model.gpt import GPT
    from tngram.train.recipes import resolve_config

    runs = h200_trainer_runs()
    assert len(runs) >= 20
    off, mfu, cfgs = {}, {True: [], False: []}, {}
    for name, recipe, sets, tps in runs:
        cfgs[name, recipe] = cfg = resolve_config(recipe, sets)
        p = speed(cfg, 1, "H200")
        off[(name, recipe, *sets)] = p["tokens_per_s"] / tps - 1
        if recipe in ("paper-l9-raw", "paper-l9-engram", "paper-l9-tngram"):
            mfu[cfg.run.compile is not False].append(p["mfu"] * tps / p["tokens_per_s"])
    # the default MFUs are the medians of the paper recipes' runs (10 compiled, 5 eager)
    assert abs(MFU_COMPILED - statistics.median(mfu[True])) < 5e-4 and len(mfu[True]) == 10
    assert abs(MFU_EAGER - statistics.median(mfu[False])) < 5e-3 and len(mfu[False]) == 5
    outside = {k[:2]: round(v, 3) for k, v in off.items() if abs(v) > 0.15}
    assert set(outside) == set(SLOWER_THAN_FLOPS), outside
    with torch.device("meta"):  # the R 1535 model is the one 226f92a measured
        old = GPT(cfgs["gpu-h200-226f92a-b-variants.json", "paper-l9-tngram-sum"].model)
    old_item = fwdbwd("gpu-h200-226f92a-b-variants.json", "paper-l9-tngram-sum/compile")
    assert sum(p.numel() for p in old.parameters()) == old_item["params"]
    for (name, recipe), v in outside.items():
        # not a FLOP the count misses: the lookup's elementwise work is < 0.2% of the step's
        cfg = cfgs[name, recipe]
        per_token = speed(cfg, 1, "H200")["flops_per_step"] / cfg.data.global_batch_tokens
        assert lookup_elementwise_flops(cfg) < 0.002 * per_token
        # the time is in forward + backward: the same commit's fwdbwd item is as slow (±5%)
        item = old_item if "226f92a" in name else fwdbwd("gpu-h200-7608a19-c.json",
                                                         f"{recipe}/compile")
        tps = dict((r[:2], r[3]) for r in runs)[name, recipe]
        assert abs(item["tokens_per_s"] / tps - 1) < 0.05
    # why it is slow, measured on the card: at R 1520 the norm + absorption passes cost 16% of
    # the step at the same train_flops (sum-lean drops only them, and the plan is 8.5% off it);
    # R 1535 (misaligned rows for the Triton lookup) took 20% longer again than R 1520
    lean = fwdbwd("gpu-h200-7608a19-c.json", "paper-l9-tngram-sum-lean/compile")
    now = fwdbwd("gpu-h200-7608a19-c.json", "paper-l9-tngram-sum/compile")
    assert lean["flops"] == now["flops"] and now["median_ms"] / lean["median_ms"] > 1.15
    assert old_item["median_ms"] / now["median_ms"] > 1.15


def test_plan_card_presets(capsys):
    """--card sets the card's memory and dense bf16 peak; the MFU is said measured on the H200
    and assumed elsewhere; a card we do not know is one line naming those we do."""
    from tngram.cli.plan import CARDS, MFU_COMPILED

    assert {"A100", "H100", "H200", "L40S", "RTX4090"} <= set(CARDS)
    for card, (peak, mem, said) in {"h200": (989.4, 141, "measured"),
                                    "L40S": (362.05, 48, "assumed: measured on an H200"),
                                    "rtx-4090": (165.2, 24, "assumed")}.items():
        assert main(["plan", "mini-tngram", "--card", card, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert (r["peak_tflops"], r["gpu_mem_gb"]) == (peak, mem)
        assert r["mfu_source"].startswith(said) and r["mfu"] == MFU_COMPILED
    assert main(["plan", "mini-tngram", "--card", "H100", "--mfu", "0.3", "--gpu-mem", "94",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["mfu"], r["mfu_source"], r["gpu_mem_gb"], r["peak_tflops"]) == (0.3, "given", 94, 989.4)
    assert main(["plan", "mini-tngram", "--card", "B300"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "H200" in err and "RTX4090" in err
