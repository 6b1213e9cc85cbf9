"""Engram's multi-head n-gram hashing: primes, multipliers and the XOR hash (as in DeepSeek's
engram_demo_v1.py).

Everything here is a pure function of its arguments:

* `is_prime` - deterministic Miller-Rabin (fixed witness set, exact for n < 3.3e24).
* `allocate_primes` - per-(layer, order, head) table sizes, §2.4. One global `seen` set is shared
  across layers, orders and heads, so the primes of a later layer depend on every earlier one.
* `hash_multipliers` - per-layer odd int64 multipliers from numpy's PCG64 stream, §2.3. numpy is
  used at construction time only; the bit stream of `default_rng(...).integers` is what the
  reference uses, a torch RNG would give different numbers.
* `ngram_hash` - the hash itself, §2.2, in torch on the input's device:

      mix_n(t) = XOR_{k<n} (c_{t-k} * m_k)        (int64, never overflows, see below)
      z_{n,j}(t) = mix_n(t) mod p_{n,j}           j = 0..H-1

  The last axis is ordered (n=2, heads 0..H-1), (n=3, heads 0..H-1), ...

No overflow: c < V' and m_k <= 2*B - 1 <= floor((2^63-1)/V') with B = floor(floor((2^63-1)/V')/2),
so every product is a non-negative int64 and XOR of non-negative values stays non-negative.

Dimension letters: B batch, T time, N max n-gram order, H heads per order.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tngram.common import TngramError

INT64_MAX = 2**63 - 1
LAYER_SEED_PRIME = 10007  # seed of layer l = seed + 10007 * l (reference §2.3)

# The first 13 primes are a deterministic Miller-Rabin witness set for every n < 3,317,044,064,679,
# 887,385,961,981 (~3.3e24; Sorenson & Webster 2015).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_MR_LIMIT = 3_317_044_064_679_887_385_961_981


def is_prime(n: int) -> bool:
    """Deterministic primality test for 0 <= n < 3.3e24 (Miller-Rabin with the first 13 primes)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_LIMIT:
        raise TngramError(f"is_prime is only deterministic below {_MR_LIMIT}, got {n}")
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def allocate_primes(
    budgets: list[int] | tuple[int, ...],
    max_ngram: int,
    n_head: int,
    layer_ids: list[int] | tuple[int, ...],
) -> dict[int, list[list[int]]]:
    """Per-head prime table sizes, reference §2.4.

    budgets[n-2] is the per-head bucket budget of order n. For each layer (in the given order),
    each order n = 2..N and each head j: p = smallest prime > start that no earlier
    (layer, order, head) has taken; start begins at budget - 1 for every (layer, order) and then
    becomes the last prime handed out. Returns {layer_id: [[p_{n=2,j} for j<H], [p_{n=3,j}], ...]}.
    """
    if max_ngram < 2:
        raise TngramError(f"max_ngram must be >= 2 (orders 2..N), got {max_ngram}")
    if n_head < 1:
        raise TngramError(f"n_head must be >= 1, got {n_head}")
    if len(budgets) != max_ngram - 1:
        raise TngramError(
            f"need one table budget per order 2..{max_ngram} "
            f"({max_ngram - 1} values), got {len(budgets)}"
        )
    if any(int(b) < 1 for b in budgets):
        raise TngramError(f"table budgets must be >= 1, got {list(budgets)}")
    if len(set(layer_ids)) != len(layer_ids):
        raise TngramError(f"layer_ids must be distinct, got {list(layer_ids)}")
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        per_order = []
        for n in range(2, max_ngram + 1):
            start = int(budgets[n - 2]) - 1
            heads = []
            for _ in range(n_head):
                p = start + 1
                while p in seen or not is_prime(p):
                    p += 1
                seen.add(p)
                heads.append(p)
                start = p
            per_order.append(heads)
        out[layer] = per_order
    return out


def multiplier_bound(vocab_size_compressed: int) -> int:
    """B(V') = max(1, floor(floor((2^63-1)/V') / 2)); multipliers are 2*r+1 with r in [0, B)."""
    if vocab_size_compressed < 1:
        raise TngramError(f"compressed vocab size must be >= 1, got {vocab_size_compressed}")
    return max(1, (INT64_MAX // vocab_size_compressed) // 2)


def hash_multipliers(
    vocab_size_compressed: int, max_ngram: int, layer_id: int, seed: int = 0
) -> np.ndarray:
    """Odd int64 multipliers m_0..m_{N-1} of one layer, reference §2.3 -> np.ndarray (N,) int64."""
    bound = multiplier_bound(vocab_size_compressed)
    rng = np.random.default_rng(seed + LAYER_SEED_PRIME * layer_id)
    r = rng.integers(0, bound, size=max_ngram, dtype=np.int64)
    return r * 2 + 1


def ngram_hash(ngrams: Tensor, multipliers: Tensor, primes: Tensor, n_head: int) -> Tensor:
    """Multi-head XOR hash of suffix n-grams, reference §2.2 (torch, on the input's device).

    ngrams: (B, T, N) int64, column k = c_{t-k} (k = 0 is the current token), already compressed
    and padded. multipliers: (N,) int64. primes: ((N-1)*H,) int64, ordered (n=2, j=0..H-1), ...
    Returns (B, T, (N-1)*H) int64 bucket ids z in [0, p).
    """
    N = ngrams.shape[-1]
    if N < 2:
        raise TngramError(f"need at least 2 n-gram columns (orders 2..N), got {N}")
    if multipliers.shape != (N,):
        raise TngramError(f"multipliers must have shape ({N},), got {tuple(multipliers.shape)}")
    if primes.shape != ((N - 1) * n_head,):
        raise TngramError(
            f"primes must have shape ({(N - 1) * n_head},), got {tuple(primes.shape)}"
        )
    ngrams = ngrams.long()
    mult = multipliers.to(device=ngrams.device, dtype=torch.int64)
    prods = ngrams * mult  # (B, T, N) int64, all < 2^63
    mixes = []
    mix = prods[..., 0]  # (B, T)
    for k in range(1, N):
        mix = torch.bitwise_xor(mix, prods[..., k])  # mix_{k+1}: orders are nested
        mixes.append(mix)
    mix_all = torch.stack(mixes, dim=-1)  # (B, T, N-1), order n at index n-2
    mix_all = mix_all.repeat_interleave(n_head, dim=-1)  # (B, T, (N-1)*H)
    return torch.remainder(mix_all, primes.to(device=ngrams.device, dtype=torch.int64))
