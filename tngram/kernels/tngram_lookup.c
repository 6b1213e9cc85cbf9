/* Fused TN-gram lookup (paper Eqs. 10-11) for CPU, fp32: one pass per token, everything in L1.
 *
 * Same math as the torch path in tngram_lookup.py (see its docstring for the derivation); this
 * file only removes what torch ops cannot: ~20 separate passes over each chunk, ~700 op
 * dispatches per call and the (c, N, R) gather/scatter buffers. Built and loaded by
 * tngram_c.py with the system C compiler and OpenMP (the process's libgomp, the one torch
 * loaded, so both share one thread pool); `nthreads` is the caller's torch.get_num_threads().
 *
 * Threads and determinism: the forward splits tokens between threads (each output row has one
 * writer). The backward runs in chunks of CHUNK tokens, in two phases per chunk:
 *   1. tokens split between threads: per token the RMSNorm/scale backward, the reverse sweep,
 *      and the token's row gradients GR (c, N, R), dW terms DP (c, N-1, R), ds terms (c, N-1)
 *      written to per-chunk buffers (no shared writes);
 *   2. the R columns split between threads: each thread adds the chunk's GR into its columns
 *      of the table gradient, and DP into its columns of dW, in token order m, then k = N-1..0.
 * Every gradient element therefore receives its terms in the same order whatever the thread
 * count: results are bit-identical for 1, 2 or 64 threads (no atomics, no per-thread partial
 * sums). ds is summed by one thread in token order.
 *
 * Layouts (row-major, contiguous):
 *   table (N*V, R)    factors A_N..A_1 viewed as rows; idx (M, N) row ids, column k = x_{t-k}
 *   W     (N-1, R)    absorption products W_j (all ones without absorption)
 *   s     (N-1)       scales exp(l_j), or NULL (s_j = 1)
 *   out   (M, N-1, R) e_j = s_j r_j b_j,  b_j = P_{j+2} W_j,  P_n = rows_0 * ... * rows_{n-1}
 *   rstd  (M, N-1)    r_j = 1 / sqrt(mean_R b_j^2 + eps), or NULL when use_norm == 0
 *
 * bf16 (uint16_t) output and gradient: under bf16 autocast the first consumer of `out` is the
 * K/V matmul, which casts it to bf16 anyway. With out_bf16 the forward computes each token's
 * row in fp32 exactly as before and rounds it once, as torch's fp32 -> bf16 cast does (round to
 * nearest even, NaN -> 0xFFFF like torch's vectorised cast), so the result is bit-identical to
 * `out.to(torch.bfloat16)` without the fp32 tensor and the extra pass. With grad_bf16 the
 * backward reads a bf16 gradient and widens it to fp32 (exact), as `grad.float()` would.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else                     /* built without OpenMP: one thread */
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

#define CHUNK 128          /* tokens per backward chunk: GR + DP = 128 x 9 x R floats */
#define COL_ALIGN 16       /* column blocks start on 64-byte lines (no false sharing) */

/* fp32 -> bf16 bits, round to nearest even; bit-identical to torch's CPU cast */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0xFFFF;
    u += ((u >> 16) & 1u) + 0x7FFFu;
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* number of ids outside their factor's rows: column k must lie in [(N-1-k) V, (N-k) V) */
int64_t tn_count_bad_ids(const int64_t *idx, int64_t M, int64_t N, int64_t V, int nthreads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(nthreads) reduction(+:bad) schedule(static) if (M * N > 65536)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < N; k++) {
            int64_t lo = (N - 1 - k) * V, v = idx[m * N + k];
            bad += (v < lo) | (v >= lo + V);
        }
    }
    return bad;
}

static void forward_token(const float *table, const int64_t *id, const float *W, const float *s,
                          int64_t N, int64_t R, int use_norm, float eps,
                          float *out_m, float *rstd_m, float *restrict P) {
    const float *r0 = table + id[0] * R;
    memcpy(P, r0, (size_t)R * sizeof(float));
    for (int64_t j = 0; j < N - 1; j++) {
        const float *restrict rk = table + id[j + 1] * R;
        const float *restrict Wj = W + j * R;
        float *restrict o = out_m + j * R;
        float ss = 0.0f;
#pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < R; i++) {
            float p = P[i] * rk[i];
            P[i] = p;
            float b = p * Wj[i];
            o[i] = b;
            ss += b * b;
        }
        float f = s ? s[j] : 1.0f;
        if (use_norm) {
            float r = 1.0f / sqrtf(ss / (float)R + eps);
            rstd_m[j] = r;
            f *= r;
        }
        if (f != 1.0f) {
#pragma omp simd
            for (int64_t i = 0; i < R; i++) o[i] *= f;
        }
    }
}

void tn_lookup_forward(const float *table, const int64_t *idx, const float *W, const float *s,
                       int64_t M, int64_t N, int64_t R, int use_norm, float eps,
                       void *out, float *rstd, int nthreads, int out_bf16) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && M >= 32)
    {
        float *P = malloc((size_t)R * sizeof(float));
        float *row = out_bf16 ? malloc((size_t)((N - 1) * R) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *o = out_bf16 ? row : (float *)out + m * (N - 1) * R;
            forward_token(table, idx + m * N, W, s, N, R, use_norm, eps, o,
                          use_norm ? rstd + m * (N - 1) : NULL, P);
            if (out_bf16) {
                uint16_t *restrict ob = (uint16_t *)out + m * (N - 1) * R;
                for (int64_t i = 0; i < (N - 1) * R; i++) ob[i] = f32_to_bf16(row[i]);
            }
        }
        free(row);
        free(P);
    }
}

/* phase 1 for one token: GR (N, R) row gradients (column k = row id[k]); DP (N-1, R) the dW
 * terms (NULL: not needed); dsv (N-1) the ds terms (NULL: not needed).
 * scratch: (N-1) R for P_2..P_N, (N-1) R for D (the gradient w.r.t. P), R for G. */
static void backward_token(const float *g_m, const float *table, const int64_t *id,
                           const float *W, const float *s, const float *rstd_m,
                           int64_t N, int64_t R, float *GR, float *DP, float *dsv,
                           float *scratch) {
    float *P = scratch;                    /* (N-1, R): P[j] = P_{j+2} */
    float *D = scratch + (N - 1) * R;      /* (N-1, R): gradient w.r.t. P_{j+2} */
    float *G = scratch + 2 * (N - 1) * R;  /* (R) */
    /* prefix products, recomputed from the factors (cheaper than keeping them) */
    const float *r0 = table + id[0] * R, *r1 = table + id[1] * R;
#pragma omp simd
    for (int64_t i = 0; i < R; i++) P[i] = r0[i] * r1[i];
    for (int64_t j = 1; j < N - 1; j++) {
        const float *restrict rk = table + id[j + 1] * R;
        const float *prev = P + (j - 1) * R;
        float *cur = P + j * R;
#pragma omp simd
        for (int64_t i = 0; i < R; i++) cur[i] = prev[i] * rk[i];
    }
    /* per order: RMSNorm + scale backward -> db, then the dW term and D = db W */
    for (int64_t j = 0; j < N - 1; j++) {
        const float *restrict g = g_m + j * R;
        const float *restrict Pj = P + j * R;
        const float *restrict Wj = W + j * R;
        float *restrict Dj = D + j * R;
        float sj = s ? s[j] : 1.0f;
        if (rstd_m) {
            float r = rstd_m[j];
            float gdot = 0.0f;                 /* sum_R g y, y = r b */
#pragma omp simd reduction(+:gdot)
            for (int64_t i = 0; i < R; i++) gdot += g[i] * Pj[i] * Wj[i];
            gdot *= r;
            if (dsv) dsv[j] = gdot;
            /* db = r s g - (r s gdot / R) y = r s g - (r^2 s gdot / R) b */
            float a = r * sj, c = r * r * sj * gdot / (float)R;
#pragma omp simd
            for (int64_t i = 0; i < R; i++) Dj[i] = a * g[i] - c * Pj[i] * Wj[i];
        } else {
            if (dsv) {
                float gb = 0.0f;               /* sum_R g b */
#pragma omp simd reduction(+:gb)
                for (int64_t i = 0; i < R; i++) gb += g[i] * Pj[i] * Wj[i];
                dsv[j] = gb;
            }
#pragma omp simd
            for (int64_t i = 0; i < R; i++) Dj[i] = sj * g[i];
        }
        if (DP) {
            float *restrict dp = DP + j * R;
#pragma omp simd
            for (int64_t i = 0; i < R; i++) dp[i] = Dj[i] * Pj[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < R; i++) Dj[i] *= Wj[i];
    }
    if (!GR) return;
    /* reverse sweep over P_n = P_{n-1} rows_{n-1}: G = dL/dP_n */
    memcpy(G, D + (N - 2) * R, (size_t)R * sizeof(float));
    for (int64_t n = N; n > 2; n--) {
        const float *restrict rk = table + id[n - 1] * R;
        const float *Pprev = P + (n - 3) * R;  /* P_{n-1} */
        const float *Dprev = D + (n - 3) * R;  /* direct gradient of P_{n-1} */
        float *restrict gk = GR + (n - 1) * R;
#pragma omp simd
        for (int64_t i = 0; i < R; i++) {
            float gi = G[i];
            gk[i] = gi * Pprev[i];
            G[i] = Dprev[i] + gi * rk[i];
        }
    }
    float *g1 = GR + R, *g0 = GR;
#pragma omp simd
    for (int64_t i = 0; i < R; i++) {
        g1[i] = G[i] * r0[i];
        g0[i] = G[i] * r1[i];
    }
}

/* backward; any of dtable (N*V, R), dW (N-1, R), ds (N-1) may be NULL (not needed); the
 * non-NULL ones are accumulated into (the caller zeroes them). */
void tn_lookup_backward(const void *grad, const float *table, const int64_t *idx,
                        const float *W, const float *s, const float *rstd,
                        int64_t M, int64_t N, int64_t R,
                        float *dtable, float *dW, float *ds, int nthreads, int grad_bf16) {
    if (M <= 0) return;
    int64_t c_max = M < CHUNK ? M : CHUNK;
    float *GR = dtable ? malloc((size_t)(c_max * N * R) * sizeof(float)) : NULL;
    float *DP = dW ? malloc((size_t)(c_max * (N - 1) * R) * sizeof(float)) : NULL;
    float *DS = ds ? malloc((size_t)(c_max * (N - 1)) * sizeof(float)) : NULL;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && M >= 32)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        /* this thread's columns [c0, c1) of R in phase 2 */
        int64_t blocks = (R + COL_ALIGN - 1) / COL_ALIGN;
        int64_t c0 = (blocks * t / nt) * COL_ALIGN, c1 = (blocks * (t + 1) / nt) * COL_ALIGN;
        if (c0 > R) c0 = R;
        if (c1 > R) c1 = R;
        float *scratch = malloc((size_t)((2 * (N - 1) + 1) * R) * sizeof(float));
        float *gwide = grad_bf16 ? malloc((size_t)((N - 1) * R) * sizeof(float)) : NULL;
        for (int64_t a = 0; a < M; a += CHUNK) {
            int64_t c = (M - a) < CHUNK ? (M - a) : CHUNK;
#pragma omp for schedule(static)
            for (int64_t q = 0; q < c; q++) {
                int64_t m = a + q;
                const float *g_m = (const float *)grad + m * (N - 1) * R;
                if (grad_bf16) {     /* widen the token's bf16 gradient row (exact) */
                    const uint16_t *gb = (const uint16_t *)grad + m * (N - 1) * R;
                    for (int64_t i = 0; i < (N - 1) * R; i++) gwide[i] = bf16_to_f32(gb[i]);
                    g_m = gwide;
                }
                backward_token(g_m, table, idx + m * N, W, s,
                               rstd ? rstd + m * (N - 1) : NULL, N, R,
                               GR ? GR + q * N * R : NULL, DP ? DP + q * (N - 1) * R : NULL,
                               DS ? DS + q * (N - 1) : NULL, scratch);
            }   /* implicit barrier: the chunk's buffers are complete */
            if (c1 > c0) {
                for (int64_t q = 0; q < c; q++) {
                    const int64_t *id = idx + (a + q) * N;
                    if (GR) {
                        for (int64_t k = N - 1; k >= 0; k--) {
                            float *restrict d = dtable + id[k] * R;
                            const float *restrict gr = GR + (q * N + k) * R;
#pragma omp simd
                            for (int64_t i = c0; i < c1; i++) d[i] += gr[i];
                        }
                    }
                    if (DP) {
                        for (int64_t j = 0; j < N - 1; j++) {
                            float *restrict d = dW + j * R;
                            const float *restrict dp = DP + (q * (N - 1) + j) * R;
#pragma omp simd
                            for (int64_t i = c0; i < c1; i++) d[i] += dp[i];
                        }
                    }
                }
            }
            if (DS && t == 0) {
                for (int64_t q = 0; q < c; q++)
                    for (int64_t j = 0; j < N - 1; j++) ds[j] += DS[q * (N - 1) + j];
            }
#pragma omp barrier
        }
        free(scratch);
        free(gwide);
    }
    free(GR);
    free(DP);
    free(DS);
}
