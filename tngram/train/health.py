"""Is a run learning, and can its step fit at all? Cheap checks around the training loop.

`LossHealth` watches the per-step training loss. A model that predicts the uniform
distribution has loss exactly ln(V) (V = vocab size); a run whose loss sits within
`tol` nats of ln(V) for `window` consecutive steps after the first `window` steps is not
learning (e.g. `optim.matrix_lr=1e9` saturates every logit). The trainer then warns once and
writes `healthy: false` with the reason into summary.json. A run too short to tell
(fewer than 2*window steps) is reported healthy with no claim beyond "no sign of trouble".

`check_step_memory` refuses, before any allocation, a configuration whose training step
certainly cannot fit: it computes a LOWER bound on the bytes one optimiser step holds
(weights, gradients and one optimiser moment per parameter; fp32 logits and their gradient;
per block the activations saved for backward: the residual input, q/k/v, attention output and
the MLP hidden layer) and compares it with the memory available now. Being a lower bound it
never refuses a step that fits; a step just under it may still run out of memory.
"""

from __future__ import annotations

import math
import os
from collections import deque

import torch

from tngram.common import TngramError

HEALTH_WINDOW = 20  # steps
HEALTH_TOL = 0.02  # nats


class LossHealth:
    """Feed every step's training loss; `verdict()` is (healthy, reason or None)."""

    def __init__(
        self, vocab_size: int, window: int = HEALTH_WINDOW, tol: float = HEALTH_TOL
    ) -> None:
        self.uniform = math.log(vocab_size)
        self.window, self.tol = window, tol
        self.recent: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.stuck_since: int | None = None

    def update(self, step: int, loss: float) -> str | None:
        """Record the loss of `step`; returns a warning the first time the run looks stuck."""
        self.steps += 1
        self.recent.append(loss)
        stuck = (
            self.steps >= 2 * self.window
            and len(self.recent) == self.window
            and all(abs(x - self.uniform) < self.tol for x in self.recent)
        )
        if stuck and self.stuck_since is None:
            self.stuck_since = step - self.window + 1
            return f"tngram: warning: {self.reason()}"
        if not stuck:
            self.stuck_since = None
        return None

    def reason(self) -> str:
        return (
            f"train loss stayed within {self.tol} of ln(V) = {self.uniform:.4f} (a uniform "
            f"prediction) from step {self.stuck_since} on: the model is not learning; lower the "
            f"learning rates or check the data"
        )

    def verdict(self) -> tuple[bool, str | None]:
        if self.stuck_since is not None:
            return False, self.reason()
        return True, None


def available_memory(device: str) -> tuple[int | None, str]:
    """(bytes available now, where) for `device` ("auto"/"cpu"/"cuda[:i]"); None if unknown."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        try:
            free, _ = torch.cuda.mem_get_info()
            return int(free), "free on the GPU"
        except Exception:
            return None, "GPU"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available RAM"
    except (ValueError, OSError, AttributeError):
        return None, "RAM"


def step_memory_lower_bound(cfg) -> dict[str, int]:
    """Lower bound, in bytes, of what one training step holds (see the module doc)."""
    from tngram.model.gpt import GPT

    m = cfg.model
    with torch.device("meta"):
        params = GPT(m).num_params()
    B, T, d, L, V = cfg.data.micro_batch_seqs, m.sequence_len, m.n_embd, m.n_layer, m.vocab_size
    tokens = B * T
    return {
        "params": 12 * params,  # weight + grad + 1 moment, fp32
        "logits": 8 * tokens * V,  # fp32 logits + their grad
        "activations": 4 * L * tokens * (4 * d + 2 * m.mlp_width()),
    }  # x, q, k, v, attn out, MLP hidden


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def check_step_memory(cfg) -> None:
    """TngramError (with the estimate) if a training step of `cfg` certainly cannot fit; also the
    other setting that can only fail late: run.threads far above the CPU cores."""
    from tngram.common import check_thread_count

    if cfg.run.threads > 0 and cfg.run.device in ("cpu", "auto"):
        check_thread_count(cfg.run.threads, "run.threads")
    parts = step_memory_lower_bound(cfg)
    need = sum(parts.values())
    have, where = available_memory(cfg.run.device)
    if have is not None and need > have:
        detail = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
        raise TngramError(
            f"one training step needs at least {_gib(need)} ({detail}) but only {_gib(have)} "
            f"{where}; lower data.micro_batch_seqs (now {cfg.data.micro_batch_seqs}; "
            f"gradient accumulation keeps data.global_batch_tokens) or the model size"
        )


def check_batch_vs_data(cfg, train_tokens: int) -> None:
    """A step that would read the whole training split more than once is a mistake (and would
    run for hours before its first update)."""
    if cfg.data.global_batch_tokens > train_tokens:
        raise TngramError(
            f"data.global_batch_tokens = {cfg.data.global_batch_tokens:,} is more than the "
            f"whole training split ({train_tokens:,} tokens): one step would read it more "
            f"than once; lower data.global_batch_tokens"
        )


# How often a run may read its training split before it must ask for it (data.allow_repeat).
# Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models", NeurIPS) found up to about
# 4 epochs of repeated data train about as well as unique data, the returns falling fast beyond.
# Our CPU recipes read far less: a mini run 1.05 M tokens (0.18 passes of the 5.89 M-token
# default corpus, 0.19 of literature, 0.10 of code).
MAX_PASSES = 4.0

# parameter-golf's FineWeb export: 10^8 tokens a train shard (tngram.data.fineweb)
FINEWEB_SHARD_TOKENS = 100_000_000
FINEWEB_VOCABS = (1024,)  # the export's tokenizers tngram has been checked with


def fineweb_command(tokens: int, vocab_size: int, out: object = None) -> str | None:
    """The `tngram data fineweb` command that downloads at least `tokens` training tokens for
    this vocabulary (into `out`, else the default folder), or None where the export has no such
    tokenizer."""
    if vocab_size not in FINEWEB_VOCABS:
        return None
    shards = max(1, math.ceil(tokens / FINEWEB_SHARD_TOKENS))
    where = f" --out {out}" if out is not None else ""
    return f"tngram data fineweb --train-shards {shards}{where}"


def check_passes(cfg, train_tokens: int, data_dir, kind: str | None = None) -> str | None:
    """Refuse (TngramError, one line) a run whose schedule reads its training split more than
    MAX_PASSES times, unless data.allow_repeat; then return a note for the run's header. `kind`
    is the dataset manifest's ("fineweb" for a download: the advice then adds its shards)."""
    planned = cfg.schedule.steps * cfg.data.global_batch_tokens
    passes = planned / max(train_tokens, 1)
    if passes <= MAX_PASSES:
        return None
    said = (
        f"{cfg.name} plans {planned:,} training tokens ({cfg.schedule.steps:,} steps x "
        f"{cfg.data.global_batch_tokens:,}) but {data_dir} holds {train_tokens:,}: it would read "
        f"them {passes:,.1f} times"
    )
    if cfg.data.allow_repeat:
        return f"tngram: note: {said} (data.allow_repeat=true)"
    fetch = fineweb_command(planned, cfg.model.vocab_size, data_dir if kind == "fineweb" else None)
    more = (
        f"download enough FineWeb (`{fetch}`, then --data with its folder; docs/GPU.md)"
        if fetch
        else "train on a larger dataset (`tngram data build --from-text ... --out DIR`, "
        "then --data DIR)"
    )
    raise TngramError(
        f"{said}, more than {MAX_PASSES:g}: {more}, lower --steps, or pass --allow-repeat "
        f"(data.allow_repeat=true) to repeat the data"
    )


__all__ = [
    "MAX_PASSES",
    "check_passes",
    "fineweb_command",
    "LossHealth",
    "check_step_memory",
    "check_batch_vs_data",
    "step_memory_lower_bound",
    "available_memory",
]
