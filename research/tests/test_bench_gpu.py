"""`python -m research bench gpu` at tiny shapes on the CPU (research.bench.gpu), its results file, and the
research/GPU.md blocks generated from the GPU results files (research.report.gpu_blocks)."""

from research.cli import main as research_main
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from research.bench.gpu import SECTIONS, TINY_VOCABS, card_slug, paper_recipes
from research.bench.gpu_kernels import TINY_KERNEL_TOKENS, triton_runs_here
from research.cli.bench_gpu import GPU_SECTIONS
from research.cli.bench_gpu import TRITON_BACKWARDS as CLI_BACKWARDS
from tngram.kernels.policy import TRITON_BACKWARDS
from tngram.kernels import triton_available
from research.report.docblocks import check_doc, load_snapshot, render
from research.report.gpu_blocks import measured_in, render_run

from test_train_support import one_thread, tiny_data  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["paper-l9-raw", "paper-l9-tngram"]


@pytest.fixture(scope="module")
def cpu_run(tiny_data, tmp_path_factory):  # noqa: F811
    """One CLI run at tiny shapes: raw and TN-gram, every section, no compile (CPU compile takes
    tens of seconds), 3 trainer steps on the tiny dataset."""
    out = tmp_path_factory.mktemp("bench-gpu")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = ["bench", "gpu", "--out", str(out), "--data", str(tiny_data), "--stop-after", "3"]
        rc = research_main(args + ["--recipes", *RECIPES, "--no-compile"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    path = out / "gpu-cpu.json"  # the card slug of a CPU run
    return path, json.loads(path.read_text())


def test_card_slug_from_device_names():
    assert card_slug("NVIDIA H200") == "h200"
    assert card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert card_slug("cpu") == "cpu"


def test_every_paper_l9_recipe_is_picked_up_base_first():
    names = ["mini-raw", "paper-l9-zz-fast", "paper-l9-tngram", "paper-l18-raw", "paper-l9-raw"]
    names += ["paper-l9-engram", "paper-l9-a-sum"]
    assert paper_recipes(names) == [
        "paper-l9-raw",
        "paper-l9-engram",
        "paper-l9-tngram",
        "paper-l9-a-sum",
        "paper-l9-zz-fast",
    ]
    from tngram.train.recipes import recipe_names

    every = [n for n in recipe_names() if n.startswith("paper-l9-")]
    assert sorted(paper_recipes(recipe_names())) == sorted(every)


def test_results_file_schema_and_provenance(cpu_run):
    path, r = cpu_run
    assert r["kind"] == "bench-gpu" and r["complete"] is True and r["tiny"] is True
    assert r["card"] == "cpu" and r["card_slug"] == "cpu" and r["torch"] == torch.__version__
    assert (
        "triton" in r
        and r["commit"]
        and r["machine"]
        and r["command"].startswith("python -m research bench gpu")
    )
    # the kernels section needs the Triton lookup, which a plain CPU process cannot run: its
    # item is listed as skipped with the reason (test_kernels_section_under_the_interpreter)
    why = triton_runs_here("cpu")
    assert why and r["skipped"] == [f"kernels paper-l9-tngram: {why}"]
    assert r["sections"]["kernels"] == {"paper-l9-tngram": {"skipped": why}}
    assert set(r["sections"]) == {"doctor", "lookup", "kernels", "attention", "optim", "fwdbwd",
                                  "trainer", "tables"}
    assert tuple(r["sections"]) == SECTIONS == GPU_SECTIONS  # the CLI's list is the bench's
    assert TRITON_BACKWARDS == CLI_BACKWARDS
    for name, sec in r["sections"].items():
        for key, item in sec.items() if name != "kernels" else ():
            assert "error" not in item and "skipped" not in item, (key, item)
    doc = r["sections"]["doctor"]["self_checks"]
    assert (
        doc["passed"] is True
        and doc["tngram_lookup"]["cpu/float32"] in ("c", "torch")
        or (doc["tngram_lookup"]["cpu/float32"].startswith("torch"))
    )


def test_lookup_check_kernel_agrees_with_torch(cpu_run):
    lk = cpu_run[1]["sections"]["lookup"]["paper-l9-tngram"]
    assert lk["kernel"] == "c"
    # fp32: the C kernel's documented self-check tolerance (tngram.kernels.choice, 1e-4)
    assert abs(lk["model_fp32"]["loss_kernel"] - lk["model_fp32"]["loss_torch"]) < 1e-5
    assert lk["model_fp32"]["max_rel_grad_err"] < 1e-4 and lk["model_fp32"]["n_grads"] > 0
    assert lk["model_bf16"]["max_rel_grad_err"] < 3e-2  # the bf16 tolerance
    for dt in ("fp32", "bf16"):
        t, c = lk[f"time_torch_{dt}"]["median_ms"], lk[f"time_c_{dt}"]["median_ms"]
        assert lk[f"speedup_{dt}"] == pytest.approx(t / c)


def _tiny_model(recipe):
    from research.bench.gpu import shapes_for
    from research.bench.gpu_parts import config
    from tngram.model.gpt import GPT

    cfg = config(recipe, shapes_for("cpu"))
    return cfg.model, GPT(cfg.model)


def test_fwdbwd_flops_and_mfu_from_an_independent_count(cpu_run):
    r = cpu_run[1]
    peak = r["flops"]["peak_matmul_measured"]["flops"]
    for recipe in RECIPES:
        e = r["sections"]["fwdbwd"][f"{recipe}/eager"]
        m, model = _tiny_model(recipe)
        linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, nn.Linear))
        tokens = r["shapes"]["batch"] * m.sequence_len
        # 6 x (linear weights + tied head V x d) x tokens + 12 L d T x tokens (PaLM's count)
        flops = 6 * (linear + m.vocab_size * m.n_embd) * tokens
        flops += 12 * m.n_layer * m.n_embd * m.sequence_len * tokens
        assert e["tokens"] == tokens and e["flops"] == flops
        assert e["tokens_per_s"] == pytest.approx(tokens / (e["median_ms"] / 1e3))
        assert e["of_measured_matmul_peak"] == pytest.approx(flops / (e["median_ms"] / 1e3) / peak)
        assert e["mfu_spec"] is None and e["peak_gb"] is None  # no spec peak / no CUDA memory
        assert e["min_ms"] <= e["median_ms"] <= e["max_ms"]
        assert f"{recipe}/compile" not in r["sections"]["fwdbwd"]  # --no-compile


def test_trainer_section_runs_the_real_trainer(cpu_run):
    r = cpu_run[1]
    for recipe in RECIPES:
        t = r["sections"]["trainer"][recipe]
        assert t["steps"] == 3 and len(t["losses"]) == 3 and t["tokens_per_step"] == 128
        assert t["last_train_loss"] == pytest.approx(t["losses"][-1], abs=1e-4)
        assert t["tokens_per_s"] > 0 and t["val_bpb"] > 0
    assert r["sections"]["trainer"]["paper-l9-tngram"]["lookup_impl"] in ("c", "torch")
    # the run's env.json says how Muon ran (per matrix on the CPU), and the table says it
    assert {r["sections"]["trainer"][x]["muon_impl"] for x in RECIPES} == {"loop"}
    # and which attention kernel torch picked for the model (the CPU's flash kernel, run.sdpa auto)
    assert {r["sections"]["trainer"][x]["sdpa_backend"] for x in RECIPES} == {"flash"}
    assert "| eager (Newton-Schulz eager, loop; attention flash) |" in render_run(r, "gpu-cpu.json")


def test_trainer_set_reaches_the_run_and_its_table(tiny_data, tmp_path):  # noqa: F811
    out = tmp_path / "r.json"
    args = ["bench", "gpu", "--out", str(out), "--data", str(tiny_data), "--stop-after", "3"]
    args += ["--sections", "trainer", "--recipes", "paper-l9-tngram"]
    assert research_main(args + ["--set", "optim.memory_update=sparse"]) == 0
    r = json.loads(out.read_text())
    assert r["shapes"]["trainer_sets"] == ["optim.memory_update=sparse"]
    t = r["sections"]["trainer"]["paper-l9-tngram"]
    assert t["steps"] == 3 and t["row_update"].split()[0] in ("triton", "torch")  # sparse ran
    assert "--stop-after 3 --set optim.memory_update=sparse`" in render_run(r, "r.json")


def test_tables_every_vocab_and_update(cpu_run):
    tab = cpu_run[1]["sections"]["tables"]
    for V in TINY_VOCABS:
        assert tab[f"raw@{V}"]["table_params"] == 0
        for m in ("engram", "tngram"):
            for u in ("dense", "sparse", "rowwise"):
                assert tab[f"{m}@{V}/{u}"]["median_ms"] > 0
    # TN-gram's factor tables are V x cp_rank per order: their count grows linearly with V
    lo, hi = TINY_VOCABS[0], TINY_VOCABS[-1]
    t_lo, t_hi = (
        tab[f"tngram@{lo}/dense"]["table_params"],
        tab[f"tngram@{hi}/dense"]["table_params"],
    )
    assert t_hi * lo == t_lo * hi
    assert tab[f"tngram@{hi}/sparse"]["table_params"] == t_hi


def test_run_renders_its_numbers(cpu_run):
    r = cpu_run[1]
    text = render_run(r, "research/results/gpu-cpu.json")
    e = r["sections"]["fwdbwd"]["paper-l9-tngram/eager"]
    assert f"{e['median_ms']:.1f}" in text
    assert f"{r['sections']['trainer']['paper-l9-raw']['tokens_per_s']:,.0f}" in text
    assert "not run" in text  # the compiled column (--no-compile)


def test_vocabs_choose_the_table_steps(tmp_path, one_thread):  # noqa: F811
    """--vocabs: the tables section steps at those vocabularies only (the next card's sparse
    question at V 32,768 alone); the file records them."""
    out = tmp_path / "t.json"
    rc = research_main(["bench", "gpu", "--out", str(out), "--sections", "tables", "--vocabs", "300",
               "--recipes", "paper-l9-raw"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["shapes"]["vocabs"] == [300]
    keys = ["raw@300"] + [f"{m}@300/{u}" for m in ("engram", "tngram")
                          for u in ("dense", "sparse", "rowwise")]
    assert list(r["sections"]["tables"]) == keys


def test_attention_section_per_backend(cpu_run):
    """paper-l9's attention at the tiny shapes (TINY_SETS: d 32, 2 heads, 1 kv head, seq 64; the
    fwdbwd batch of 2): torch's pick named, every backend that runs timed and within fp32
    rounding of the fp32 math reference, the others listed with their error (the CPU has no
    cuDNN or memory-efficient kernel), the FLOP rate from 7 B H T^2 D."""
    from torch.nn.attention import SDPBackend

    r = cpu_run[1]
    it = r["sections"]["attention"]["paper-l9"]
    assert it["shape"] == {"batch": 2, "heads": 2, "kv_heads": 1, "seq": 64, "head_dim": 16}
    assert it["flops_fwdbwd"] == 7 * 2 * 2 * 64 * 64 * 16 and it["dtype"] == "float32"
    q = torch.zeros(2, 64, 2, 16).transpose(1, 2)
    kv = torch.zeros(2, 64, 1, 16).transpose(1, 2)
    pick = SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=True))
    assert it["default_backend"] == pick.name.lower().replace("_attention", "")
    rows = it["backends"]
    assert {"cudnn", "efficient"} <= {k for k, v in rows.items() if "error" in v}
    for name in ("flash", "math", "default"):
        t = rows[name]["fwdbwd"]
        assert rows[name]["tflops"] == pytest.approx(it["flops_fwdbwd"] / t["median_ms"] / 1e9)
    assert rows["math"]["rel_diff"] == 0.0 and rows["flash"]["rel_diff"] < 1e-5
    assert rows["default"]["backend"] == it["default_backend"]
    assert it["fastest"] in ("flash", "math")
    text = render_run(r, "gpu-cpu.json")
    assert f"torch's own pick here: `{it['default_backend']}`" in text
    assert f"| `math` | {rows['math']['fwdbwd']['median_ms']:.2f} |" in text
    assert "| `cudnn` | cannot run here (its error is in the file) |" in text


def test_optim_section_times_both_muons_and_they_agree(cpu_run):
    """The optimiser step alone: Adam, Muon per matrix and stacked, for each recipe. The tiny
    GPT has 6 Muon matrices a block (q, k, v, attention out, fc, MLP out) and 2 layers; the
    TN-gram recipe adds its memory layer's K and V projections. On the CPU the two Muons'
    updates are bit-equal (tests/test_optim_muon.py), so the recorded difference is 0."""
    r = cpu_run[1]
    sec = r["sections"]["optim"]
    assert list(sec) == RECIPES
    for name, it in sec.items():
        assert it["muon_matrices"] == 6 * 2 + (2 if "tngram" in name else 0)
        assert sum(it["muon_shapes"].values()) == it["muon_matrices"]
        assert it["newton_schulz"] == "eager" and it["update_rel_diff"] == 0.0
        t = it["optimisers"]
        assert set(t) == {"adam", "muon/loop", "muon/stacked"}
        assert all(v["reps"] == r["shapes"]["reps"] for v in t.values())
        ratio = t["muon/stacked"]["median_ms"] / t["muon/loop"]["median_ms"]
        assert it["stacked_over_loop"] == pytest.approx(ratio)
    text = render_run(r, "research/results/gpu-cpu.json")
    it = sec["paper-l9-tngram"]
    assert (f"| paper-l9-tngram | 14 ({len(it['muon_shapes'])}) | "
            f"{it['optimisers']['adam']['median_ms']:.2f} | ") in text
    assert "the stacked updates within 0.0e+00 (relative) of the per-matrix ones" in text


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton)")
def test_kernels_section_under_the_interpreter(tmp_path):
    """`--sections kernels` as a user runs it, in a process with the Triton interpreter: every
    backward variant of the summed recipe's lookup at two warps counts, gradients agreeing
    with the default's, `fastest` the lowest median, the bwd time the difference of medians,
    and the docs table showing it."""
    out = tmp_path / "k.json"
    cmd = [sys.executable, "-m", "research", "bench", "gpu", "--out", str(out), "--sections",
           "kernels", "--recipes", "paper-l9-raw", "paper-l9-tngram-sum", "--reps", "1"]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["skipped"] == [] and list(r["sections"]["kernels"]) == ["paper-l9-tngram-sum"]
    it = r["sections"]["kernels"]["paper-l9-tngram-sum"]
    assert it["tokens"] == TINY_KERNEL_TOKENS and it["order_combine"] == "sum"
    assert it["cp_rank"] == 24 and it["max_ngram"] == 5 and it["absorption"] and it["use_norm"]
    v = it["variants"]
    # default_warps(24) is 4 (BLOCK_R 32 <= 1024): each Triton backward at the forward's warps
    # and twice them, and the plain-autograd stage compiled by torch.compile (no --no-compile)
    assert sorted(v) == ["fused/w4", "fused/w8", "inductor", "sorted/w4", "sorted/w8",
                         "split/w4", "split/w8"]
    for k, x in v.items():
        assert x["grad_rel_diff"] < 1e-5  # fp32: only the order of the sums differs
        if k == "inductor":
            assert x["backward"] == "inductor" and x["warps"] is None and x["bwd_ms"] is None
            continue
        assert k == f"{x['backward']}/w{x['warps']}"
        assert x["bwd_ms"] == pytest.approx(x["fwdbwd"]["median_ms"] - it["fwd"]["median_ms"])
    assert v["inductor"]["fwdbwd"]["reps"] == 1
    a = it["row_grads"]  # the factor-gradient adds alone: M N rows of R into N V rows
    assert (a["adds"], a["width"]) == (TINY_KERNEL_TOKENS * 5, 24)
    assert a["rows"] == 5 * 1024  # N factors of paper-l9's vocabulary (the tiny sets keep it)
    assert set(a["timings"]) == {"copy", "atomic/uniform", "sorted/uniform", "atomic/zipf",
                                 "sorted/zipf"}
    assert a["sorted_rel_diff/uniform"] < 1e-6 and a["sorted_rel_diff/zipf"] < 1e-6
    assert v["fused/w4"]["grad_rel_diff"] == 0.0  # the reference itself
    assert it["fastest"] == min(v, key=lambda k: v[k]["fwdbwd"]["median_ms"])
    text = render_run(dict(r, tiny=False), "k.json")
    ratio = v["split/w8"]["fwdbwd"]["median_ms"] / v["fused/w4"]["fwdbwd"]["median_ms"]
    assert f"{v['split/w8']['fwdbwd']['median_ms']:.2f} ({ratio:.2f}×)" in text
    assert f"`{it['fastest']}` |" in text and "(one TN-gram module, uniform random ids, float32 output)" in text
    assert "`inductor`: the same stage without a hand-written kernel" in text
    t = a["timings"]
    assert (f"| paper-l9-tngram-sum | {TINY_KERNEL_TOKENS * 5:,} × 24 | "
            f"{t['copy']['median_ms']:.2f} | {t['atomic/uniform']['median_ms']:.2f} / "
            f"{t['sorted/uniform']['median_ms']:.2f} | {a['max_row_adds/uniform']:,} |") in text
    ratio = v["inductor"]["fwdbwd"]["median_ms"] / v["fused/w4"]["fwdbwd"]["median_ms"]
    assert f"{v['inductor']['fwdbwd']['median_ms']:.2f} ({ratio:.2f}×)" in text
    fast = v[it["fastest"]]["fwdbwd"]["median_ms"]  # the command's own summary names it too
    assert f"fastest {it['fastest']} (ms: " in p.stdout and f"{it['fastest']} {fast:.2f}" in p.stdout


def test_kernel_policy_reaches_the_sections_and_the_file(tmp_path):
    """--triton-backward / --triton-backward-warps hold while the sections run (the doctor
    section, run inside, sees them), are recorded, named in the run's heading, and undone
    after the run."""
    from research.bench import gpu
    from tngram.kernels import current_policy

    seen = []

    def doctor():
        seen.append(current_policy())
        return {"passed": True, "self_checks": {}}

    pol = {"triton_backward": "split", "triton_backward_warps": 8}
    res = gpu.run(sections=("doctor",), recipes=["paper-l9-raw"], policy=pol, doctor=doctor,
                  say=lambda _: None)
    assert (seen[0].triton_backward, seen[0].triton_backward_warps) == ("split", 8)
    assert res["kernel_policy"] == pol and current_policy().triton_backward == "fused"
    fields = {"commit": "abc1234", "command": "x", "machine": "m"}
    assert "Triton backward: split, 8 warps" in render_run(dict(res, **fields), "x.json")
    res = gpu.run(sections=("doctor",), recipes=["paper-l9-raw"], doctor=doctor,
                  say=lambda _: None)
    assert res["kernel_policy"] == {"triton_backward": "fused", "triton_backward_warps": 0}
    assert "Triton backward" not in render_run(dict(res, **fields), "x.json")  # the default


def test_allocator_settings_are_recorded_and_named(monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF changes how a step allocates on CUDA: the file records it and
    the tables' heading names it; unset, neither says anything."""
    from research.bench import gpu

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert gpu.versions()["alloc_conf"] is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    res = gpu.run(sections=("doctor",), recipes=["paper-l9-raw"], say=lambda _: None)
    assert res["alloc_conf"] == "expandable_segments:True"
    fields = {"commit": "abc1234", "command": "x", "machine": "m"}
    assert "; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)" in render_run(dict(res, **fields), "x.json")


def test_allocator_trips_per_step_and_their_line():
    """On CUDA each timed item records how often per call the caching allocator went to the
    driver (the cumulative segment count of torch.cuda.memory_stats) or retried; the tables
    block names the items where it did."""
    from research.bench.gpu_parts import alloc_deltas
    from research.report.gpu_blocks import tables_table

    before = {"segment.all.allocated": 40, "num_alloc_retries": 1, "other": 7}
    after = {"segment.all.allocated": 55, "num_alloc_retries": 1, "other": 9}
    assert alloc_deltas(before, after, 10) == {"cuda_mallocs": 1.5, "alloc_retries": 0.0}
    item = {"median_ms": 90.0, "min_ms": 80.0, "max_ms": 99.0, "reps": 10}
    sec = {"raw@1024": dict(item, cuda_mallocs=0.0), "tngram@1024/sparse": dict(item, cuda_mallocs=1.5)}
    snap = {"sections": {"tables": sec}, "shapes": {"table_batch": 16, "vocabs": [1024]}}
    text = tables_table(snap)
    assert "per timed step, where any: tngram@1024/sparse 1.5." in text
    assert "raw@1024 0.0" not in text
    snap["sections"]["tables"] = {"raw@1024": item}  # an older file: no counts, no line
    assert "cudaMalloc" not in tables_table(snap)


def test_gpu_md_regenerates_and_tiny_runs_are_not_gpu_figures(cpu_run, tmp_path):
    assert check_doc(ROOT / "research" / "GPU.md") == []
    docs = tmp_path / "docs"
    (tmp_path / "research" / "results").mkdir(parents=True)
    docs.mkdir()
    shutil.copy(ROOT / "research" / "GPU.md", docs / "GPU.md")
    committed = sorted((ROOT / "research" / "results").glob("gpu*.json"))
    for path in committed:
        shutil.copy(path, tmp_path / "research" / "results" / path.name)
    shutil.copy(cpu_run[0], tmp_path / "research" / "results" / "gpu-cpu.json")
    snap = load_snapshot(docs / "GPU.md", "gpu")
    gpu_runs = [n for n, _ in snap["runs"]]
    assert "gpu-cpu.json" not in gpu_runs  # a tiny CPU run is left out
    assert check_doc(docs / "GPU.md") == []
    # the open table's logic on a run taken as full-size (a copy; nothing committed)
    run = dict(cpu_run[1], tiny=False)
    (tmp_path / "research" / "results" / "gpu-cpu.json").write_text(json.dumps(run))
    index = json.loads((tmp_path / "research" / "results" / "gpu.json").read_text())
    index["order"].append("gpu-cpu.json")  # the newest run (a full-size run must be listed)
    (tmp_path / "research" / "results" / "gpu.json").write_text(json.dumps(index))
    snap = load_snapshot(docs / "GPU.md", "gpu")
    assert [n for n, _ in snap["runs"]] == gpu_runs + ["gpu-cpu.json"]
    wanted = {w["label"]: w for w in snap["wanted"]}
    base = snap["base_recipes"]
    eager = wanted["fwd+bwd eager, paper-l9 raw / Engram / TN-gram"]
    assert not measured_in(eager, run, base)  # Engram was not run
    run3 = dict(run, recipes=["paper-l9-raw", "paper-l9-tngram"])
    assert not measured_in(wanted["fwd+bwd compiled, paper-l9 raw / Engram / TN-gram"], run3, base)
    v1k = wanted["one step with dense / sparse / rowwise tables at V 1,024"]
    assert not measured_in(v1k, run, base)  # tiny vocabularies, not 1,024
    assert measured_in(wanted["`tngram doctor` Triton self-checks on the card"], run, base)
    assert "`gpu-cpu.json`" in render(snap, "gpu")
    # both index blocks are stale until regenerated (each names the files it read)
    assert check_doc(docs / "GPU.md") == ["gpu:goals", "gpu"]


def test_budget_skips_items_and_names_them(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", "gpu", "--out", str(out), "--budget", "0.01", "--sections", "fwdbwd"]
    assert research_main(args + ["tables", "--recipes", "paper-l9-raw", "--no-compile"]) == 0
    r = json.loads(out.read_text())
    items = [(s, k) for s, sec in r["sections"].items() for k in sec]
    assert len(items) == 1 + 7 * len(TINY_VOCABS) and len(r["skipped"]) == len(items)
    assert all("time budget" in r["sections"][s][k]["skipped"] for s, k in items)
    assert "skipped (budget)" in render_run(r, "x.json")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--recipes", "mini-raw"], "--recipes"),
        (["--out", "/nonexistent-h39c/dir"], "does not exist"),
        (["--data", "/nonexistent-h39c-data"], "nonexistent-h39c-data"),
        (["--set", "optim.nope=1"], "optim.nope"),
        (["--recipes", "paper-l9-raw", "--set", "optim.memory_update=sparse"], "needs a model"),
        (["--triton-backward-warps", "6"], "power of two"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra, needle, tmp_path, capsys):
    out = [] if "--out" in extra else ["--out", str(tmp_path)]
    assert research_main(["bench", "gpu", "--sections", "fwdbwd", "--no-compile"] + out + extra) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not list(tmp_path.iterdir())


def test_budget_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        research_main(["bench", "gpu", "--out", str(tmp_path), "--budget", "0"])
    assert exc.value.code == 2 and "--budget" in capsys.readouterr().err


def test_vocabs_are_bounded(tmp_path, capsys):
    """Above twice the largest default a table step would not fit a card: refused at parse."""
    with pytest.raises(SystemExit) as exc:
        research_main(["bench", "gpu", "--out", str(tmp_path), "--vocabs", "32768", "1000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--vocabs" in err[0]
    assert not list(tmp_path.iterdir())


def test_existing_results_file_is_kept_without_force(tmp_path, capsys):
    path = tmp_path / "gpu-cpu.json"
    path.write_text("keep")
    assert research_main(["bench", "gpu", "--out", str(tmp_path), "--sections", "fwdbwd"]) == 2
    assert "--force" in capsys.readouterr().err and path.read_text() == "keep"


def test_tables_above_the_uint16_shard_vocabulary(one_thread):  # noqa: F811
    """The tables section's V 131,072 is above the run config's uint16-shard limit (65,536): the
    model alone takes it (the first GPU run refused every V 131,072 item at the config check).
    Raw at tiny shapes, V 65,536 + 1,024: the only V-sized tensor is the tied embedding, so the
    parameter count grows by exactly 65,536 x d over V 1,024."""
    from research.bench import gpu_parts
    from research.bench.gpu import shapes_for

    shapes = shapes_for("cpu", reps=1)
    big = gpu_parts.table_step("raw", 65536 + 1024, "dense", shapes)
    small = gpu_parts.table_step("raw", 1024, "dense", shapes)
    assert "error" not in big and big["median_ms"] > 0
    assert big["params"] - small["params"] == 65536 * 32  # d 32 (TINY_SETS)


def test_fresh_dynamo_lets_every_model_compile():
    """Many models through one forward code object: past dynamo's recompile limit the next one
    runs eager with no error (the first GPU run's 9th model). fresh_dynamo() before each compiled
    item makes every one compile: each adds one graph to dynamo's count. Recompile limit 1 and the
    "eager" backend keep it cheap."""
    import torch._dynamo

    from research.bench.gpu_parts import fresh_dynamo

    class Scale(nn.Module):
        def __init__(self, k: float) -> None:
            super().__init__()
            self.k = k  # a Python constant: each model needs its own graph

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    def compiled_graphs(k: float, reset: bool) -> int:
        before = fresh_dynamo() if reset else _graph_count()
        f = torch.compile(Scale(k), backend="eager", dynamic=False)
        assert torch.equal(f(torch.ones(3)), torch.full((3,), k))
        return _graph_count() - before

    def _graph_count() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    # torch's own config patch: monkeypatch's undo deletes a dynamo config entry it restores
    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=1):
        fresh_dynamo()
        assert compiled_graphs(2.0, reset=False) == 1
        assert compiled_graphs(3.0, reset=False) == 0  # over the limit: eager, silently
        assert compiled_graphs(4.0, reset=True) == 1
        assert compiled_graphs(5.0, reset=True) == 1
    assert torch._dynamo.config.recompile_limit == limit  # restored


def test_a_run_note_is_shown_with_its_tables(cpu_run):
    """A results file's "notes" (how a run deviated from its command, or what was edited after
    it) is printed under the run's heading, before its tables."""
    snap = dict(cpu_run[1], notes="ran through python -c with recompile_limit 64")
    text = render_run(snap, "research/results/gpu-x.json")
    head, note = text.split("\n\n")[:2]
    assert "gpu-x.json" in head
    assert note == "Note: ran through python -c with recompile_limit 64"
    assert "Note:" not in render_run(cpu_run[1], "research/results/gpu-x.json")


# --- --profile ---------------------------------------------------------------------------------

# real names: cuBLAS / cuBLASLt / CUTLASS (H100/H200, A100), flash / memory-efficient / cuDNN
# attention, inductor's generated Triton kernels, our Triton kernels and custom ops (the @triton.jit
# functions of tngram/kernels/tngram_triton.py and row_update_triton.py, the torch.library ops of
# tngram_triton.py / tngram_c.py and the autograd node torch names after an op), CUDA copies
KERNEL_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT": "matmul",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "matmul",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn>": "matmul",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4>": "matmul",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    "aten::bmm": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_t>": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": (
        "attention"
    ),
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
    "aten::_scaled_dot_product_flash_attention": "attention",
    "aten::_efficient_attention_backward": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "triton_poi_fused__to_copy_add_mul_0": "fused",
    "triton_red_fused__to_copy_add_mean_pow_rsqrt_1": "fused",
    "triton_per_fused__log_softmax_nll_loss_forward_2": "fused",
    "triton_poi_fused_mm_view_3": "fused",  # "mm" in an inductor name is no matmul
    "triton_for_fused_0": "fused",
    "cpp_fused_add_mul_0": "fused",
    "## Call CompiledFxGraph fsnb2zjyfkiwdol6tbxy67jp2ojrtmanwa7uxqpjjxgolt3sk36d ##": "fused",
    "_tngram_fwd_kernel": "lookup",
    "_tngram_bwd_kernel": "lookup",
    "_tngram_bwd_ws_kernel": "lookup",
    "_row_adam_kernel": "lookup",
    "tngram::triton_lookup_fwd": "lookup",
    "tngram::c_lookup_bwd": "lookup",
    "GeneratedBackwardFor_tngram_c_lookup_fwd_default": "lookup",
    "autograd::engine::evaluate_function: FusedTNGramLookupBackward": "lookup",
    "Memcpy DtoD (Device -> Device)": "memcpy/memset",
    "Memset (Device)": "memcpy/memset",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": (
        "other"
    ),
    "aten::embedding_dense_backward": "other",
    "aten::fill_": "other",
}


def test_kernel_names_fall_in_their_category():
    from research.bench.gpu_profile import CATEGORIES, OTHER, category

    got = {name: category(name) for name in KERNEL_NAMES}
    assert got == KERNEL_NAMES
    assert {c for c, _ in CATEGORIES} | {OTHER} == set(KERNEL_NAMES.values())  # each one tested


def test_profile_summary_per_step_sums_and_ranks():
    """Three steps: µs / 1e3 / 3 = ms a step; calls / 3 = calls a step; a row of no time is
    dropped; the categories partition the total."""
    from research.bench.gpu_profile import summarise

    rows = [
        ("sm90_xmma_gemm_bf16bf16", 6, 3000.0),  # 1.0 ms a step, 2 calls
        ("triton_poi_fused_add_0", 30, 600.0),  # 0.2 ms, 10 calls
        ("_tngram_fwd_kernel", 3, 900.0),  # 0.3 ms
        ("Memset (Device)", 3, 30.0),  # 0.01 ms
        ("aten::empty", 9, 0.0),  # no time: not listed
    ]
    s = summarise(rows, steps=3, top=3)
    assert s["steps"] == 3 and s["total_ms"] == pytest.approx(1.51)
    assert s["categories"] == pytest.approx(
        {
            "lookup": 0.3,
            "attention": 0.0,
            "fused": 0.2,
            "matmul": 1.0,
            "memcpy/memset": 0.01,
            "other": 0.0,
        }
    )
    assert [(k["name"], k["calls"], k["ms"]) for k in s["top"]] == [
        ("sm90_xmma_gemm_bf16bf16", 2, 1.0),
        ("_tngram_fwd_kernel", 1, 0.3),
        ("triton_poi_fused_add_0", 10, 0.2),
    ]
    assert s["top"][0]["share"] == pytest.approx(3000 / 4530, abs=1e-4)
    long = summarise([("x" * 200, 1, 1.0)], steps=1)["top"][0]["name"]
    assert len(long) == 80 and long.endswith("…")


def test_cuda_profile_counts_each_kernel_once():
    """On CUDA only the device events count (a CPU op's self device time is its kernels' time,
    already counted through the kernels), and not the device copy of a record_function range
    (inductor's "## Call CompiledFxGraph ##" spans the kernels it launched)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from research.bench.gpu_profile import event_rows

    def ev(key, dev, cpu_us, dev_us, note=False):
        return SimpleNamespace(
            key=key,
            count=3,
            device_type=dev,
            self_cpu_time_total=cpu_us,
            self_device_time_total=dev_us,
            is_user_annotation=note,
        )

    events = [
        ev("aten::mm", DeviceType.CPU, 50.0, 900.0),
        ev("sm90_xmma_gemm_bf16", DeviceType.CUDA, 0.0, 900.0),
        ev("## Call CompiledFxGraph f0 ##", DeviceType.CUDA, 0.0, 1000.0, note=True),
        # inductor's record of a Triton kernel's launch on the CPU, named like the kernel
        ev("triton_poi_fused_add_0", DeviceType.CPU, 5.0, 0.0),
        ev("triton_poi_fused_add_0", DeviceType.CUDA, 0.0, 40.0),
    ]
    assert event_rows(events, "cuda") == [
        ("sm90_xmma_gemm_bf16", 3, 900.0),
        ("triton_poi_fused_add_0", 3, 40.0),
    ]
    assert event_rows(events, "cpu") == [
        ("aten::mm", 3, 50.0),
        ("triton_poi_fused_add_0", 3, 5.0),
    ]


@pytest.fixture(scope="module")
def profile_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu-profile") / "p.json"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = ["bench", "gpu", "--out", str(out), "--sections", "fwdbwd", "--recipes", *RECIPES]
        assert research_main(args + ["--no-compile", "--profile"]) == 0
    finally:
        torch.set_num_threads(before)
    return json.loads(out.read_text())


def test_profile_run_records_each_fwdbwd_item(profile_run, cpu_run):
    from research.bench.gpu import GPU_COST, shapes_for
    from research.bench.gpu_profile import PROFILE_STEPS, TOP

    r = profile_run
    assert r["shapes"]["profile"] is True and cpu_run[1]["shapes"]["profile"] is False
    items = r["sections"]["fwdbwd"]
    assert sorted(items) == [f"{x}/eager" for x in sorted(RECIPES)]
    for key, it in items.items():
        p = it["profile"]
        assert p["time"] == "cpu" and p["steps"] == PROFILE_STEPS and p["wall_ms"] > 0
        # the categories partition the total (each rounded to 1e-4 ms)
        assert sum(p["categories"].values()) == pytest.approx(p["total_ms"], abs=1e-3), key
        ms = [k["ms"] for k in p["top"]]
        assert 0 < len(ms) <= TOP and ms == sorted(ms, reverse=True), key
        assert sum(k["share"] for k in p["top"]) <= 1.0 + 1e-3
        assert all(0 < k["ms"] <= p["total_ms"] for k in p["top"])
        # self CPU times of the ops inside the profiled steps: at most their wall time
        assert p["total_ms"] <= p["wall_ms"] * 1.05
    for it in cpu_run[1]["sections"]["fwdbwd"].values():
        assert "profile" not in it  # without --profile
    gpu = shapes_for("cuda")  # the budget's estimate grows by the profile's
    for what in ("eager", "compile"):
        assert gpu.cost(what, profile=True) == GPU_COST[what] + GPU_COST["profile"]
    for V in (1024, 131072):  # a table step's estimate grows by the same, at every V
        plain = gpu.cost("table", vocab=V)
        assert gpu.cost("table", vocab=V, profile=True) == plain + GPU_COST["profile"]


def test_profile_attributes_the_lookup(profile_run):
    """On the CPU the lookup is the C kernel (when it builds and passes its self-check): its ops
    tngram::c_lookup_fwd / _bwd and their autograd node are "lookup"; the raw model has none.
    (The torch path's aten ops cannot be told from the model's other ops.)"""
    from tngram.kernels import resolved_impl

    items = profile_run["sections"]["fwdbwd"]
    assert items["paper-l9-raw/eager"]["profile"]["categories"]["lookup"] == 0.0
    assert items["paper-l9-raw/eager"]["profile"]["categories"]["matmul"] > 0
    if resolved_impl("cpu") != "c":
        pytest.skip(f"the C lookup kernel is not used here ({resolved_impl('cpu')})")
    assert items["paper-l9-tngram/eager"]["profile"]["categories"]["lookup"] > 0


def test_profile_block_renders_after_the_fwdbwd_table(profile_run):
    """Compiled rows first; the top kernels of compiled Engram / TN-gram only. The compiled item
    here is the eager one's copy (no compile on the CPU in a fast test)."""
    from research.report.gpu_blocks import profile_table

    r = json.loads(json.dumps(profile_run))
    sec = r["sections"]["fwdbwd"]
    text = render_run(r, "p.json")
    # the same file without its profiles renders the same text without the block
    plain = render_run(_without_profiles(r), "p.json")
    assert "Where a step's time goes" not in plain and text == plain + "\n\n" + profile_table(r)
    head = "| recipe | mode | timed | lookup | attention | fused | matmul | memcpy/memset "
    assert head + "| other | total |" in text and "Top kernels" not in text
    p = sec["paper-l9-tngram/eager"]["profile"]
    row = f"| paper-l9-tngram | eager | {sec['paper-l9-tngram/eager']['median_ms']:.1f} | "
    row += " | ".join(f"{v:.2f}" for v in p["categories"].values()) + f" | {p['total_ms']:.2f} |"
    assert row in text
    sec["paper-l9-tngram/compile"] = sec["paper-l9-tngram/eager"]
    text = profile_table(r)
    rows = [line for line in text.splitlines() if line.startswith("| paper-l9-")]
    assert rows[0].startswith("| paper-l9-tngram | compiled |")
    assert [line.split(" | ")[1] for line in rows[3:]] == [f"`{k['name']}`" for k in p["top"][:5]]


def _without_profiles(r):
    sec = r["sections"]["fwdbwd"]
    strip = {k: {f: v for f, v in it.items() if f != "profile"} for k, it in sec.items()}
    return {**r, "sections": {**r["sections"], "fwdbwd": strip}}


def test_table_step_profile_and_its_block(cpu_run, one_thread):  # noqa: F811
    """--profile on the tables section: a table step's profile sums to its total by category,
    and the block lists every profiled step and the top kernels of TN-gram's at V >= 8192."""
    from research.bench import gpu_parts
    from research.bench.gpu import shapes_for
    from research.report.gpu_blocks import TOP_TABLE_KERNELS, tables_profile_table

    it = gpu_parts.table_step("tngram", 128, "sparse", shapes_for("cpu"), profile=True)
    p = it["profile"]
    assert p["time"] == "cpu" and p["steps"] >= 1
    assert sum(p["categories"].values()) == pytest.approx(p["total_ms"], abs=1e-3)
    assert p["categories"]["lookup"] > 0  # the C lookup and the row update are ours
    snap = json.loads(json.dumps(cpu_run[1]))
    assert "Where a table step" not in render_run(snap, "x.json")  # no profile: no block
    snap["sections"]["tables"]["tngram@256/sparse"] = it
    snap["sections"]["tables"]["tngram@8192/sparse"] = it  # a key at the V the tops start at
    block = tables_profile_table(snap)
    assert block in render_run(snap, "x.json")
    assert "| tngram@256/sparse |" in block
    tops = [ln for ln in block.splitlines() if ln.startswith("| tngram@8192/sparse | `")]
    assert len(tops) == min(TOP_TABLE_KERNELS, len(p["top"]))
    assert not [ln for ln in block.splitlines() if ln.startswith("| tngram@256/sparse | `")]


def test_table_step_memory_need_counts_the_real_model(one_thread):  # noqa: F811
    """The memory guard's count is the model the step builds: the parameters on the meta device
    equal the real model's (table_step's "params"), times 16 bytes (weight, gradient, Adam's
    two moments) plus 4 on the CPU (foreach Adam's sqrt temporary)."""
    from research.bench import gpu_parts
    from research.bench.gpu import shapes_for

    shapes = shapes_for("cpu", reps=1)
    for model in ("raw", "engram", "tngram"):
        real = gpu_parts.table_step(model, 512, "dense", shapes)
        n, gib = gpu_parts.table_step_need(model, 512, shapes)
        assert n == real["params"] and gib == n * 20 / 2**30


def test_tables_too_big_for_memory_are_skipped_and_named(tmp_path, monkeypatch, one_thread):  # noqa: F811
    """A table step that cannot fit the free memory is skipped before anything is allocated
    (on the CPU the OOM killer would take every item's numbers): Engram's tables at V 4,096
    (tiny shapes) need more than raw's; with free memory between the two, raw runs and every
    memory row says why it did not."""
    from research.bench import gpu_parts
    from research.bench.gpu import shapes_for

    shapes = shapes_for("cpu", reps=1)
    raw = gpu_parts.table_step_need("raw", 4096, shapes)[1]
    small = min(gpu_parts.table_step_need(m, 4096, shapes)[1] for m in ("engram", "tngram"))
    assert raw < small
    monkeypatch.setattr(gpu_parts, "free_gib", lambda dev: (raw + small) / 2)
    out = tmp_path / "t.json"
    rc = research_main(["bench", "gpu", "--out", str(out), "--sections", "tables", "--vocabs", "4096",
               "--recipes", "paper-l9-raw"])
    assert rc == 0
    r = json.loads(out.read_text())
    tables = r["sections"]["tables"]
    assert "median_ms" in tables["raw@4096"]
    skipped = [k for k in tables if k != "raw@4096"]
    assert len(skipped) == 6
    assert all(tables[k]["skipped"].startswith("memory: needs") for k in skipped)
    assert len(r["skipped"]) == 6 and "skipped (memory)" in render_run(r, "x.json")


def test_cpu_run_says_so_first_and_writes_to_the_current_folder(tmp_path, monkeypatch, capsys):
    """Without CUDA the first line says the items run at tiny CPU shapes and measure no GPU; with
    no --out the results file lands in the current folder (a clone or a pip install alike)."""
    monkeypatch.chdir(tmp_path)
    assert research_main(["bench", "gpu", "--sections", "attention"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("no CUDA device: every item runs on the CPU at tiny shapes")
    assert "measures nothing about a GPU" in out[0]
    assert json.loads((tmp_path / "gpu-cpu.json").read_text())["tiny"] is True


def test_cpu_budget_estimates_items_by_the_longest_so_far(tmp_path, monkeypatch, capsys):
    """Items that take 1 s each under a 1.6 s budget: the first runs (no CPU item timed yet: the
    0.5 s floor), the next is estimated at the 1 s it took and skipped, so the run keeps to its
    budget (with the fixed 0.5 s estimate the second would start at 1 s and end at 2 s)."""
    import time

    from research.bench import gpu_optim

    def one_second(recipe, shapes):
        time.sleep(1.0)
        return {"median_ms": 1000.0}

    monkeypatch.setattr(gpu_optim, "optimiser_steps", one_second)
    recipes = ["paper-l9-raw", "paper-l9-engram", "paper-l9-tngram"]
    args = ["bench", "gpu", "--out", str(tmp_path), "--sections", "optim", "--budget", "1.6"]
    assert research_main(args + ["--recipes", *recipes]) == 0
    r = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert r["sections"]["optim"]["paper-l9-raw"] == {"median_ms": 1000.0}
    for k in recipes[1:]:
        assert r["sections"]["optim"][k]["skipped"].endswith("needs ~1.0 s"), r["skipped"]
    assert r["elapsed_s"] <= 1.6
