"""Engram hashing: primality, prime allocation, multipliers, XOR hash (DeepSeek's engram_demo_v1.py).

Numbers cited as "§9" are test vectors computed with
sympy/numpy from the reference algorithm. Other checks compare against slow pure-Python
re-derivations written independently of the torch code.
"""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
import torch

from tngram.common import TngramError
from tngram.memory.gating import signed_sqrt_gate
from tngram.memory.hashing import (allocate_primes, hash_multipliers, is_prime, multiplier_bound,
                                   ngram_hash)


# ---------------------------------------------------------------- slow independent references
def trial_division_is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def python_hash(c: list[int], mult: list[int], primes: list[list[int]], pad: int) -> list[list[int]]:
    """Per position t: for each order n and head j, (XOR_k c_{t-k} m_k) mod p_{n,j}, Python ints."""
    out = []
    for t in range(len(c)):
        ctx = [c[t - k] if t - k >= 0 else pad for k in range(len(mult))]
        row = []
        for n, heads in enumerate(primes, start=2):
            mix = functools.reduce(lambda a, b: a ^ b, (ctx[k] * mult[k] for k in range(n)))
            assert 0 <= mix < 2**63  # the reference's no-overflow guarantee (§2.2)
            row += [mix % p for p in heads]
        out.append(row)
    return out


def shifted(c: torch.Tensor, N: int, pad: int) -> torch.Tensor:
    """(B, T) -> (B, T, N), column k = c_{t-k} (pad before the start); written without ngrams.py."""
    B, T = c.shape
    out = torch.full((B, T, N), pad, dtype=torch.int64)
    for k in range(N):
        out[:, k:, k] = c[:, : T - k]
    return out


# ---------------------------------------------------------------- is_prime
def test_is_prime_matches_trial_division_below_20000():
    assert [n for n in range(20000) if is_prime(n)] == \
        [n for n in range(20000) if trial_division_is_prime(n)]


def test_is_prime_hard_cases():
    assert is_prime(2**61 - 1)              # Mersenne prime M61
    assert not is_prime((2**61 - 1) * 3)
    assert not is_prime(561)                # Carmichael number 3*11*17
    assert not is_prime(3215031751)         # = 151*751*28351, strong pseudoprime to bases 2,3,5,7
    assert 3215031751 == 151 * 751 * 28351
    # psi_12: smallest strong pseudoprime to all 12 bases 2..37; only base 41 exposes it
    psi12 = 318665857834031151167461
    assert psi12 == 399165290221 * 798330580441
    assert not is_prime(psi12)
    assert is_prime(16000057)               # first V4.1 prime, §9
    with pytest.raises(TngramError):
        is_prime(10**30 + 1)                # beyond the deterministic range (not a multiple of 2..41)


# ---------------------------------------------------------------- allocate_primes (§2.4, §9)
def test_demo_primes_rows_offsets():
    p = allocate_primes([646400, 646400], 3, 8, [1, 15])
    # §9 "Prime table sizes, demo config"
    assert p[1] == [[646403, 646411, 646421, 646423, 646433, 646453, 646519, 646523],
                    [646537, 646543, 646549, 646571, 646573, 646577, 646609, 646619]]
    assert p[15] == [[646631, 646637, 646643, 646669, 646687, 646721, 646757, 646771],
                     [646781, 646823, 646831, 646837, 646843, 646859, 646873, 646879]]
    assert [sum(h) for h in p[1]] == [5171586, 5172578]      # §9 per-order sums
    assert [sum(h) for h in p[15]] == [5173516, 5174726]
    assert sum(map(sum, p[1])) == 10344164                   # §9 rows per layer
    assert sum(map(sum, p[15])) == 10348242
    flat = [x for h in p[1] for x in h]
    offsets = [sum(flat[:i]) for i in range(len(flat))]
    assert offsets == [0, 646403, 1292814, 1939235, 2585658, 3232091, 3878544, 4525063, 5171586,
                       5818123, 6464666, 7111215, 7757786, 8404359, 9050936, 9697545]  # §9


def test_unequal_budgets_and_global_seen_set():
    # §9 "Prime allocator test vectors": budget [1000, 500], N=3, H=2, layers [0, 1]
    assert allocate_primes([1000, 500], 3, 2, [0, 1]) == {
        0: [[1009, 1013], [503, 509]], 1: [[1019, 1021], [521, 523]]}
    # the seen set is global: reordering layers swaps which layer gets the smaller primes
    assert allocate_primes([1000, 500], 3, 2, [1, 0]) == {
        1: [[1009, 1013], [503, 509]], 0: [[1019, 1021], [521, 523]]}


def test_v41_layout_is_fast():
    import time
    t0 = time.perf_counter()
    p = allocate_primes([16_000_000] * 3, 4, 8, [1, 14])
    assert time.perf_counter() - t0 < 2.0
    assert sum(map(sum, p[1])) == 384006168          # §9 DeepSeek-V4.1 rows per layer
    assert sum(map(sum, p[14])) == 384016682
    assert p[1][0][:3] == [16000057, 16000079, 16000081]     # §9 first primes
    assert p[14][0][:3] == [16000477, 16000487, 16000499]


@pytest.mark.parametrize("budgets,N,H,layers", [([7, 3, 12], 4, 3, [5, 2, 9]), ([2, 2], 3, 4, [0])])
def test_allocate_primes_against_brute_force(budgets, N, H, layers):
    """Rebuild the allocation with trial division and a list of everything already taken."""
    taken: list[int] = []
    want = {}
    for layer in layers:
        want[layer] = []
        for n in range(2, N + 1):
            heads, lo = [], budgets[n - 2]
            for _ in range(H):
                q = next(x for x in range(lo, 10**6) if trial_division_is_prime(x) and x not in taken)
                taken.append(q)
                heads.append(q)
                lo = q + 1
            want[layer].append(heads)
    assert allocate_primes(budgets, N, H, layers) == want


def test_allocate_primes_errors():
    with pytest.raises(TngramError, match="max_ngram"):
        allocate_primes([10], 1, 2, [0])
    with pytest.raises(TngramError, match="one table budget per order"):
        allocate_primes([10, 10], 4, 2, [0])
    with pytest.raises(TngramError, match="distinct"):
        allocate_primes([10, 10], 3, 2, [1, 1])


# ---------------------------------------------------------------- multipliers (§2.3, §9)
def test_multiplier_bounds():
    # §9 "Multiplier bound": B(V') = floor(floor((2^63-1)/V')/2)
    assert multiplier_bound(99_092) == 46_539_438_283_891
    assert multiplier_bound(129_280) == 35_672_076_256_399
    assert multiplier_bound(1_000) == 4_611_686_018_427_387
    assert multiplier_bound(2**63 - 1) == 1        # max(1, 0)


@pytest.mark.parametrize("V,layer,want", [
    # §9 "Multiplier ... values", seed 0
    (99_092, 1, [76632096046245, 4839876093313, 35959672319349]),
    (99_092, 15, [28919099099511, 56020370062535, 53929037264533]),
    (129_280, 1, [58737837727525, 3709723095905, 27562777300965]),
    (129_280, 15, [22166238923025, 42939128327945, 41336139856257]),
    (1_000, 0, [5874934615388535, 2488343231644625, 377914054924497]),
    (1_000, 1, [7593627661414631, 479593001838623, 3563315849468963]),
])
def test_multiplier_values(V, layer, want):
    m = hash_multipliers(V, 3, layer, seed=0)
    assert m.dtype == np.int64 and m.tolist() == want
    assert all(x % 2 == 1 and x * (V - 1) < 2**63 for x in m.tolist())  # odd, no overflow


def test_multipliers_depend_on_seed_and_layer_as_documented():
    # seed s at layer l uses stream s + 10007*l, so (seed 10007, layer 0) == (seed 0, layer 1)
    assert hash_multipliers(1000, 3, 0, seed=10007).tolist() == hash_multipliers(1000, 3, 1).tolist()
    assert hash_multipliers(1000, 3, 0, seed=1).tolist() != hash_multipliers(1000, 3, 0).tolist()


# ---------------------------------------------------------------- ngram_hash (§2.2, §9)
def test_tiny_end_to_end_vector():
    # §9 tiny case: V'=1000, seed 0, layer 0, N=3, H=2, budget [1000, 500], pad 0
    primes = allocate_primes([1000, 500], 3, 2, [0, 1])[0]
    flat = torch.tensor([p for h in primes for p in h])
    mult = torch.from_numpy(hash_multipliers(1000, 3, 0))
    c = torch.tensor([[5, 7, 9, 7]])
    z = ngram_hash(shifted(c, 3, 0), mult, flat, 2)
    assert z.tolist() == [[[915, 68, 428, 430], [690, 892, 290, 330], [10, 369, 341, 134],
                           [69, 283, 209, 383]]]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), flat.cumsum(0)[:-1]])
    assert offsets.tolist() == [0, 1009, 2022, 2525] and int(flat.sum()) == 3034   # §9
    assert (z + offsets).tolist() == [[[915, 1077, 2450, 2955], [690, 1901, 2312, 2855],
                                       [10, 1378, 2363, 2659], [69, 1292, 2231, 2908]]]  # §9


def test_demo_size_vector():
    # §9 demo-size case: V'=99,092, seed 0, layer 1, demo primes, pad 2, c = [10, 20, 30, 20, 10]
    primes = allocate_primes([646400, 646400], 3, 8, [1, 15])[1]
    flat = torch.tensor([p for h in primes for p in h])
    m = hash_multipliers(99_092, 3, 1).tolist()
    c = [10, 20, 30, 20, 10]
    ctx = [[c[t - k] if t >= k else 2 for k in range(3)] for t in range(5)]
    mix2 = [(a * m[0]) ^ (b * m[1]) for a, b, _ in ctx]
    mix3 = [x ^ (cc * m[2]) for x, (_, _, cc) in zip(mix2, ctx)]
    assert mix2 == [756716305192304, 1510637569068014, 2378159563633986, 1677717935774202,
                    810333313052774]
    assert mix3 == [828291832106906, 1438726824464644, 2592516598707152, 2106640127874270,
                    340681195152336]
    z = ngram_hash(shifted(torch.tensor([c]), 3, 2), torch.tensor(m), flat, 8)[0]
    assert z[0, :8].tolist() == [472003, 417235, 28334, 123300, 169017, 54085, 384429, 68972]
    assert z[0, 8:].tolist() == [243852, 270327, 439470, 340552, 603003, 528884, 278505, 22005]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), flat.cumsum(0)[:-1]])
    assert (z[4] + offsets).tolist() == [330716, 1212696, 1371429, 2354709, 2978868, 3451387,
                                         4444559, 4714576, 5498746, 6147065, 6854070, 7577782,
                                         8329265, 8558645, 9392706, 9955187]


@pytest.mark.parametrize("V,N,H,pad", [(50_000, 5, 3, 7), (3, 2, 1, 0), (129_280, 4, 8, 2)])
def test_ngram_hash_matches_python_reference(V, N, H, pad):
    rng = random.Random(V + N)
    primes = allocate_primes([rng.randrange(2, 5000) for _ in range(N - 1)], N, H, [0, 3])[3]
    mult = hash_multipliers(V, N, 3, seed=11).tolist()
    seqs = [[rng.randrange(V) for _ in range(13)] for _ in range(3)]
    seqs[0][-3:] = [V - 1] * 3                       # largest products, near 2^63
    flat = torch.tensor([p for h in primes for p in h])
    z = ngram_hash(shifted(torch.tensor(seqs), N, pad), torch.tensor(mult), flat, H)
    assert z.dtype == torch.int64 and z.shape == (3, 13, (N - 1) * H)
    assert z.tolist() == [python_hash(s, mult, primes, pad) for s in seqs]


def test_ngram_hash_shape_errors():
    ng = torch.zeros(1, 2, 3, dtype=torch.int64)
    with pytest.raises(TngramError):
        ngram_hash(ng, torch.ones(2, dtype=torch.int64), torch.ones(4, dtype=torch.int64), 2)
    with pytest.raises(TngramError):
        ngram_hash(ng, torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), 2)


# ---------------------------------------------------------------- gate sanity (§3, §9)
def test_signed_sqrt_gate_sanity_values():
    s = torch.tensor([0.0, 1.0, -4.0, 1e-8], dtype=torch.float64)
    g = signed_sqrt_gate(s)
    # §9: s=0 -> 0.5 (sign(0)=0); s=1 -> sigma(1); s=-4 -> sigma(-2); s=1e-8 -> sigma(sqrt(1e-6))
    want = [0.5, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(2)), 1 / (1 + math.exp(-1e-3))]
    assert g.tolist() == pytest.approx(want, abs=1e-12)
    assert g.tolist() == pytest.approx([0.5, 0.731059, 0.119203, 0.500250], abs=1e-6)  # §9 printed
