/* Fused TN-gram lookup (paper Eqs. 10-11) for CPU, fp32: one pass per token, everything in L1.
 *
 * Same math as the torch path in tngram_lookup.py (see its docstring for the derivation); this
 * file only removes what torch ops cannot: ~20 separate passes over each chunk, ~700 op
 * dispatches per call and the (c, N, R) gather/scatter buffers. Built and loaded by
 * tngram_c.py with the system C compiler and OpenMP (the process's libgomp, the one torch
 * loaded, so both share one thread pool); `nthreads` is the caller's torch.get_num_threads().
 *
 * Threads and determinism: the forward splits tokens between threads (each output row has one
 * writer). The backward has two passes and one barrier between them:
 *   1. tokens split between threads: per token the full-R dot products (N-1 of them) that the
 *      RMSNorm backward and ds need, into a small (M, N-1) buffer (with one thread, pass 2
 *      computes them from its own prefix products instead, by the same loops);
 *   2. the R columns split between threads (blocks of 16 floats, 64-byte lines, so no false
 *      sharing): each thread takes every token in order and, for its columns only, recomputes
 *      the prefix products, does the norm/scale backward with the token's dots, the reverse
 *      sweep and the dW terms, and adds them straight into its columns of the table gradient
 *      (rows k = N-1..0) and of dW: nothing is handed from one thread to another but the dots.
 * Every gradient element therefore receives its terms in the same order whatever the thread
 * count, each computed by the same statements: results are bit-identical for 1, 2 or 64 threads
 * (no atomics, no per-thread partial sums). ds is summed by one thread in token order.
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

#define COL_ALIGN 16       /* column blocks start on 64-byte lines (no false sharing) */

/* fp32 -> bf16 bits, round to nearest even; bit-identical to torch's CPU cast */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t r = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
    return (uint16_t)(x != x ? 0xFFFFu : r);        /* branch-free, so the loops vectorise */
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
#pragma omp simd
                for (int64_t i = 0; i < (N - 1) * R; i++) ob[i] = f32_to_bf16(row[i]);
            }
        }
        free(row);
        free(P);
    }
}

/* pass 1 for one token: the full-R dot products of its backward, dot (N-1): with the norm
 * dot_j = r_j sum_R g y-term (the RMSNorm backward needs it; it is also the ds term), without it
 * dot_j = sum_R g b_j (the ds term). P: scratch (N-1, R) for P_2..P_N. */
static void token_dots(const float *g_m, const float *table, const int64_t *id, const float *W,
                       const float *rstd_m, int64_t N, int64_t R, float *dot, float *P) {
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
    for (int64_t j = 0; j < N - 1; j++) {
        const float *restrict g = g_m + j * R;
        const float *restrict Pj = P + j * R;
        const float *restrict Wj = W + j * R;
        if (rstd_m) {
            float gdot = 0.0f;                 /* sum_R g y, y = r b */
#pragma omp simd reduction(+:gdot)
            for (int64_t i = 0; i < R; i++) gdot += g[i] * Pj[i] * Wj[i];
            gdot *= rstd_m[j];
            dot[j] = gdot;
        } else {
            float gb = 0.0f;                   /* sum_R g b */
#pragma omp simd reduction(+:gb)
            for (int64_t i = 0; i < R; i++) gb += g[i] * Pj[i] * Wj[i];
            dot[j] = gb;
        }
    }
}

/* pass 2 for one token, columns [0, n) of a column block: every pointer (g_m, table, W,
 * dtable, dW) already points at the block's first column, rows R apart. Computes D (the
 * gradient w.r.t. P), the dW terms and the row gradients of the block and adds them into dW
 * (order j = 0..N-2) and dtable (rows k = N-1..0); dtable and dW may be NULL (not needed).
 * Every element is computed by the same statements as one whole-row token pass, so its bits do
 * not depend on the block. dot: the token's dots from pass 1; or NULL and dot_out non-NULL when
 * one thread has all R columns: the dots are computed here from P and written to dot_out.
 * scratch: 3 N n floats. */
static void token_cols(const float *g_m, const float *table, const int64_t *id, const float *W,
                       const float *s, const float *rstd_m, const float *dot, float *dot_out,
                       int64_t N, int64_t R, int64_t n, float *dtable, float *dW,
                       float *scratch) {
    float *P = scratch;                    /* (N-1, n): P[j] = P_{j+2} */
    float *D = P + (N - 1) * n;            /* (N-1, n): gradient w.r.t. P_{j+2} */
    float *G = D + (N - 1) * n;            /* (n) */
    float *GR = G + n;                     /* (N, n): the row gradients, column k = row id[k] */
    float *dp = GR + N * n;                /* (n): one dW term */
    const float *r0 = table + id[0] * R, *r1 = table + id[1] * R;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) P[i] = r0[i] * r1[i];
    for (int64_t j = 1; j < N - 1; j++) {
        const float *restrict rk = table + id[j + 1] * R;
        const float *prev = P + (j - 1) * n;
        float *cur = P + j * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) cur[i] = prev[i] * rk[i];
    }
    if (dot_out) {    /* one thread holds every column (n == R): the dots from these P, by the
                       * loops of token_dots, instead of a pass of their own */
        for (int64_t j = 0; j < N - 1; j++) {
            const float *restrict g = g_m + j * R;
            const float *restrict Pj = P + j * n;
            const float *restrict Wj = W + j * R;
            if (rstd_m) {
                float gdot = 0.0f;
#pragma omp simd reduction(+:gdot)
                for (int64_t i = 0; i < n; i++) gdot += g[i] * Pj[i] * Wj[i];
                gdot *= rstd_m[j];
                dot_out[j] = gdot;
            } else {
                float gb = 0.0f;
#pragma omp simd reduction(+:gb)
                for (int64_t i = 0; i < n; i++) gb += g[i] * Pj[i] * Wj[i];
                dot_out[j] = gb;
            }
        }
        dot = dot_out;
    }
    /* per order: RMSNorm + scale backward -> db, then the dW term and D = db W */
    for (int64_t j = 0; j < N - 1; j++) {
        const float *restrict g = g_m + j * R;
        const float *restrict Pj = P + j * n;
        const float *restrict Wj = W + j * R;
        float *restrict Dj = D + j * n;
        float sj = s ? s[j] : 1.0f;
        if (rstd_m) {
            float r = rstd_m[j], gdot = dot[j];
            /* db = r s g - (r s gdot / R) y = r s g - (r^2 s gdot / R) b */
            float a = r * sj, c = r * r * sj * gdot / (float)R;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) Dj[i] = a * g[i] - c * Pj[i] * Wj[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) Dj[i] = sj * g[i];
        }
        if (dW) {     /* the term is rounded to fp32 before it is added, as it always was */
#pragma omp simd
            for (int64_t i = 0; i < n; i++) dp[i] = Dj[i] * Pj[i];
            float *restrict d = dW + j * R;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) d[i] += dp[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < n; i++) Dj[i] *= Wj[i];
    }
    if (!dtable) return;
    /* reverse sweep over P_m = P_{m-1} rows_{m-1}: G = dL/dP_m */
    memcpy(G, D + (N - 2) * n, (size_t)n * sizeof(float));
    for (int64_t m = N; m > 2; m--) {
        const float *restrict rk = table + id[m - 1] * R;
        const float *Pprev = P + (m - 3) * n;  /* P_{m-1} */
        const float *Dprev = D + (m - 3) * n;  /* direct gradient of P_{m-1} */
        float *restrict gk = GR + (m - 1) * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float gi = G[i];
            gk[i] = gi * Pprev[i];
            G[i] = Dprev[i] + gi * rk[i];
        }
    }
    float *g1 = GR + n, *g0 = GR;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        g1[i] = G[i] * r0[i];
        g0[i] = G[i] * r1[i];
    }
    for (int64_t k = N - 1; k >= 0; k--) {
        float *restrict d = dtable + id[k] * R;
        const float *restrict gr = GR + k * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] += gr[i];
    }
}

/* backward; any of dtable (N*V, R), dW (N-1, R), ds (N-1) may be NULL (not needed); the
 * non-NULL ones are accumulated into (the caller zeroes them). */
void tn_lookup_backward(const void *grad, const float *table, const int64_t *idx,
                        const float *W, const float *s, const float *rstd,
                        int64_t M, int64_t N, int64_t R,
                        float *dtable, float *dW, float *ds, int nthreads, int grad_bf16) {
    if (M <= 0) return;
    int need_dot = rstd != NULL || ds != NULL;
    float *DOT = need_dot ? malloc((size_t)(M * (N - 1)) * sizeof(float)) : NULL;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && M >= 32)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        /* this thread's columns [c0, c1) of R in pass 2 */
        int64_t blocks = (R + COL_ALIGN - 1) / COL_ALIGN;
        int64_t c0 = (blocks * t / nt) * COL_ALIGN, c1 = (blocks * (t + 1) / nt) * COL_ALIGN;
        if (c0 > R) c0 = R;
        if (c1 > R) c1 = R;
        float *scratch = malloc((size_t)(3 * N * R) * sizeof(float));
        float *gwide = grad_bf16 ? malloc((size_t)((N - 1) * R) * sizeof(float)) : NULL;
        /* one thread with gradients to add: the dots come out of pass 2's own prefix products */
        int fused = nt == 1 && (dtable || dW);
        if (need_dot && !fused) {   /* pass 1: tokens split between threads */
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                const float *g_m = (const float *)grad + m * (N - 1) * R;
                if (grad_bf16) {     /* widen the token's bf16 gradient row (exact) */
                    const uint16_t *gb = (const uint16_t *)grad + m * (N - 1) * R;
#pragma omp simd
                    for (int64_t i = 0; i < (N - 1) * R; i++) gwide[i] = bf16_to_f32(gb[i]);
                    g_m = gwide;
                }
                token_dots(g_m, table, idx + m * N, W, rstd ? rstd + m * (N - 1) : NULL, N, R,
                           DOT + m * (N - 1), scratch);
            }   /* implicit barrier: every dot is complete */
        }
        if (c1 > c0 && (dtable || dW)) {   /* pass 2: columns split, every token in order */
            int64_t n = c1 - c0;
            for (int64_t m = 0; m < M; m++) {
                const float *g_m = (const float *)grad + m * (N - 1) * R;
                if (grad_bf16) {     /* widen this block of the token's gradient rows */
                    const uint16_t *gb = (const uint16_t *)grad + m * (N - 1) * R;
                    for (int64_t j = 0; j < N - 1; j++) {
#pragma omp simd
                        for (int64_t i = c0; i < c1; i++)
                            gwide[j * R + i] = bf16_to_f32(gb[j * R + i]);
                    }
                    g_m = gwide;
                }
                float *dots = need_dot ? DOT + m * (N - 1) : NULL;
                token_cols(g_m + c0, table + c0, idx + m * N, W + c0, s,
                           rstd ? rstd + m * (N - 1) : NULL, fused ? NULL : dots,
                           fused ? dots : NULL, N, R, n, dtable ? dtable + c0 : NULL,
                           dW ? dW + c0 : NULL, scratch);
            }
        }
        if (ds && t == 0) {     /* one thread, token order */
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < N - 1; j++) ds[j] += DOT[m * (N - 1) + j];
        }
        free(scratch);
        free(gwide);
    }
    free(DOT);
}
