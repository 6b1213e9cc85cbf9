"""Hostile checkpoints (docs/RELIABILITY.md, "Files read back"): optimiser state and meta.json
edited with the manifest forged to match are refused before the first step, one line naming the
file and the field, exit 2, the run folder unchanged; a run never ends "done" with non-finite
weights or validation; a non-finite loss right after a resume names the checkpoint; the disk-full
path of the sharded (DCP) checkpoint writer."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_hostile import EXTRA, cli, one_line_exit_2, tree_digest
from test_train_support import cli_args, tiny_config, tiny_data  # noqa: F401
from tngram.common import TngramError
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train
from tngram.train.checkpoint import SUSPECT_STEPS

# the memory table on RowwiseAdam with the catch-up state (step, exp_avg, exp_avg_sq_row,
# last_step, lr_history); the other groups on torch's Adam (step tensor) and Muon
ROWWISE = [*EXTRA, "optim.memory_update=rowwise", "optim.memory_catchup=true"]


@pytest.fixture(scope="module")
def rowwise_half(tiny_data, tmp_path_factory):
    """A rowwise + catch-up run stopped after step 2 of 4 (checkpoint step_000002)."""
    out = tmp_path_factory.mktemp("hostile-ckpt") / "half"
    torch.set_num_threads(1)
    train(tiny_config(tiny_data, extra=ROWWISE), out, max_steps=2)
    return out


def forge_manifest(c: Path) -> None:
    """Rewrite checkpoint folder c's manifest to match its files (a forger's last step)."""
    m = json.loads((c / "manifest.json").read_text())
    for name in m["files"]:
        data = (c / name).read_bytes()
        m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (c / "manifest.json").write_text(json.dumps(m))


def table_key(state: dict, key: str) -> str:
    """The state tensor name of the RowwiseAdam table's `key` ("optim/OPT/IDX/key")."""
    hits = [k for k in state if k.endswith("/exp_avg_sq_row")]
    assert len(hits) == 1, hits
    return hits[0].rsplit("/", 1)[0] + "/" + key


def _set_row(state, v):
    state[table_key(state, "exp_avg_sq_row")][0] = v


def _set_last(state, v):
    state[table_key(state, "last_step")][0] = v


def _drop(state, key):
    del state[table_key(state, key)]


def _cut(state, key):
    k = table_key(state, key)
    state[k] = state[k][:-1].clone()


def _lr(state, v):
    state[table_key(state, "lr_history")][0] = v


def _adam_sq(state):
    k = next(k for k in state if k.endswith("/exp_avg_sq") and state[k].numel() > 1)
    state[k].view(-1)[0] = -1.0


def _adam_step(state):
    k = next(k for k in state if k.endswith("/step"))
    state[k] = torch.tensor(1e9)


def _dtype(state):
    k = table_key(state, "exp_avg_sq_row")
    state[k] = state[k].to(torch.int32)


STATE_CASES = [
    (lambda s: _set_row(s, -1.0), "exp_avg_sq_row must lie in [0, inf]"),
    (lambda s: _set_last(s, 2**30), "last_step must lie in [0, 2]"),
    (lambda s: _set_last(s, -5), "last_step must lie in [0, 2]"),
    (lambda s: _drop(s, "exp_avg_sq_row"), "exp_avg_sq_row is missing"),
    (lambda s: _cut(s, "exp_avg_sq_row"), "exp_avg_sq_row has shape"),
    (lambda s: _cut(s, "exp_avg"), "exp_avg has shape"),
    (lambda s: _drop(s, "last_step"), "last_step is missing"),
    (lambda s: _lr(s, 1e30), "lr_history must lie in [0,"),
    (lambda s: _lr(s, -1.0), "lr_history must lie in [0,"),
    (_adam_sq, "exp_avg_sq must lie in [0, inf]"),
    (_adam_step, "/step must lie in [0, 2]"),
    (_dtype, "exp_avg_sq_row has dtype torch.int32"),
]


@pytest.mark.parametrize("forge, needle", STATE_CASES)
def test_forged_optimiser_state_is_one_line_before_the_first_step(
    forge, needle, rowwise_half, tiny_data, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    c = run / "checkpoints" / "step_000002"
    state = load_file(str(c / "state.safetensors"))
    forge(state)
    save_file(state, str(c / "state.safetensors"), metadata={"step": "2"})
    forge_manifest(c)
    assert ckpt.verify_checkpoint(c) is None  # the forgery passes the byte-level check
    before = tree_digest(run)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, ROWWISE), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "state.safetensors" in err and needle in err, err
    assert tree_digest(run) == before  # refused before the first step: nothing written


META_CASES = [
    (lambda m, o: o["plain_state"][next(iter(o["plain_state"]))].update(step=2**30), "step"),
    (lambda m, o: o["param_groups"][0].update(base_lr=float("nan")), "base_lr"),
    (lambda m, o: o["param_groups"][0].update(betas=[0.9, 1.5]), "betas"),
    (lambda m, o: o["param_groups"][0].update(params=[5]), "params must be"),
    (lambda m, o: m.update(step=-1), "field 'step' must be an int >= 0"),
    (lambda m, o: m.update(tokens="many"), "field 'tokens' must be an int"),
    (lambda m, o: m.pop("step"), "field 'step' is missing"),
    (lambda m, o: m.update(step=2.0), "field 'step' must be an int >= 0, got 2.0"),
    (lambda m, o: m.update(optimizers=[1, 2]), "field 'optimizers' must be an object"),
    (lambda m, o: m["loader"].update(pos="1028"), "loader: field 'pos' must be an int"),
    (lambda m, o: m.update(config=5), "field 'config' must be an object"),
    (lambda m, o: m["config"].update(model=[1]), "field config.model must be an object"),
    (lambda m, o: m.update(world_size="x"), "field 'world_size' must be an int >= 1"),
    (lambda m, o: m.update(train_loss="x"), "field 'train_loss' must be a number or null"),
    (lambda m, o: m.pop("loader"), "field 'loader' is missing"),
    (lambda m, o: m["loader"].update(pos="x"), "loader: field 'pos' must be an int"),
    (lambda m, o: m["loader"].update(order=[7, 7]), "field loader: loader state has an invalid"),
    # settings in range but not the config's: the config's, never the checkpoint's, are used
    (lambda m, o: o["param_groups"][0].update(betas=[0.5, 0.5]), "betas is [0.5, 0.5] but the run"),
    (lambda m, o: o["param_groups"][0].update(eps=1e-3), "eps is 0.001 but the run's config gives"),
    (lambda m, o: o["param_groups"][0].update(base_lr=7.5), "base_lr is 7.5 but the run's config"),
]


@pytest.mark.parametrize("forge, needle", META_CASES)
def test_forged_checkpoint_meta_is_one_line(
    forge, needle, rowwise_half, tiny_data, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    c = run / "checkpoints" / "step_000002"
    meta = json.loads((c / "meta.json").read_text())
    table = next(n for n, o in meta["optimizers"].items() if o["plain_state"])
    forge(meta, meta["optimizers"][table])
    (c / "meta.json").write_text(json.dumps(meta))
    forge_manifest(c)
    before = tree_digest(run)
    rc, err = cli(["train", *cli_args(tiny_data, "mini-tngram", run, ROWWISE), "--resume"], capsys)
    one_line_exit_2(rc, err)
    assert "meta.json" in err and needle in err, err
    assert tree_digest(run) == before


def test_untouched_rowwise_catchup_checkpoint_resumes(rowwise_half, tiny_data, tmp_path):
    """The checks pass the state tngram itself writes (rowwise, catch-up, Adam and Muon)."""
    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    summary = train(tiny_config(tiny_data, extra=ROWWISE), run, resume=True)
    assert summary["steps"] == 4


def test_non_finite_final_weights_are_never_written_as_done(rowwise_half, tiny_data, tmp_path):
    """Weights that turn non-finite at the end (here: poisoned after the last step) stop the run
    before model.safetensors and summary.json, naming the last good checkpoint."""
    from tngram.train import loop

    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    real = loop.Trainer.finish

    def poisoned(self, health):
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("nan"))
        return real(self, health)

    finals = {n: (run / n).read_bytes() for n in ("model.safetensors", "summary.json")}  # step 2
    loop.Trainer.finish = poisoned
    try:
        with pytest.raises(TngramError, match=r"non-finite final weights at step 4; .*step_000004"):
            train(tiny_config(tiny_data, extra=ROWWISE), run, resume=True)
    finally:
        loop.Trainer.finish = real
    assert finals == {n: (run / n).read_bytes() for n in finals}  # neither rewritten


def test_final_problem_names_weights_then_validation():
    ok = [torch.ones(3)]
    assert ckpt.final_problem(ok, 1.5) is None
    assert (
        ckpt.final_problem([torch.tensor([1.0, float("inf")])], 1.5) == "non-finite final weights"
    )
    assert "validation loss (nan)" in ckpt.final_problem(ok, float("nan"))
    assert ckpt.final_problem([torch.arange(3)], 2.0) is None  # integer buffers are not weights


def test_non_finite_loss_right_after_a_resume_names_the_checkpoint(
    rowwise_half, tiny_data, tmp_path
):
    """Weights scaled up in the checkpoint (manifest forged; finite, so they pass every
    check) give a non-finite loss on the first step after the resume: the message names the
    checkpoint as a suspect, not only the learning rates."""
    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    c = run / "checkpoints" / "step_000002"
    w = load_file(str(c / "model.safetensors"))
    for k, v in w.items():
        if v.is_floating_point():
            w[k] = v * 1e30
    save_file(w, str(c / "model.safetensors"), metadata={"step": "2"})
    forge_manifest(c)
    with pytest.raises(TngramError) as e:
        train(tiny_config(tiny_data, extra=ROWWISE), run, resume=True)
    text = str(e.value)
    assert "non-finite" in text and f"resumed from {c}" in text and "suspect" in text, text


def test_resume_suspect_only_soon_after_a_resume(tmp_path):
    assert ckpt.resume_suspect(None, 0, 3) == ""
    assert "suspect" in ckpt.resume_suspect(tmp_path, 2, 3)
    assert ckpt.resume_suspect(tmp_path, 2, 2 + SUSPECT_STEPS + 1) == ""


def test_sharded_checkpoint_disk_full_is_one_line_and_keeps_the_previous(
    rowwise_half, tmp_path, monkeypatch
):
    """finish_sharded_checkpoint (the main process's half of a DCP checkpoint) on a full disk:
    DiskFull naming the checkpoint, the torn temporary folder removed, step_000002 intact."""
    from tngram.train import sharded_checkpoint as sh

    run = tmp_path / "run"
    shutil.copytree(rowwise_half, run)
    tmp = sh.sharded_temp(run, 4)
    (tmp / ckpt.DCP_DIR).mkdir(parents=True)
    (tmp / ckpt.DCP_DIR / "shard-00000-model-00001-of-00001.safetensors").write_bytes(b"x" * 64)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "write_file", full)
    with pytest.raises(ckpt.DiskFull, match=r"disk full while writing checkpoint step_000004"):
        sh.finish_sharded_checkpoint(run, 4, {"w": torch.ones(2)}, {}, {}, keep=10)
    assert not tmp.exists()
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [2]
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step_000002") is None
