"""`run.sdpa`: which kernel torch's scaled_dot_product_attention prefers in a run.

torch picks the attention kernel by a priority list that depends on its build, the card and the
cuDNN version (FlashAttention 2, cuDNN's fused attention, the memory-efficient kernel, the math
fallback); parameter-golf enables flash alone. The setting puts one backend first and keeps the
others behind it, so shapes it cannot serve still run (a preference, not a restriction):

    auto       torch's own order (the default)
    cudnn      cuDNN, then flash, memory-efficient, math
    flash      flash, then memory-efficient, cuDNN, math (parameter-golf's kernel first)
    efficient  memory-efficient, then flash, cuDNN, math
    math       the math fallback (every shape; slow)

The trainer holds the preference around the whole run (`sdpa_preference`): the compiled graph,
which fixes its attention kernel when it compiles, the eager steps and the evaluation all see it.
env.json records the kernel torch picks for the model's attention shapes (`sdpa_backend`).
On the CPU torch has a flash and a math kernel only: the setting changes nothing there unless
it is "math". `python -m research bench gpu --sections attention` times every backend on a card.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

SDPA_SETTINGS = ("auto", "cudnn", "flash", "efficient", "math")
_ORDER = {
    "cudnn": ("cudnn", "flash", "efficient", "math"),
    "flash": ("flash", "efficient", "cudnn", "math"),
    "efficient": ("efficient", "flash", "cudnn", "math"),
    "math": ("math",),
}


def sdpa_backend(name: str) -> Any:
    """Our name of an SDPA kernel ("cudnn", "flash", "efficient", "math") -> torch's
    SDPBackend."""
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def sdpa_preference(setting: str) -> contextlib.AbstractContextManager[Any]:
    """A context in which scaled_dot_product_attention tries the backends in `setting`'s order
    (module docstring); "auto": torch's own order, unchanged."""
    if setting == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([sdpa_backend(b) for b in _ORDER[setting]], set_priority=True)


def sdpa_pick(
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    seq: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> str:
    """The kernel torch picks here, now, for a causal attention of these shapes (q laid out as
    the model's transposed projection): "cudnn", "flash", "efficient" or "math"."""
    dt = dtype or torch.float32
    q = torch.zeros(1, seq, n_head, head_dim, device=device, dtype=dt).transpose(1, 2)
    kv = torch.zeros(1, seq, n_kv_head, head_dim, device=device, dtype=dt).transpose(1, 2)
    return sdpa_name(
        torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=n_kv_head != n_head)
    )


def sdpa_name(choice: int) -> str:
    """torch._fused_sdp_choice's integer -> our name ("cudnn", "flash", "efficient", "math";
    torch's own name, lower case, for any other)."""
    from torch.nn.attention import SDPBackend

    got = SDPBackend(choice)
    for name in SDPA_SETTINGS[1:]:
        if sdpa_backend(name) == got:
            return name
    return got.name.lower()
