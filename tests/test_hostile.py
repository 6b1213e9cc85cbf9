"""Hostile run and dataset folders, files read back and Python API misuse (docs/RELIABILITY.md).

Every link or hard link below points into pytest's temporary folder, at a "victim" file or
folder whose bytes are compared before and after: nothing outside a run folder may change, and
every refusal is one line (exit 2 from the CLI) naming the file or the setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from test_train_support import cli_args, one_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.common import TngramError
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train
from tngram.train.runlock import LOCK_FILE

# 4 steps, checkpoints at 2 and 4, no validation before the end
EXTRA = ["schedule.steps=4", "schedule.warmdown_steps=2", "run.checkpoint_every=2",
         "run.keep_checkpoints=10", "run.val_every=0"]


LAB_COMMANDS = ("bench", "experiment", "report")


def main(argv):
    """`tngram ARGV`, or `python -m research ARGV` for the lab's commands, in-process."""
    if " ".join(argv[:2]).startswith(LAB_COMMANDS):
        from research.cli import main as _main
    else:
        from tngram.cli import main as _main
    return _main(argv)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


def one_line_exit_2(rc: int, err: str) -> None:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256 of the bytes, or 'link -> target', or 'dir'} of everything under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link -> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def half_run(tiny_data, tmp_path_factory):
    """A run stopped after step 2 of 4 (checkpoint step_000002, no final weights)."""
    out = tmp_path_factory.mktemp("hostile") / "half"
    torch.set_num_threads(1)
    train(tiny_config(tiny_data, extra=EXTRA), out, max_steps=2)
    return out


@pytest.fixture(scope="module")
def full_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "full"
    torch.set_num_threads(1)
    train(tiny_config(tiny_data, extra=EXTRA), out)
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dst


def small_text(folder: Path, extra: str = "") -> Path:
    """Eight documents of the tests' synthetic corpus (a dataset needs two or more for its
    document-level split; enough text for a 300-piece tokenizer)."""
    from test_train_support import synthetic_documents
    folder.mkdir(exist_ok=True)
    for i, doc in enumerate(synthetic_documents(seed=7)[:8]):
        (folder / f"d{i}.txt").write_text(doc + extra + "\n")
    return folder


@pytest.fixture
def victim(tmp_path) -> Path:
    p = tmp_path / "outside" / "victim.txt"
    p.parent.mkdir()
    p.write_text("precious bytes outside the run folder\n")
    return p


# ---------------------------------------------------------------- 1. links, hard links, FIFOs

def test_lock_file_as_symlink_never_truncates_its_target(half_run, tiny_data, victim, tmp_path, capsys):
    run = copy_run(half_run, tmp_path / "run")
    (run / LOCK_FILE).symlink_to(victim)
    before = victim.read_bytes()
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, EXTRA), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "symbolic link" in err and LOCK_FILE in err
    rc, err = cli(["eval", "bpb", str(run)], capsys)
    one_line_exit_2(rc, err)
    assert victim.read_bytes() == before


def test_lock_file_hard_linked_elsewhere_is_replaced_not_written(half_run, tiny_data, victim, tmp_path):
    run = copy_run(half_run, tmp_path / "run")
    os.link(victim, run / LOCK_FILE)
    before = victim.read_bytes()
    summary = train(tiny_config(tiny_data, extra=EXTRA), run, resume=True)
    assert summary["steps"] == 4
    assert victim.read_bytes() == before and victim.stat().st_nlink == 1


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json", "dataset.json", "tokenizer.model",
                                  "env.json", "checkpoints", "eval", "model.safetensors", "summary.json",
                                  "tb", "wandb_id"])
def test_run_entry_as_symlink_is_refused_before_any_write(name, half_run, tiny_data, victim, tmp_path, capsys):
    """Every entry a run writes, planted as a link to a file (or folder) outside: --resume
    refuses in one line and the target (file or folder) is unchanged."""
    run = copy_run(half_run, tmp_path / "run")
    target: Path = victim
    if name in ("checkpoints", "eval", "tb"):
        target = tmp_path / "outside" / name
        if (run / name).exists():
            shutil.move(str(run / name), target)
        else:
            target.mkdir()
            (target / "bpb.json").write_text("{}\n")
    elif (run / name).exists():
        (run / name).unlink()
    (run / name).symlink_to(target)
    before = tree_digest(victim.parent)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, EXTRA), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "symbolic link" in err
    assert tree_digest(victim.parent) == before


def test_linked_checkpoints_folder_is_never_written_or_pruned(half_run, tiny_data, tmp_path):
    """The library path too: checkpoint saving and retention refuse a linked checkpoints/ and
    never delete the target's step_* folders."""
    run = copy_run(half_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(run / "checkpoints"), elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before = tree_digest(elsewhere)
    with pytest.raises(TngramError, match="symbolic link"):
        ckpt.list_checkpoints(run)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TngramError, match="symbolic link"):
        ckpt.save_checkpoint(run, 3, model, {}, {}, keep=1)
    ckpt.remove_torn_temps(run)
    assert tree_digest(elsewhere) == before


def test_retention_removes_only_its_own_step_folders(half_run, tiny_data, tmp_path):
    """A step_* entry that is a link (to a folder outside) is not ours: retention (keep 1) never
    follows or removes it; a user file in checkpoints/ stays too."""
    run = copy_run(half_run, tmp_path / "run")
    outside = tmp_path / "outside-step"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    (run / "checkpoints" / "step_000000").symlink_to(outside)
    (run / "checkpoints" / "notes.txt").write_text("mine")
    summary = train(tiny_config(tiny_data, extra=EXTRA + ["run.keep_checkpoints=1"]), run, resume=True)
    assert summary["steps"] == 4
    assert (outside / "keep.txt").read_text() == "x"
    assert (run / "checkpoints" / "step_000000").is_symlink()
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_000004"]


def test_hard_linked_copy_resumed_never_changes_the_original(half_run, tiny_data, tmp_path):
    """`cp -al RUN COPY` then resuming COPY: every byte of RUN stays as it was (metrics.jsonl
    included, which was once cut and appended in place)."""
    orig = copy_run(half_run, tmp_path / "orig")
    before = tree_digest(orig)
    shutil.copytree(orig, tmp_path / "copy", copy_function=os.link)
    assert (tmp_path / "copy" / "metrics.jsonl").stat().st_nlink == 2
    summary = train(tiny_config(tiny_data, extra=EXTRA), tmp_path / "copy", resume=True)
    assert summary["steps"] == 4
    assert tree_digest(orig) == before
    rows = [json.loads(x) for x in (tmp_path / "copy" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_eval_folder_as_symlink_never_replaces_the_targets_result(full_run, tmp_path, capsys):
    run = copy_run(full_run, tmp_path / "run")
    other = tmp_path / "other"
    other.mkdir()
    (other / "bpb.json").write_text('{"mine": 1}\n')
    (run / "eval").symlink_to(other)
    rc, err = cli(["eval", "bpb", str(run)], capsys)
    one_line_exit_2(rc, err)
    assert "symbolic link" in err
    assert (other / "bpb.json").read_text() == '{"mine": 1}\n'


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.model", "metrics.jsonl",
                                  "summary.json"])
def test_fifo_in_place_of_a_run_file_is_refused_not_waited_on(name, full_run, tmp_path):
    """A FIFO never blocks a reader: load_run (sample), report's readers and the metrics reader
    refuse it at once (the test would hang otherwise)."""
    import tngram
    from tngram.readback import read_summary_file
    from tngram.report.runs import read_metrics
    run = copy_run(full_run, tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    t0 = time.monotonic()
    with pytest.raises(TngramError, match="FIFO"):
        if name == "metrics.jsonl":
            read_metrics(run)
        elif name == "summary.json":
            read_summary_file(run / name, run)
        else:
            tngram.load_run(str(run))
    assert time.monotonic() - t0 < 30


def test_dataset_rebuild_never_deletes_user_files_or_a_run_kept_inside(tmp_path, capsys):
    """A changed input rebuilds the dataset; the user's file, a run folder and a link kept in the
    dataset folder come through with every byte (the link still a link), and no old copy is left."""
    from tngram.data.build import build_from_text
    text = small_text(tmp_path / "text")
    data = build_from_text([text], tmp_path / "data", vocab_size=300, progress=False)
    old_fp = json.loads((data / "manifest.json").read_text())["fingerprint"]
    (data / "notes.md").write_text("my notes")
    (data / "runs" / "r1").mkdir(parents=True)
    (data / "runs" / "r1" / "config.json").write_text("{}")
    (data / "elsewhere").symlink_to(tmp_path / "text")
    user = {k: v for k, v in tree_digest(data).items() if k.split("/")[0] in ("notes.md", "runs", "elsewhere")}
    small_text(text, " changed")                                 # a changed input: a rebuild
    build_from_text([text], data, vocab_size=300, progress=False)
    assert "kept 3 entries" in capsys.readouterr().out
    assert json.loads((data / "manifest.json").read_text())["fingerprint"] != old_fp
    after = tree_digest(data)
    assert {k: after.get(k) for k in user} == user
    assert not list(tmp_path.glob(".data.old-*")) + list(tmp_path.glob(".data.building-*"))   # none left


def test_safefs_primitives(tmp_path, victim):
    from tngram import safefs
    root = tmp_path / "root"
    root.mkdir()
    (root / "sub").symlink_to(victim.parent)
    with pytest.raises(safefs.UnsafePathError, match="symbolic link"):
        safefs.write_bytes(root / "sub" / "x", b"y", root)
    with pytest.raises(safefs.UnsafePathError, match="symbolic link"):
        safefs.make_dirs(root, root / "sub" / "deeper")
    (root / "f").symlink_to(victim)
    with pytest.raises(safefs.UnsafePathError, match="symbolic link"):
        safefs.read_bytes(root / "f", root)
    safefs.write_bytes(root / "f", b"new", root)               # replaces the link, not its target
    assert (root / "f").read_bytes() == b"new" and not (root / "f").is_symlink()
    assert victim.read_text().startswith("precious")
    assert not safefs.remove_tree(root / "sub", root) and victim.exists()
    os.mkfifo(root / "pipe")
    with pytest.raises(safefs.UnsafePathError, match="FIFO"):
        safefs.read_bytes(root / "pipe")


# ---------------------------------------------------------------- 2. resume on a changed dataset

def test_resume_refuses_a_changed_dataset_fingerprint(tiny_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    run = tmp_path / "run"
    train(tiny_config(data, extra=EXTRA), run, max_steps=2)
    m = json.loads((data / "manifest.json").read_text())
    old_fp = m["fingerprint"]
    m["fingerprint"] = "f" * 64            # a rebuild with the same token counts: another fingerprint
    (data / "manifest.json").write_text(json.dumps(m))
    before = tree_digest(run)
    capsys.readouterr()
    rc, err = cli(["train", *cli_args(data, "mini-tngram", run, EXTRA), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "fingerprint ffffffffffff" in err and old_fp[:12] in err and "--accept-changed-data" in err
    assert {k: v for k, v in tree_digest(run).items() if k not in ("config.json", LOCK_FILE)} == \
        {k: v for k, v in before.items() if k not in ("config.json", LOCK_FILE)}
    rc, err = cli(["train", *cli_args(data, "mini-tngram", run, EXTRA), "--resume",
                   "--accept-changed-data"], capsys)
    assert rc == 0, err
    rec = json.loads((run / "dataset.json").read_text())
    assert rec["fingerprint"] == "f" * 64 and rec["previous"][0]["fingerprint"] == old_fp


# ---------------------------------------------------------------- 3. files read back

def _set(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


@pytest.mark.parametrize("key,value,needle", [
    ("model.n_layer", -1, "model.n_layer"),
    ("model.n_embd", 0, "model.n_embd"),
    ("model.n_layer", 1000, "parameters"),             # 1000 x 8192^2: far beyond any RAM
    ("model.n_head", 2.5, "model.n_head"),
    ("model.n_embd", "32", "model.n_embd"),
    ("model.rope_base", float("nan"), "model.rope_base"),
    ("model.sequence_len", [64], "model.sequence_len"),
    ("model.memory.cp_rank", -3, "cp_rank"),
    ("model.memory", "tngram", "model.memory"),
    ("run.seed", 2**64, "run.seed"),
    ("optim", [], "optim"),
])
def test_hostile_config_json_is_one_line_before_any_allocation(key, value, needle, full_run, tmp_path):
    import tngram
    run = copy_run(full_run, tmp_path / "run")
    d = json.loads((run / "config.json").read_text())
    if needle == "parameters":
        _set(d, "model.n_embd", 8192)
    _set(d, key, value)
    (run / "config.json").write_text(json.dumps(d))
    t0 = time.monotonic()
    with pytest.raises(TngramError) as e:
        tngram.load_run(str(run))
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "config.json" in msg and needle in msg and "\n" not in msg


@pytest.mark.parametrize("key,value,needle", [
    ("vocab_size", "512", "vocab_size"),
    ("vocab_size", -1, "vocab_size"),
    ("vocab_size", 512.0, "vocab_size"),
    ("files", ["train_000000.bin"], "files"),
    ("files", {"train": "train_000000.bin", "val": []}, "train"),
    ("files", {"train": [], "val": [7]}, "files.val"),
    ("tokenizer", "tokenizer.model", "tokenizer"),
    ("tokenizer", {"model": "../../etc/passwd"}, "tokenizer.model"),
    ("tokenizer", {}, "model"),
    ("bos_id", True, "bos_id"),
    ("bos_id", 600, "bos_id"),                                  # outside the vocabulary (512)
    ("tokens", {"train": "75239", "val": 8809}, "tokens"),
    ("sources", [{"name": "text", "tokens": {"train": "x"}}], "sources[0].tokens"),
    ("files", {"train": ["train_000000.bin"] * 2, "val": ["val_000000.bin"]}, "more than once"),
    ("tokens", {"train": 1, "val": 1}, "field tokens.train is 1, but the train shards hold"),
])
def test_hostile_dataset_manifest_is_one_line(key, value, needle, tiny_data, tmp_path):
    from tngram.data.build import open_dataset
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    m = json.loads((data / "manifest.json").read_text())
    m[key] = value
    (data / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TngramError) as e:
        open_dataset(data)
    assert "manifest.json" in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("content,needle", [
    (b"[run]\nseed = \"\xff\xfe\"\n", "not UTF-8"),
    (b"a = " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested"),
    (b"[" + b".".join(b"k%d" % i for i in range(40)) + b"]\nx = 1\n", "nested"),
])
def test_hostile_config_file_is_one_line(content, needle, tiny_data, tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_bytes(content)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-raw", tmp_path / "r", EXTRA), "--config", str(f)], capsys)
    one_line_exit_2(rc, err)
    assert needle in err and "c.toml" in err


def test_deeply_nested_json_record_is_one_line(tmp_path):
    from tngram.readback import BadRecordError, load_json
    p = tmp_path / "x.json"
    p.write_text('{"a":' * 5000 + "1" + "}" * 5000)
    with pytest.raises(BadRecordError, match="nested"):
        load_json(p)


@pytest.mark.parametrize("name,content,needle", [
    ("summary.json", "[1, 2]", "expected a JSON object"),
    ("summary.json", '{"val_loss": "low"}', "val_loss"),
    ("config.json", '{"name": "mini-tngram", "model": {}, "run": "x"}', "config.json"),
])
def test_hostile_run_records_in_report_are_one_line(name, content, needle, full_run, tmp_path):
    from research.cli.report import rows_from_folder
    folder = tmp_path / "cmp"
    run = copy_run(full_run, folder / "runs" / "tngram-s0")
    (run / name).write_text(content)
    with pytest.raises(TngramError, match=needle):
        rows_from_folder(folder)


@pytest.mark.parametrize("reader,content,needle", [
    ("results", '{"rows": [{"val_loss": [1]}]}', "val_loss"),
    ("results", '{"rows": "x"}', "rows"),
    ("tuning", '{"best": ["engram-lr4"]}', "best"),
    ("tuning", '{"best": {"engram": {"lr": 4}}}', "best.engram"),
    ("core", '{"core": "0.3"}', "core"),
    ("core", '{"core": 0.3, "tasks": {"hellaswag": {"centered": "x"}}}', "tasks.hellaswag"),
])
def test_hostile_results_tuning_core_json_are_one_line(reader, content, needle, tmp_path):
    from tngram import readback
    p = tmp_path / f"{reader}.json"
    p.write_text(content)
    from research.experiments.common import read_tuning_file
    fn = {"results": readback.read_results_file, "tuning": read_tuning_file,
          "core": readback.read_core_file}[reader]
    with pytest.raises(readback.BadRecordError, match=needle):
        fn(p)


def test_tuned_flag_with_malformed_tuning_json_is_one_line(tmp_path):
    from research.experiments.evidence import read_best
    (tmp_path / "tuning.json").write_text('{"rows": []}')
    with pytest.raises(TngramError, match="best"):
        read_best(str(tmp_path))


def test_metrics_rows_that_are_not_rows(full_run, tmp_path):
    """The trainer's reader keeps the good rows around bad ones; report names the bad line."""
    from tngram.report.runs import read_metrics as report_rows
    from tngram.train.metrics import read_metrics
    run = copy_run(full_run, tmp_path / "run")
    good = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([good[0], "[1, 2]", '{"step": "3"}', *good[1:]]) + "\n")
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    with pytest.raises(TngramError, match="line 2"):
        report_rows(run)


# ---------------------------------------------------------------- 4. Python API, tokenizer, eval data

@pytest.mark.parametrize("kwargs,needle", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 2**63}, "seed"),
])
def test_sample_api_checks_its_arguments(kwargs, needle, full_run):
    import tngram
    model, tok = tngram.load_run(str(full_run))
    with pytest.raises(TngramError, match=needle):
        tngram.sample(model, tok, "ka lo", **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tngram_module_accepts_low_precision_hidden_states_like_engram(dtype):
    """bf16/fp16 hidden states without autocast: TN-gram runs as Engram and Over-Encoding do
    (the memory vector stays in the weights' dtype) and gives the fp32 result of the same h."""
    from tngram.memory import memory_config_classes
    kinds = memory_config_classes()
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 5))
    h = torch.randn(2, 5, 32).to(dtype)
    for kind, extra in (("tngram", {"cp_rank": 8, "max_ngram": 3}), ("engram", {})):
        mod = kinds[kind](**extra).build(d_model=32, vocab_size=64)
        y = mod(h, ids)
        ref = mod(h.float(), ids)
        assert y.shape == h.shape and torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 5, 31), (2, 6, 32), (5, 32)])
def test_tngram_module_mismatched_shapes_are_one_line(shape):
    from tngram.memory import memory_config_classes
    mod = memory_config_classes()["tngram"](cp_rank=8, max_ngram=3).build(d_model=32, vocab_size=64)
    with pytest.raises(TngramError, match=r"TN-gram expects h of shape \(B, T, 32\)"):
        mod(torch.randn(*shape), torch.randint(0, 64, (2, 5)))


def test_swapped_run_tokenizer_is_refused(full_run, tmp_path, capsys):
    import tngram
    from tngram.data.tokenizer import train_tokenizer
    run = copy_run(full_run, tmp_path / "run")
    train_tokenizer([p.read_text() for p in small_text(tmp_path / "text").iterdir()], tmp_path / "other", 300)
    shutil.copyfile(tmp_path / "other.model", run / "tokenizer.model")
    with pytest.raises(TngramError, match="not the tokenizer this run was trained with"):
        tngram.load_run(str(run))
    rc, err = cli(["sample", str(run), "--prompt", "ka"], capsys)
    one_line_exit_2(rc, err)
    rc, err = cli(["export", str(run), "--hf", str(tmp_path / "exp")], capsys)
    one_line_exit_2(rc, err)
    assert not (tmp_path / "exp").exists()


def test_eval_bpb_on_another_vocabulary_is_refused_before_writing(full_run, tmp_path, capsys):
    from tngram.data.build import build_from_text
    run = copy_run(full_run, tmp_path / "run")
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "bpb.json").write_text('{"val_bpb": 1.5}\n')
    text = small_text(tmp_path / "text")
    other = build_from_text([text], tmp_path / "data", vocab_size=300, progress=False)
    rc, err = cli(["eval", "bpb", str(run), "--data", str(other)], capsys)
    one_line_exit_2(rc, err)
    assert "vocab 300" in err and "vocab 512" in err
    assert (run / "eval" / "bpb.json").read_text() == '{"val_bpb": 1.5}\n'


# ---------------------------------------------------------------- 5. final weights manifest + probe

def test_final_weights_record_their_payload_digest(full_run):
    from safetensors import safe_open
    with safe_open(str(full_run / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    data = (full_run / "model.safetensors").read_bytes()
    payload = data[8 + int.from_bytes(data[:8], "little"):]
    assert meta["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert int(meta["payload_bytes"]) == len(payload)
    ckpt.verify_weights_file(full_run / "model.safetensors")


def test_random_payload_under_a_valid_header_is_refused(full_run, tmp_path, capsys):
    run = copy_run(full_run, tmp_path / "run")
    p = run / "model.safetensors"
    data = bytearray(p.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    rng = torch.Generator().manual_seed(0)
    data[start:] = torch.randint(0, 256, (len(data) - start,), generator=rng, dtype=torch.uint8).numpy().tobytes()
    p.write_bytes(bytes(data))
    for argv in (["eval", "bpb", str(run), "--out", str(tmp_path / "b.json")], ["sample", str(run), "--prompt", "ka"],
                 ["export", str(run), "--hf", str(tmp_path / "exp")]):
        rc, err = cli(argv, capsys)
        one_line_exit_2(rc, err)
        assert "model.safetensors" in err and "sha256" in err
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "exp").exists()


def test_unmanifested_checkpoint_with_a_random_state_payload_is_one_line(half_run, tiny_data, tmp_path, capsys):
    """A checkpoint without manifest.json cannot be verified byte for byte: random bytes under its
    state.safetensors header are refused by their values (non-finite moments / RNG state)."""
    run = copy_run(half_run, tmp_path / "run")
    c = run / "checkpoints" / "step_000002"
    (c / "manifest.json").unlink()
    p = c / "state.safetensors"
    data = bytearray(p.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    rng = torch.Generator().manual_seed(0)
    data[start:] = torch.randint(0, 256, (len(data) - start,), generator=rng, dtype=torch.uint8).numpy().tobytes()
    p.write_bytes(bytes(data))
    capsys.readouterr()
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, EXTRA), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "state.safetensors" in err and "corrupt" in err


def test_unmanifested_weights_with_non_finite_values_are_refused(full_run, tmp_path):
    """Older final weights (no digest in the header) that hold NaN: the first probe refuses."""
    import tngram
    from safetensors.torch import save_file
    run = copy_run(full_run, tmp_path / "run")
    w = weights(run)
    w[next(k for k in w if w[k].is_floating_point())].fill_(float("nan"))
    save_file(w, str(run / "model.safetensors"), metadata={"step": "4"})
    with pytest.raises(TngramError, match="non-finite"):
        tngram.load_run(str(run))


# ---------------------------------------------------------------- 6. settings that fail late

def test_val_tokens_below_one_window_is_refused_at_config_time(tiny_data):
    with pytest.raises(TngramError, match="data.val_tokens"):
        tiny_config(tiny_data, extra=EXTRA + ["data.val_tokens=10"])


def test_eval_bpb_max_tokens_below_one_window_names_the_flag(full_run, tmp_path, capsys):
    rc, err = cli(["eval", "bpb", str(full_run), "--max-tokens", "10", "--out", str(tmp_path / "b.json")], capsys)
    one_line_exit_2(rc, err)
    assert "--max-tokens" in err and "sequence_len 64" in err


def test_threads_far_above_the_cores_is_one_line(tiny_data, tmp_path, capsys):
    rc, err = cli(["train", *cli_args(tiny_data, "mini-raw", tmp_path / "r", EXTRA), "--threads", "4096"], capsys)
    one_line_exit_2(rc, err)
    assert "4096" in err and "core" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv", [["--set", "run.seed=18446744073709551616"], ["--set", "data.seed=9223372036854775808"]])
def test_seeds_beyond_64_bits_are_one_line(argv, tiny_data, tmp_path, capsys):
    rc, err = cli(["train", *cli_args(tiny_data, "mini-raw", tmp_path / "r", EXTRA), *argv], capsys)
    one_line_exit_2(rc, err)
    assert "seed" in err


def test_sample_seed_beyond_64_bits_is_one_line(full_run, capsys):
    rc, err = cli(["sample", str(full_run), "--prompt", "ka", "--seed", str(2**63)], capsys)
    one_line_exit_2(rc, err)
    assert "seed" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv", [["sample", "RUN", "--prompt", "ka"], ["eval", "bpb", "RUN"], ["eval", "core", "RUN"]])
def test_device_cuda_without_cuda_is_one_line(argv, full_run, capsys):
    rc, err = cli([str(full_run) if a == "RUN" else a for a in argv] + ["--device", "cuda"], capsys)
    one_line_exit_2(rc, err)
    assert "CUDA" in err


def test_corpus_build_progress_off_a_terminal_has_no_carriage_returns(tmp_path, capfd):
    from tngram.data.build import build_from_text
    text = small_text(tmp_path / "text")
    build_from_text([text], tmp_path / "data", vocab_size=300, progress=True)
    out, err = capfd.readouterr()
    assert "\r" not in out and "\r" not in err


def test_ctrl_c_outside_training_is_one_line_exit_130(monkeypatch, tmp_path, capsys):
    """KeyboardInterrupt anywhere in a command (here: a data build) ends in one line, exit 130."""
    import tngram.data.build as build

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(build, "build_from_text", interrupted)
    (tmp_path / "a.txt").write_text("x\n")
    rc, err = cli(["data", "build", "--from-text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d")], capsys)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc == 130 and len(lines) == 1 and "interrupt" in err.lower() and "Traceback" not in err


def test_unexpected_exception_is_one_line_naming_the_traceback_file(monkeypatch, tmp_path, capsys):
    import tngram.data.build as build

    def broken(*a, **k):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(build, "build_from_text", broken)
    monkeypatch.setenv("TNGRAM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("x\n")
    rc, err = cli(["data", "build", "--from-text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d")], capsys)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc == 1 and len(lines) == 1 and "bug" in err and "ZeroDivisionError" in err
    tb = Path(err.split("traceback in ")[1].split()[0].rstrip(";).,"))
    assert tb.is_file() and "ZeroDivisionError: boom" in tb.read_text()


def test_out_of_memory_is_one_line_naming_what_to_lower(monkeypatch, tmp_path, capsys):
    import tngram.data.build as build

    def oom(*a, **k):
        raise MemoryError()
    monkeypatch.setattr(build, "build_from_text", oom)
    (tmp_path / "a.txt").write_text("x\n")
    rc, err = cli(["data", "build", "--from-text", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d")], capsys)
    one_line_exit_2(rc, err)
    assert "out of memory" in err




def test_real_ctrl_c_during_data_build_is_one_line_and_leaves_nothing(tmp_path):
    """SIGINT to a real `tngram data build` while it trains its tokenizer: one line, exit 130, no
    traceback, and neither the dataset nor its staging folder is left behind."""
    import signal
    import subprocess
    import sys
    from test_train_support import synthetic_documents
    docs = synthetic_documents(seed=7)
    text = tmp_path / "docs.jsonl"              # ~11 MB: the tokenizer trains for a few seconds
    text.write_text("".join(json.dumps({"text": docs[i % len(docs)] + f" n{i}"}) + "\n" for i in range(1500)))
    # a clean environment: no torchrun variables another test may have left (print0 would go quiet)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the child starts with SIGINT at its default, as from an interactive shell: a pytest started
    # in the background of a non-interactive shell (`cmd &`, as CI scripts and job runners do)
    # inherits SIGINT ignored, an ignored signal is inherited across exec, and the build would run
    # to the end (no test changes the handlers: conftest's _signal_handlers_restored checks it)
    proc = subprocess.Popen([sys.executable, "-m", "tngram", "data", "build", "--from-text", str(text),
                             "--vocab-size", "512", "--out", str(tmp_path / "data")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # under way = its staging folder exists (seen on the file system, not through a pipe the
    # reader may be slow to drain); the signal goes at once: on an idle machine the whole build
    # takes about a second, and a signal that lands while the interpreter exits is not an interrupt
    deadline = time.time() + 120
    while proc.poll() is None and not list(tmp_path.glob(".data.building-*")) and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"the build ended before the signal: {proc.communicate()}"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("tngram: interrupted"), err
    assert not (tmp_path / "data").exists()
    assert not list(tmp_path.glob(".data.building-*"))


def test_unparsable_run_tokenizer_is_one_line_in_sample_export_and_eval_core(full_run, tmp_path, capsys):
    """Garbage in RUN/tokenizer.model: its sha256 is not the recorded one, so every command that
    would use it refuses in one line (before an export folder is written)."""
    run = copy_run(full_run, tmp_path / "run")
    (run / "tokenizer.model").write_bytes(b"\x00not a sentencepiece model\xff" * 10)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "core.yaml").write_text("icl_tasks: []\n")
    for argv in (["sample", str(run), "--prompt", "ka"], ["export", str(run), "--hf", str(tmp_path / "exp")],
                 ["eval", "core", str(run), "--bundle", str(bundle), "--out", str(tmp_path / "c.json")]):
        rc, err = cli(argv, capsys)
        one_line_exit_2(rc, err)
        assert "tokenizer.model" in err, argv
    assert not (tmp_path / "exp").exists() and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("name,content", [("dataset.json", "[1]"), ("dataset.json", '{"fingerprint": 7}'),
                                          ("config.json", "{\"name\": 5"), ("summary.json", '{"steps": "4"}')])
def test_reused_experiment_run_with_malformed_records_is_one_line(name, content, full_run, tiny_data, tmp_path):
    """What `tngram compare` / `experiment` read of a finished run they would reuse: a malformed
    record is one TngramError naming the file, never a traceback."""
    from tngram.experiments.runner import check_same_dataset, is_complete
    from tngram.readback import read_summary_file
    run = copy_run(full_run, tmp_path / "run")
    (run / name).write_text(content)
    cfg = tiny_config(tiny_data, extra=EXTRA)
    with pytest.raises(TngramError, match=name):
        check_same_dataset(run, cfg)
        is_complete(run, cfg)
        read_summary_file(run / "summary.json", run)


@pytest.mark.parametrize("content,needle", [('{"core": null, "tasks": {}}', "core"),
                                            ('{"core": 0.1, "tasks": {"arc": {"accuracy": 0.5}}}', "tasks.arc"),
                                            ('{"core": 0.1, "tasks": [1]}', "tasks")])
def test_report_tables_with_a_malformed_core_json_is_one_line(content, needle, full_run, tmp_path, capsys):
    run = copy_run(full_run, tmp_path / "run")
    (run / "eval").mkdir()
    (run / "eval" / "core.json").write_text(content)
    rc, err = cli(["report", "tables", str(run), "--out", str(tmp_path / "t")], capsys)
    one_line_exit_2(rc, err)
    assert "core.json" in err and needle in err


@pytest.mark.parametrize("recipe", ["mini-raw", "mini-tngram", "mini-engram"])
def test_model_size_lower_bound_is_below_the_exact_count(recipe, tiny_data):
    """The quick refusal of an absurd config.json uses a lower bound of the parameter count; it
    must never exceed the exact count (else a model that fits could be refused)."""
    from tngram.model.gpt import GPT
    from tngram.train.recipes import resolve_config
    from tngram.train.saved import param_lower_bound
    for cfg in (tiny_config(tiny_data, recipe), resolve_config(recipe, [], str(tiny_data))):
        with torch.device("meta"):
            exact = GPT(cfg.model).num_params()
        assert 0 < param_lower_bound(cfg.model) <= exact


def test_fifo_as_lock_file_is_refused_without_blocking(half_run, tiny_data, tmp_path, capsys):
    run = copy_run(half_run, tmp_path / "run")
    os.mkfifo(run / LOCK_FILE)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, EXTRA), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "not a regular file" in err


def test_experiment_worker_log_as_symlink_is_never_appended_to(tiny_data, victim, tmp_path, monkeypatch):
    """`--jobs 2` sends a run's output to RUN/worker.log: a link planted there is refused (O_NOFOLLOW)
    before the worker starts, and its target keeps its bytes."""
    import subprocess

    from tngram.experiments import runner
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a))
    rdir = tmp_path / "runs" / "x"
    rdir.mkdir(parents=True)
    (rdir / "worker.log").symlink_to(victim)
    before = victim.read_bytes()
    with pytest.raises(OSError):
        runner._train_one(1, runner.RunSpec("x", tiny_config(tiny_data, extra=EXTRA)), rdir, 1, 1, 2)
    assert victim.read_bytes() == before and not started


def test_real_out_of_memory_under_an_address_space_limit_is_one_line(tiny_data, tmp_path):
    """`ulimit -v` (RLIMIT_AS) 1.5 GiB: a tiny training run fits (checked first: otherwise this
    machine's torch alone needs more and the test is skipped); the same run with a 256x larger
    micro-batch runs out of memory inside the step and says so in one line, exit 2."""
    import resource
    import subprocess
    import sys
    limit = 1500 << 20

    def run(micro: int, out: str) -> subprocess.CompletedProcess:
        extra = EXTRA + ["schedule.steps=2", f"data.micro_batch_seqs={micro}",
                         f"data.global_batch_tokens={micro * 64}"]
        return subprocess.run([sys.executable, "-m", "tngram", "train",
                               *cli_args(tiny_data, "mini-raw", tmp_path / out, extra)],
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    small = run(4, "small")
    if small.returncode != 0:
        pytest.skip(f"a tiny run does not fit in 1.5 GiB of address space here: {small.stderr[-200:]}")
    big = run(1024, "big")
    lines = [x for x in big.stderr.strip().splitlines() if x.strip()]
    assert big.returncode == 2 and "Traceback" not in big.stderr, big.stderr[-2000:]
    assert lines[-1].startswith("tngram: error: out of memory") and "micro_batch_seqs" in lines[-1]
