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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of the quintic iteration (parameter-golf §2.3)
NS_EPS = 1e-7  # added to the Frobenius norm before normalising


def zeropower_newton_schulz(G: Tensor, steps: int = 5, eps: float = NS_EPS) -> Tensor:
    """Approximately orthogonalise a 2-D matrix: bf16 result with G's shape and singular vectors.

    Pure function; `steps` quintic Newton-Schulz iterations with NS_COEFFS (module docstring).
    """
    if G.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    X = X / (X.norm() + eps)
    transposed = G.size(0) > G.size(1)
    if transposed:  # work on the short side: the Gram matrix is min(rows, cols)^2
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if transposed else X


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """sqrt(max(1, rows / cols)): only tall matrices (e.g. the MLP's fc) are scaled up."""
    rows, cols = shape[0], shape[1]
    return max(1.0, rows / cols) ** 0.5


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (see module docstring). Param-group keys: lr, momentum, nesterov,
    ns_steps. Optimiser state per parameter: `momentum_buffer` (same dtype as the gradient).

    ddp_rank / world_size select which matrices this process orthogonalises; the all-reduce
    uses the default process group and is skipped when world_size == 1.
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
            lr, mu = group["lr"], group["momentum"]
            if _sharded(
                params[0]
            ):  # FSDP2 (tngram.train.fsdp): gather, orthogonalise, keep the shard
                self._step_sharded(group)
                continue
            total = sum(p.numel() for p in params)
            updates = torch.zeros(total, dtype=torch.bfloat16, device=params[0].device)
            offset = 0
            for i, p in enumerate(params):
                n = p.numel()
                if p.grad is not None:
                    g = p.grad
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(g)
                    buf = state["momentum_buffer"]
                    buf.mul_(mu).add_(g)
                    if i % self.world_size == self.ddp_rank:
                        u = g.add(buf, alpha=mu) if group["nesterov"] else buf
                        u = self._newton_schulz(u, group["ns_steps"])
                        u = u * muon_scale(u.shape)
                        updates[offset : offset + n] = u.reshape(-1)
                offset += n
            if self.world_size > 1:
                dist.all_reduce(updates, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                u = updates[offset : offset + n].view_as(p).to(dtype=p.dtype)
                p.add_(u, alpha=-lr)
                offset += n
        self._ns_checked = True
        return loss

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
