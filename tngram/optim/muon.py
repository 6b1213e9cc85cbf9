"""Muon: momentum + Newton-Schulz orthogonalisation for matrix-shaped parameters.

Follows parameter-golf's baseline optimiser (train_gpt.py; Jordan et al. 2024,
"Muon"), which the TN-gram paper uses unchanged (App. E, Table 5). Per matrix W with gradient G:

    b <- mu * b + G                                  momentum buffer (fp32, no dampening)
    U <- G + mu * b                                  Nesterov look-ahead
    U <- NS_5(U)                                     5 quintic Newton-Schulz steps in bf16
    U <- U * sqrt(max(1, rows / cols))               rows = out_features
    W <- W - lr * U                                  no weight decay, no other scaling

Newton-Schulz (`zeropower_newton_schulz`): X = U / (||U||_F + 1e-7) in bf16, transposed so the Gram
matrix is on the short side, then `steps` times A = X X^T, X <- a X + (b A + c A^2) X with
(a, b, c) = (3.4445, -4.7750, 2.0315). On singular values this is the scalar map
phi(s) = a s + b s^3 + c s^5 iterated, which pushes every singular value into a band around 1
(about [0.7, 1.2]) while keeping the singular vectors: U ~ U_svd V_svd^T.

Distribution (parameter-golf): matrices are dealt round-robin (index % world_size == ddp_rank);
each process orthogonalises only its share into a flat bf16 buffer that is all-reduced (SUM) and
then applied everywhere. Gradients are already averaged by DDP, so every process has the same
momentum buffers; we keep all buffers up to date on every process (an elementwise update, cheap)
so the optimiser state is identical across processes and one copy serves any world size. With
world_size == 1 the same path runs without the all-reduce, so the update is bf16-rounded in both
cases and 1 process equals N processes.

Compiled Newton-Schulz (`use_compiled_ns()`, which the trainer calls on CUDA when its forward is
compiled): the iteration runs through `torch.compile`, as parameter-golf compiles its
`zeropower_via_newtonschulz5` (fewer kernels per matrix: the scale-and-add of each iteration is
fused). A failure to compile at the first use falls back to the eager function for good, and
`ns_compile_error` says why. Off by default: CPU runs keep the eager function's bits.

Matrices stacked by shape (`stack_shapes=True`; the trainer's default on CUDA, `muon_impl`): the
matrices of a group that share a shape and dtype (paper-l9: 54 matrices, 4 shapes) are
orthogonalised as one (k, rows, cols) stack, each with its own norm, as nanochat and
modded-nanogpt batch theirs. The arithmetic per matrix is the same; what changes is the number
of kernels a step launches: 4 Newton-Schulz calls instead of 54 (one step dispatches 194 ops
instead of 2,490, eager), where each matrix's kernels are small for a GPU and the host's
launches likely set the pace. On the CPU
the stacked and the per-matrix results are bit-equal (tests/test_optim_muon.py); on a GPU a
batched matmul may pick another kernel, so the bits may differ there. The momentum buffers and
the final update go through torch's multi-tensor (`_foreach_`) ops in both modes: the same
elementwise arithmetic, one launch for many tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from tngram.common import TngramError

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of the quintic iteration (parameter-golf §2.3)
NS_EPS = 1e-7  # added to the Frobenius norm before normalising
MUON_IMPLS = ("auto", "loop", "stacked")  # TNGRAM_MUON_IMPL (muon_impl)


def forced_muon_impl() -> str:
    """TNGRAM_MUON_IMPL, validated ("auto" when unset)."""
    forced = os.environ.get("TNGRAM_MUON_IMPL", "auto")
    if forced not in MUON_IMPLS:
        raise TngramError(f"TNGRAM_MUON_IMPL must be one of {MUON_IMPLS}, got {forced!r}")
    return forced


def muon_impl(device: torch.device | str) -> str:
    """ "stacked" or "loop": how Muon orthogonalises on `device` (module docstring). "auto" (the
    default): stacked on CUDA, where it saves launches, the per-matrix loop elsewhere (the CPU
    keeps its step as it was); TNGRAM_MUON_IMPL=loop|stacked forces one."""
    forced = forced_muon_impl()
    if forced != "auto":
        return forced
    return "stacked" if torch.device(device).type == "cuda" else "loop"


def zeropower_newton_schulz(G: Tensor, steps: int = 5, eps: float = NS_EPS) -> Tensor:
    """Approximately orthogonalise a matrix: bf16 result with G's shape and singular vectors.

    Pure function; `steps` quintic Newton-Schulz iterations with NS_COEFFS (module docstring).
    G (rows, cols), or a stack (k, rows, cols) of same-shape matrices, each normalised by its
    own Frobenius norm and orthogonalised on its own (batched matmuls).
    """
    if G.dim() not in (2, 3):
        raise ValueError(
            f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(G.shape)}"
        )
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    if G.dim() == 2:
        X = X / (X.norm() + eps)
    else:  # (k, 1, 1): one norm per matrix
        X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    transposed = G.size(-2) > G.size(-1)
    if transposed:  # work on the short side: the Gram matrix is min(rows, cols)^2
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """sqrt(max(1, rows / cols)) of a matrix's (rows, cols) or a stack's (k, rows, cols): only
    tall matrices (e.g. the MLP's fc) are scaled up."""
    rows, cols = shape[-2], shape[-1]
    return max(1.0, rows / cols) ** 0.5


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (see module docstring). Param-group keys: lr, momentum, nesterov,
    ns_steps. Optimiser state per parameter: `momentum_buffer` (same dtype as the gradient).

    ddp_rank / world_size select which matrices this process orthogonalises; the all-reduce
    uses the default process group and is skipped when world_size == 1. stack_shapes: the
    matrices of a shape are orthogonalised as one stack (module docstring; muon_impl).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 0.04,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ddp_rank: int = 0,
        world_size: int = 1,
        stack_shapes: bool = False,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if not 0 <= ddp_rank < world_size:
            raise ValueError(f"ddp_rank {ddp_rank} not in [0, world_size={world_size})")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon only takes 2-D parameters, got shape {tuple(p.shape)}")
        self.ddp_rank, self.world_size = ddp_rank, world_size
        self.stack_shapes = stack_shapes
        self._ns: Callable[..., Tensor] = zeropower_newton_schulz
        self._ns_checked = True  # False until a step with the compiled NS has finished
        self.ns_compile_error: str | None = None

    def use_compiled_ns(self) -> None:
        """Run Newton-Schulz through torch.compile from the next step on (module docstring)."""
        self._ns, self._ns_checked = torch.compile(zeropower_newton_schulz), False

    def _newton_schulz(self, u: Tensor, steps: int) -> Tensor:
        if self._ns_checked:
            return self._ns(u, steps=steps)
        try:  # the first step compiles every matrix shape
            return self._ns(u, steps=steps)
        except Exception as exc:  # noqa: BLE001  (dynamo / inductor / backend errors vary)
            lines = str(exc).strip().splitlines()
            self.ns_compile_error = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            self._ns = zeropower_newton_schulz
            return self._ns(u, steps=steps)

    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's overloads: one signature does the same
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            if _sharded(params[0]):  # FSDP2 (tngram.train.fsdp): gather, orthogonalise, keep
                self._step_sharded(group)  # the shard
                continue
            updates = self._orthogonalised(self._nesterov(group), params, group["ns_steps"])
            self._apply(params, updates, group["lr"])
        self._ns_checked = True
        return loss

    def _nesterov(self, group: dict) -> list[tuple[int, Tensor]]:
        """Momentum buffers of every parameter with a gradient updated (b <- mu b + G); returns
        (index in the group, G + mu b) of this process's share (b itself without Nesterov)."""
        mu = group["momentum"]
        live = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
        if not live:
            return []
        grads = [p.grad for _, p in live]
        bufs = []
        for _, p in live:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs.append(state["momentum_buffer"])
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        share = [k for k, (i, _) in enumerate(live) if i % self.world_size == self.ddp_rank]
        if not share:
            return []
        us: list[Tensor] = [bufs[k] for k in share]
        if group["nesterov"]:
            us = list(torch._foreach_add([grads[k] for k in share], us, alpha=mu))
        return [(live[k][0], u) for k, u in zip(share, us)]

    def _orthogonalised(
        self, share: list[tuple[int, Tensor]], params: list[Tensor], steps: int
    ) -> dict[int, Tensor]:
        """index -> NS(u) * muon_scale in the parameter's dtype (bf16-rounded values), one
        matrix at a time or one stack per (shape, dtype)."""
        batches: dict[object, list[tuple[int, Tensor]]] = {}
        for k, (i, u) in enumerate(share):
            key = (tuple(u.shape), params[i].dtype) if self.stack_shapes else k
            batches.setdefault(key, []).append((i, u))
        out: dict[int, Tensor] = {}
        for batch in batches.values():
            stack = batch[0][1] if len(batch) == 1 else torch.stack([u for _, u in batch])
            x = self._newton_schulz(stack, steps)
            x = (x * muon_scale(x.shape)).to(params[batch[0][0]].dtype)
            out.update(zip([i for i, _ in batch], [x] if len(batch) == 1 else x.unbind(0)))
        return out

    def _apply(self, params: list[Tensor], updates: dict[int, Tensor], lr: float) -> None:
        """W <- W - lr U. Several processes: the shares are summed first through one flat bf16
        buffer (exact: each entry is one process's bf16 value, the others' zeros)."""
        if self.world_size > 1:
            flat = torch.zeros(
                sum(p.numel() for p in params), dtype=torch.bfloat16, device=params[0].device
            )
            parts = flat.split([p.numel() for p in params])
            for i, u in updates.items():
                parts[i].copy_(u.reshape(-1))
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            updates = {
                i: part.view_as(p).to(p.dtype) for i, (part, p) in enumerate(zip(parts, params))
            }
        if updates:
            torch._foreach_add_([params[i] for i in updates], list(updates.values()), alpha=-lr)

    def _step_sharded(self, group: dict) -> None:
        """One group of DTensor (FSDP2-sharded) matrices: the momentum buffer stays the local
        shard; the Nesterov update is all-gathered (full_tensor), orthogonalised on every process
        (the same bf16 result everywhere) and only the local shard is applied. Same numbers as
        the unsharded step given the same gradients (FSDP's are bitwise those of 1 process)."""
        from torch.distributed.tensor import distribute_tensor

        lr, mu = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            full = zeropower_newton_schulz(u.full_tensor(), steps=group["ns_steps"])
            full = (full * muon_scale(full.shape)).to(dtype=p.dtype)
            p.add_(
                distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None), alpha=-lr
            )


def _sharded(p: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)
