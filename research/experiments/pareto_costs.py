"""Cost axes of a map point that do not depend on the machine: table rows read per token, bytes
of table rows read per token, forward FLOPs per token, total parameters (`point_costs`).

Counting conventions (one token, one forward, batch and sequence amortised):
- rows: lookup-table rows gathered (all memory layers); bytes: those rows x their width x 4
  (fp32 tables). Dense parameters read once per batch (the product keys, projections) are not
  counted as rows or bytes.
- FLOPs: 2 per multiply-add of every matrix product (linears, the tied head), attention
  2 x 2 x d x T_ctx per block with T_ctx = (T + 1) / 2, the mean causal context of a
  sequence_len-T window; elementwise work is counted where it is a memory's own arithmetic (the
  product keys' k^2 candidate sums, the gated products, TN-gram's CP products), never for norms,
  softmax or activations.

Per family, per memory layer (d model width, M hc branches, k conv kernel; GatedFusion's K/V
projections, its gate dots and depthwise conv: 2 (M + 1) d_mem d + 2 M d + 2 M d k):
    engram   rows (N-1) H of width E/H                         FLOPs fusion(d_mem = (N-1) E)
    tngram   rows N of width R (A_1..A_N), + H per hashed order    2 N R (CP products and
             of width hash_embed/H                                  absorption) + [2 d_in kv_rank]
                                                                    + fusion(d_mem)
    oe       rows S = k (N-1) slices of width d_s (once: the embedding)   2 S d_s d
    pkm      rows H topk of width d         2 d H Kd + 2 H n Kd + H k^2 + 2 H k d
    stem     rows 1 of width F              4 d F + F
    ple      rows 1 of width P              2 P d [+ 2 d P + P when gated]
"""

from __future__ import annotations

from typing import Any

BYTES_PER_VALUE = 4  # fp32 tables


def fusion_flops(d_mem: int, d: int, hc_mult: int, kernel_size: int) -> int:
    """GatedFusion: K per branch and the shared V (2 (M+1) d_mem d), gate dots, depthwise conv."""
    M = hc_mult
    return 2 * (M + 1) * d_mem * d + 2 * M * d + 2 * M * d * kernel_size


def memory_costs(mem: Any, d: int, vocab_size: int) -> tuple[int, int, int] | None:
    """(rows, bytes, FLOPs) per token of ONE layer of memory `mem` (a MemoryConfig); None for a
    kind this module has no cost model for."""
    kind = mem.kind
    if kind == "engram":
        E = mem.embed_per_ngram(d)
        rows, width = (mem.max_ngram - 1) * mem.n_head_per_ngram, E // mem.n_head_per_ngram
        flops = fusion_flops((mem.max_ngram - 1) * E, d, mem.hc_mult, mem.kernel_size)
        return rows, rows * width * BYTES_PER_VALUE, flops
    if kind in ("tngram", "tngram-variant"):
        from tngram.memory.tngram_variants import TNGramVariantConfig, lookup_width

        N, R = mem.max_ngram, mem.cp_rank
        rows, nbytes = N, N * R * BYTES_PER_VALUE
        if not isinstance(mem, TNGramVariantConfig):  # the paper's: K/V read e_concat
            kv = fusion_flops((N - 1) * R, d, mem.hc_mult, mem.kernel_size)
            return rows, nbytes, 2 * N * R + kv
        d_in = lookup_width(mem)
        if mem.hash_orders:
            h = len(mem.hash_orders) * mem.hash_heads
            rows, nbytes = (
                rows + h,
                nbytes + h * (mem.hash_embed // mem.hash_heads) * BYTES_PER_VALUE,
            )
            d_in += len(mem.hash_orders) * mem.hash_embed
        flops = 2 * N * R
        if mem.kv_rank:
            flops, d_in = flops + 2 * d_in * mem.kv_rank, mem.kv_rank
        return rows, nbytes, flops + fusion_flops(d_in, d, mem.hc_mult, mem.kernel_size)
    if kind == "oe":
        S = mem.n_tables  # n_slices * (N - 1)
        ds = mem.slice_width(d)
        return S, S * ds * BYTES_PER_VALUE, 2 * S * ds * d
    if kind == "pkm":
        H, k, n, Kd = mem.n_heads, mem.topk, mem.n_keys, mem.key_dim
        flops = 2 * d * H * Kd + 2 * H * n * Kd + H * k * k + 2 * H * k * d
        return H * k, H * k * d * BYTES_PER_VALUE, flops
    if kind == "stem":
        F = mem.width(d)
        return 1, F * BYTES_PER_VALUE, 4 * d * F + F
    if kind == "ple":
        P = mem.ple_dim
        return 1, P * BYTES_PER_VALUE, 2 * P * d + ((2 * d * P + P) if mem.gated else 0)
    return None  # a memory registered elsewhere: no cost model here


def backbone_flops(m: Any) -> int:
    """Forward FLOPs per token of the GPT without memory (GPTConfig `m`)."""
    d, L = m.n_embd, m.n_layer
    kv = m.n_kv_head * (d // m.n_head)
    per_block = 2 * (2 * d * d + 2 * d * kv) + 2 * 2 * d * m.mlp_width()  # q, o, k, v; MLP
    per_block += 2 * 2 * d * (m.sequence_len + 1) / 2  # scores and values over T_ctx
    return int(L * per_block + 2 * m.vocab_size * d)  # + the tied head


def point_costs(m: Any) -> dict[str, int | None]:
    """{rows_per_token, bytes_per_token, flops_per_token, total_params} of GPTConfig `m` (the
    first three None for a memory kind with no cost model here)."""
    from tngram.model.gpt import param_counts

    total = param_counts(m)["total_params"]
    costs = (0, 0, 0) if m.memory is None else memory_costs(m.memory, m.n_embd, m.vocab_size)
    if costs is None:
        return {
            "rows_per_token": None,
            "bytes_per_token": None,
            "flops_per_token": None,
            "total_params": total,
        }
    layers = len(m.memory_layers) if m.memory is not None and m.memory.injection == "block" else 1
    rows, nbytes, flops = (layers * c for c in costs)
    return {
        "rows_per_token": rows,
        "bytes_per_token": nbytes,
        "flops_per_token": backbone_flops(m) + flops,
        "total_params": total,
    }
