"""On CUDA the trainer reads the device only at sync points (tngram.train.step_reads), and its
batches go pinned and one ahead (tngram.data.loader.DeviceBatches). Checked on the CPU:

- host reads are counted by wrapping the Tensor methods that move a value to the host (`item`,
  `tolist`, `__bool__`, `__float__`, `__int__`, `numpy`), counting the calls made from tngram's
  own code (the model, the optimisers, the trainer). torch's CPU Adam reads its step counters
  (CPU scalars in every case; the fused CUDA Adam the trainer uses there reads none), so calls
  from inside torch are not counted. Token ids are not read in the forward, as on a GPU
  (TNGRAM_CHECK_IDS=0, the GPU default of tngram.memory.ngrams).
- the trainer takes the CUDA branch through `reads_every_step`, patched to answer for "cuda".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tngram.train.loop as loop
from test_train_support import losses, one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.common import TngramError
from tngram.data.loader import DeviceBatches, TokenLoader
from tngram.train import checkpoint as ckpt
from tngram.train.step_reads import StepLosses, first_nonfinite, reads_every_step, stop_check_due

PKG = str(Path(loop.__file__).resolve().parents[1])  # .../tngram
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


def test_reads_every_step_only_off_cuda():
    assert reads_every_step(torch.device("cpu")) and reads_every_step(torch.device("mps"))
    assert not reads_every_step(torch.device("cuda", 0))


def test_stop_check_every_step_except_ddp_on_cuda_between_sync_points():
    assert stop_check_due(True, 2, False) and stop_check_due(False, 1, False)
    assert stop_check_due(False, 2, True) and not stop_check_due(False, 2, False)


def test_step_losses_one_transfer_in_order():
    sl = StepLosses()
    assert sl.read() == [] and len(sl) == 0
    for s, v in ((1, 2.5), (2, float("nan")), (3, 1.25)):
        sl.add(s, torch.tensor(v))
    got = sl.read()
    assert [s for s, _ in got] == [1, 2, 3] and got[0][1] == 2.5 and got[2][1] == 1.25
    assert len(sl) == 0 and sl.last == 1.25
    assert first_nonfinite(got)[0] == 2 and first_nonfinite([(1, 0.5)]) is None


def _count_reads(monkeypatch) -> list[tuple[str, str]]:
    """(phase, caller file:line) of every host read made from tngram's code."""
    log: list[tuple[str, str]] = []
    phase = ["setup"]
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, __real=real, **k):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PKG):
                log.append((phase[0], f"{caller}:{sys._getframe(1).f_lineno}"))
            return __real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    real_step = loop.Trainer.train_step

    def train_step(self):
        phase[0] = f"in step {self.step + 1}"
        out = real_step(self)
        phase[0] = f"after step {self.step}"
        return out

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)
    return log


def _as_on_cuda(monkeypatch) -> None:
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    monkeypatch.setattr(
        loop, "reads_every_step", lambda device: reads_every_step(torch.device("cuda"))
    )


def test_host_reads_only_after_log_steps(tiny_data, tmp_path, monkeypatch):
    """9 steps, a metrics row every 3rd: no read inside a step, and reads after a step only when
    it logs (3, 6, 9; 9 also validates, checkpoints and ends); the losses in one read each."""
    _as_on_cuda(monkeypatch)
    log = _count_reads(monkeypatch)
    extra = ["schedule.steps=9", "run.log_every=3", "run.val_every=0", "run.checkpoint_every=0"]
    loop.train(tiny_config(tiny_data, extra=extra), tmp_path / "run", progress=False)
    phases = {p for p, _ in log}
    assert not any(p.startswith("in step") for p in phases), sorted(phases)
    assert {p for p in phases if p.startswith("after")} == {
        "after step 3",
        "after step 6",
        "after step 9",
    }
    loss_reads = [(p, w) for p, w in log if "step_reads.py" in w]
    assert [p for p, _ in loss_reads] == ["after step 3", "after step 6", "after step 9"]
    assert sorted(losses(tmp_path / "run")) == [3, 6, 9]


def test_cpu_reads_every_step_before_the_update(tiny_data, tmp_path, monkeypatch):
    """The CPU branch, unchanged: the loss is read inside every step (before the update)."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    log = _count_reads(monkeypatch)
    extra = ["schedule.steps=3", "run.log_every=3", "run.val_every=0", "run.checkpoint_every=0"]
    loop.train(tiny_config(tiny_data, extra=extra), tmp_path / "run", progress=False)
    loss_reads = [p for p, w in log if "step_reads.py" in w]
    assert loss_reads == ["in step 1", "in step 2", "in step 3"]


def test_nonfinite_loss_found_at_the_next_sync_point(tiny_data, tmp_path, monkeypatch):
    """The CUDA branch: the loss is NaN from step 5 on; it is read at step 8 (log and checkpoint
    step), reported with step 5, and nothing is written after step 4's checkpoint."""
    from tngram.model.gpt import GPT

    _as_on_cuda(monkeypatch)
    real_forward, calls = GPT.forward, [0]

    def forward(self, ids, targets=None, reduction="mean"):
        out = real_forward(self, ids, targets, reduction)
        if targets is not None and reduction == "mean":
            calls[0] += 1
            if calls[0] > 8:  # 2 micro-steps per step: call 9 is step 5's first
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", forward)
    extra = ["run.log_every=4", "run.checkpoint_every=4", "run.val_every=0"]
    with pytest.raises(TngramError, match=r"loss \(nan\) at step 5; read at step 8.*step_000004"):
        loop.train(tiny_config(tiny_data, extra=extra), tmp_path)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == [4]
    assert not (tmp_path / "summary.json").exists() and sorted(losses(tmp_path)) == [4]


def _loader(tiny_data: Path) -> TokenLoader:
    from tngram.data.build import open_dataset

    return TokenLoader(open_dataset(tiny_data).train_files, 3, 16, seed=7)


def test_device_batches_ahead_same_batches_and_exact_state(tiny_data):
    plain = _loader(tiny_data)
    want = [plain.next_batch() for _ in range(6)]
    ahead = DeviceBatches(_loader(tiny_data), torch.device("cpu"), pin=False, ahead=True)
    for k in range(3):
        x, y = ahead.next_batch()
        assert torch.equal(x, want[k][0]) and torch.equal(y, want[k][1])
        assert ahead.loader.batches == k + 2  # the next batch is read (and sent) already
    # the state is the position before the held batch: a fresh loader resumes at batch 4
    fresh = _loader(tiny_data)
    fresh.load_state_dict(ahead.state_dict())
    assert torch.equal(fresh.next_batch()[0], want[3][0])
    ahead.load_state_dict(plain.state_dict())  # drops the held batch
    assert ahead._held is None
    x, y = ahead.next_batch()
    assert torch.equal(x, plain.next_batch()[0]) and torch.equal(y[:, :-1], x[:, 1:])


def test_device_batches_defaults_by_device(tiny_data):
    cuda = DeviceBatches(_loader(tiny_data), torch.device("cuda", 0))  # nothing sent yet
    assert cuda.pin and cuda.ahead
    cpu = DeviceBatches(_loader(tiny_data), torch.device("cpu"))
    assert not cpu.pin and not cpu.ahead
    x, _ = cpu.next_batch()
    assert cpu.loader.batches == 1 and x.shape == (3, 16)  # batch for batch, nothing ahead


def test_trainer_resume_exact_with_batches_ahead(tiny_data, tmp_path, monkeypatch):
    """The trainer with batches sent one ahead (the CUDA default, forced here): stopped after
    step 3 and resumed, it trains on exactly the batches of an uninterrupted run (the
    checkpoint holds the position before the held batch)."""
    import tngram.data.loader as loader_mod
    from test_train_support import weights

    real = loader_mod.DeviceBatches
    monkeypatch.setattr(
        loader_mod, "DeviceBatches", lambda lo, dev: real(lo, dev, pin=False, ahead=True)
    )
    cfg = tiny_config(tiny_data, extra=["schedule.steps=5", "run.val_every=0"])
    loop.train(cfg, tmp_path / "whole", progress=False)
    loop.train(cfg, tmp_path / "split", max_steps=3, progress=False)
    loop.train(cfg, tmp_path / "split", resume=True, progress=False)
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    wa, wb = weights(tmp_path / "whole"), weights(tmp_path / "split")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
