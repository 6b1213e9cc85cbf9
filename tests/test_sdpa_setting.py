"""run.sdpa: the attention kernel torch prefers, held around the whole run (tngram.train.sdpa)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_train_support import single_thread, tiny_config, tiny_data  # noqa: F401
from tngram.common import TngramError
from tngram.model.gpt import GPT
from tngram.train.recipes import resolve_config
from tngram.train.sdpa import SDPA_SETTINGS, sdpa_pick, sdpa_preference


class AttentionOps(TorchDispatchMode):
    """The fused attention ops a forward dispatches (the math backend dispatches none: it is
    matmuls and a softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product_") or name.startswith("_flash_attention"):
            self.fused.append(name)
        return func(*args, **(kwargs or {}))


def test_preference_is_an_order_not_a_restriction():
    """On the CPU torch has a flash kernel and the math one: "auto" picks flash; "math" puts
    math first; "cudnn" asks for a kernel the CPU lacks and still runs, on the next one (flash).
    Outside the context torch's own order is back."""
    args = (4, 2, 16, 32, torch.device("cpu"), None)  # 4 heads, 2 kv heads, head_dim 16, T 32
    assert sdpa_pick(*args) == "flash"
    with sdpa_preference("math"):
        assert sdpa_pick(*args) == "math"
    with sdpa_preference("cudnn"):
        assert sdpa_pick(*args) == "flash"
    with sdpa_preference("auto"):
        assert sdpa_pick(*args) == "flash"
    assert sdpa_pick(*args) == "flash"


def test_the_model_attends_with_the_preferred_kernel():
    """The GPT's own attention under the preference: the fused CPU flash op under "auto", none
    under "math"; the two outputs agree to fp32 rounding (the same attention)."""
    cfg = resolve_config("mini-raw", ["model.n_layer=1"]).model
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    outs = {}
    for setting in ("auto", "math"):
        with sdpa_preference(setting), AttentionOps() as ops, torch.no_grad():
            outs[setting] = model(x)
        assert bool(ops.fused) == (setting == "auto"), (setting, ops.fused)
    torch.testing.assert_close(outs["math"], outs["auto"], rtol=1e-5, atol=1e-5)


def test_config_values_and_file():
    assert SDPA_SETTINGS == ("auto", "cudnn", "flash", "efficient", "math")
    with pytest.raises(TngramError, match=r"run\.sdpa"):
        resolve_config("mini-raw", ["run.sdpa=fastest"])
    assert "sdpa" not in resolve_config("mini-raw", []).to_dict()["run"]  # older configs match
    cfg = resolve_config("mini-raw", ["run.sdpa=flash"])
    assert cfg.to_dict()["run"]["sdpa"] == "flash"
    assert type(cfg).from_dict(cfg.to_dict()).run.sdpa == "flash"


def test_a_run_records_its_setting_and_torchs_pick(tiny_data, tmp_path):  # noqa: F811
    from tngram.train.loop import train

    extra = ["schedule.steps=3", "run.val_every=0", "run.checkpoint_every=0", "run.sdpa=math"]
    with single_thread():
        train(tiny_config(tiny_data, "mini-raw", extra=extra), tmp_path / "run", max_steps=2)
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["sdpa"] == "math" and env["sdpa_backend"] == "math"
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["run"]["sdpa"] == "math"
    # like run.compile, the kernel may change when the run resumes (the same attention)
    extra[-1] = "run.sdpa=auto"
    with single_thread():
        summary = train(tiny_config(tiny_data, "mini-raw", extra=extra), tmp_path / "run",
                        resume=True)
    assert summary["steps"] == 3
    assert json.loads((tmp_path / "run" / "env.json").read_text())["sdpa_backend"] == "flash"


def test_a_compiled_model_fixes_the_kernel_of_its_preference():
    """torch.compile chooses the attention kernel when it traces: the trainer compiles inside
    the preference, so the graph holds the preferred kernel (the aten graph that AOT autograd
    hands to the compiler: the fused CPU flash op under "auto", none under "math")."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    cfg = resolve_config("mini-raw", ["model.n_layer=1"]).model
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    for setting in ("auto", "math"):
        fused: list[str] = []

        def forward_graph(gm, example_inputs):
            fused.extend(
                str(n.target) for n in gm.graph.nodes
                if n.op == "call_function" and "scaled_dot_product" in str(n.target)
            )
            return gm

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_graph),
                                 fullgraph=True, dynamic=False)
        with sdpa_preference(setting):
            compiled(x)
        assert bool(fused) == (setting == "auto"), (setting, fused)
    torch._dynamo.reset()
