"""run.compile = "auto" (the default): compiled on CUDA (fullgraph), eager on the CPU; a failure to
compile at the first step falls back to eager with one line, and env.json records what ran
(tngram.train.compile_mode). The CUDA branch runs here on the CPU by resolving "auto" as for a
CUDA device (`compiles` patched to answer for device "cuda"); the forced failure is a real
torch.compile whose backend raises, going through the real Trainer.
"""

from __future__ import annotations

import json

import pytest
import torch

import tngram.train.compile_mode as cm
from test_train_support import losses, one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.common import TngramError
from tngram.train.config import RunConfig, apply_overrides
from tngram.train.loop import train
from tngram.train.recipes import get_recipe

CPU, CUDA, MPS = torch.device("cpu"), torch.device("cuda", 0), torch.device("mps")
EXTRA = ["schedule.steps=3", "run.val_every=0", "run.checkpoint_every=0"]


def test_auto_resolves_by_device():
    assert cm.compiles("auto", CUDA) and not cm.compiles("auto", CPU)
    assert not cm.compiles("auto", MPS)
    for dev in (CPU, CUDA):  # true / false keep their meaning on every device
        assert cm.compiles(True, dev) and not cm.compiles(False, dev)


def test_default_and_settings():
    assert RunConfig().compile == "auto"
    cfg = get_recipe("mini-raw")
    assert cfg.run.compile == "auto"
    for text, want in (("auto", "auto"), ("true", True), ("false", False)):
        assert apply_overrides(cfg, [f"run.compile={text}"]).run.compile == want
    with pytest.raises(TngramError, match=r"run.compile must be true, false or auto, got 'fast'"):
        apply_overrides(cfg, ["run.compile=fast"])


def test_compile_forward_per_setting(monkeypatch):
    seen = []
    real = torch.compile

    def spy(model, **kw):
        seen.append(kw)
        return real(model, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    model = torch.nn.Linear(2, 2)
    fwd, st = cm.compile_forward(model, "auto", CPU)
    assert fwd is model and st.record() == {
        "setting": "auto",
        "ran": "eager",
        "reason": "run.compile=auto on cpu",
        "newton_schulz": "eager",
    }
    fwd, st = cm.compile_forward(model, False, CUDA)
    assert fwd is model and st.ran == "eager" and st.reason == "run.compile=false"
    fwd, st = cm.compile_forward(model, True, CPU)
    assert fwd._orig_mod is model and st.ran == "compiled" and not st.armed
    fwd, st = cm.compile_forward(model, "auto", CUDA)
    assert fwd._orig_mod is model and st.ran == "compiled" and st.armed
    assert seen == [{"dynamic": False}, {"dynamic": False, "fullgraph": True}]


def test_failure_reason_names_the_wrapped_error():
    inner = RuntimeError("forced backend failure\nmore detail")
    outer = ValueError("wrapper:\nlong text")
    outer.__cause__ = inner
    assert cm.failure_reason(outer) == "ValueError (RuntimeError: forced backend failure)"
    assert cm.failure_reason(KeyError("k")) == "KeyError: 'k'"
    assert len(cm.failure_reason(RuntimeError("x" * 1000))) == 300


def _as_on_cuda(monkeypatch) -> None:
    real = cm.compiles
    monkeypatch.setattr(cm, "compiles", lambda setting, device: real(setting, CUDA))


def test_forced_compile_failure_falls_back_to_eager(tiny_data, tmp_path, monkeypatch, capsys):
    """The backend raises at the first step: one line names the reason, the step runs again eager
    from the same batches, so the run's losses equal a run.compile=false run's bit for bit."""
    ref = tmp_path / "eager"
    train(tiny_config(tiny_data, extra=EXTRA + ["run.compile=false"]), ref, progress=False)
    assert json.loads((ref / "env.json").read_text())["compile"] == {
        "setting": False,
        "ran": "eager",
        "reason": "run.compile=false",
        "newton_schulz": "eager",
    }
    capsys.readouterr()

    def failing_backend(gm, example_inputs):
        raise RuntimeError("forced backend failure")

    real_compile = torch.compile
    calls = []

    def compile_with_failing_backend(model, **kw):
        calls.append(kw)
        return real_compile(model, backend=failing_backend, **kw)

    _as_on_cuda(monkeypatch)
    monkeypatch.setattr(torch, "compile", compile_with_failing_backend)
    run = tmp_path / "auto"
    train(tiny_config(tiny_data, extra=EXTRA), run, progress=False)
    assert calls == [{"dynamic": False, "fullgraph": True}]
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "torch.compile failed" in ln]
    reason = "torch.compile failed: BackendCompilerFailed (RuntimeError: forced backend failure)"
    assert lines == [f"tngram: note: run.compile=auto: {reason}; running eager"]
    env = json.loads((run / "env.json").read_text())
    assert env["compile"] == {
        "setting": "auto",
        "ran": "eager",
        "reason": reason,
        "newton_schulz": "eager",  # compiled only once the forward compiled
    }
    assert losses(run) == losses(ref) and sorted(losses(run)) == [1, 2, 3]


def test_auto_compiled_records_compiled(tiny_data, tmp_path, monkeypatch, capsys):
    """The compiled branch (dynamo with its "eager" backend, so no C++ build): no fallback line,
    env.json says the forward and Muon's Newton-Schulz ran compiled, and the run finishes."""
    real_compile = torch.compile
    _as_on_cuda(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, backend="eager", **kw))
    summary = train(tiny_config(tiny_data, extra=EXTRA), tmp_path / "run", progress=False)
    assert "torch.compile failed" not in capsys.readouterr().out
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["compile"] == {"setting": "auto", "ran": "compiled", "newton_schulz": "compiled"}
    assert summary["steps"] == 3 and sorted(losses(tmp_path / "run")) == [1, 2, 3]


@pytest.mark.parametrize("update", ["sparse", "rowwise"])
def test_auto_with_row_sparse_tables_compiles_around_the_gathers(
    update, tiny_data, tmp_path, monkeypatch, capsys
):
    """Row-sparse tables: their gathers are torch.compiler.disable()d, which a fullgraph compile
    refuses (the whole forward then ran eager). "auto" compiles them with fullgraph=False: no
    fallback line, env.json says compiled with the graph breaks' reason, and (dynamo's "eager"
    backend) the losses equal a run.compile=false run's bit for bit."""
    extra = EXTRA + [f"optim.memory_update={update}"]
    ref = tmp_path / "eager"
    train(tiny_config(tiny_data, extra=extra + ["run.compile=false"]), ref, progress=False)
    real_compile = torch.compile
    calls = []

    def compile_eager_backend(model, **kw):
        calls.append(kw)
        return real_compile(model, backend="eager", **kw)

    _as_on_cuda(monkeypatch)
    monkeypatch.setattr(torch, "compile", compile_eager_backend)
    capsys.readouterr()
    run = tmp_path / "auto"
    train(tiny_config(tiny_data, extra=extra), run, progress=False)
    assert "torch.compile failed" not in capsys.readouterr().out
    assert calls[0] == {"dynamic": False, "fullgraph": False}
    env = json.loads((run / "env.json").read_text())
    assert env["compile"] == {
        "setting": "auto",
        "ran": "compiled",
        "newton_schulz": "compiled",
        "graph_breaks": "row-sparse table gathers run eager (optim.memory_update=sparse|rowwise)",
    }
    assert losses(run) == losses(ref) and sorted(losses(run)) == [1, 2, 3]


def _muon_runs():
    """make() -> (parameters, Muon) from the same weights and gradients each time."""
    from tngram.optim.muon import Muon

    torch.manual_seed(0)
    ws = [torch.randn(8, 4), torch.randn(4, 6)]
    grads = [torch.randn_like(w) for w in ws]

    def make():
        ps = [torch.nn.Parameter(w.clone()) for w in ws]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        return ps, Muon(ps, lr=0.1, momentum=0.9)

    return make


def test_muon_compiled_newton_schulz_and_its_fallback(monkeypatch):
    """use_compiled_ns: the same updates as the eager function (dynamo's "eager" backend runs
    the same ops); a backend that raises at the first step falls back to the eager function,
    same updates, and ns_compile_error says why."""
    from tngram.optim.muon import zeropower_newton_schulz

    make = _muon_runs()
    ref_ps, ref = make()
    ref.step()
    ref.step()
    real = torch.compile

    def boom(gm, example_inputs):
        raise RuntimeError("forced backend failure")

    for backend, error in (("eager", None), (boom, "BackendCompilerFailed")):
        monkeypatch.setattr(torch, "compile", lambda f, b=backend, **kw: real(f, backend=b, **kw))
        ps, opt = make()
        opt.use_compiled_ns()
        assert opt._ns is not zeropower_newton_schulz
        opt.step()
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ps, ref_ps))
        if error is None:
            assert opt.ns_compile_error is None and opt._ns is not zeropower_newton_schulz
        else:
            assert opt.ns_compile_error.startswith(error) and opt._ns is zeropower_newton_schulz


def test_resume_may_change_run_compile(tiny_data, tmp_path):
    """A run written with run.compile=false (the old default) resumes under the new default."""
    run = tmp_path / "run"
    train(tiny_config(tiny_data, extra=EXTRA + ["run.compile=false"]), run, max_steps=1)
    summary = train(tiny_config(tiny_data, extra=EXTRA), run, resume=True, progress=False)
    assert summary["steps"] == 3
    assert json.loads((run / "env.json").read_text())["compile"]["setting"] == "auto"
