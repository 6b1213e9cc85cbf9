/* Fused TN-gram lookup (paper Eqs. 10-11) for CPU, fp32: one pass per token, everything in L1.
 *
 * Same math as the torch path in tngram_lookup.py (see its docstring for the derivation); this
 * file only removes what torch ops cannot: ~20 separate passes over each chunk, ~700 op
 * dispatches per call and the (c, N, R) gather/scatter buffers. Built and loaded by
 * tngram_c.py with the system C compiler and OpenMP (the process's libgomp, the one torch
 * loaded, so both share one thread pool); `nthreads` is the caller's torch.get_num_threads().
 *
 * Threads and determinism: the forward splits tokens between threads (each output row has one
 * writer). The backward goes through the tokens in steps of a few per thread: in a step the
 * threads split the tokens, and each computes its tokens' whole-row terms (dots, dW terms, row
 * gradients) into a step buffer; after one barrier each thread adds every token of the step, in
 * token order, into the gradient elements it owns: the table-gradient rows with id % threads ==
 * its number (whole rows) and its columns of dW (blocks of 16 floats, 64-byte lines). A token's
 * rows are read once, by one thread, whole; only its terms move between threads. Every gradient
 * element therefore receives its terms in the same order whatever the thread count, each
 * computed by the same statements: results are bit-identical for 1, 2 or 64 threads (no atomics,
 * no per-thread partial sums). ds is summed by one thread in token order.
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

#define COL_ALIGN 16       /* dW column blocks start on 64-byte lines (no false sharing) */
#define STEP_BYTES (256 * 1024) /* one thread's token terms in a backward step (in its L2) */

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

static inline void add_into(float *restrict d, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) d[i] += x[i];
}

/* one token's backward, rows R apart: its dots into dot (N-1) when need_dot (with the norm
 * dot_j = r_j sum_R g P_{j+2} W_j, the RMSNorm backward's and ds's term; without it
 * sum_R g b_j, ds's term), its dW terms D_j P_{j+2} into dp (N-1, R) when dp (with dW_now: each
 * added to dW_now as it is made, in row 0 of dp), its row gradients into GR (N, R) (row k of GR
 * belongs to table row id[k]) when GR. scratch: (2N - 1) R floats. */
static void token_grads(const float *g_m, const float *table, const int64_t *id, const float *W,
                        const float *s, const float *rstd_m, int need_dot, int64_t N, int64_t R,
                        float *dot, float *dp, float *dW_now, float *GR, float *scratch) {
    float *P = scratch;                    /* (N-1, R): P[j] = P_{j+2} */
    float *D = P + (N - 1) * R;            /* (N-1, R): gradient w.r.t. P_{j+2} */
    float *G = D + (N - 1) * R;            /* (R) */
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
    for (int64_t j = 0; j < N - 1 && need_dot; j++) {
        const float *restrict g = g_m + j * R;
        const float *restrict Pj = P + j * R;
        const float *restrict Wj = W + j * R;
        float gb = 0.0f;                       /* sum_R g b */
#pragma omp simd reduction(+:gb)
        for (int64_t i = 0; i < R; i++) gb += g[i] * Pj[i] * Wj[i];
        dot[j] = rstd_m ? gb * rstd_m[j] : gb;
    }
    if (!dp && !GR) return;
    /* per order: RMSNorm + scale backward -> db, then the dW term and D = db W */
    for (int64_t j = 0; j < N - 1; j++) {
        const float *restrict g = g_m + j * R;
        const float *restrict Pj = P + j * R;
        const float *restrict Wj = W + j * R;
        float *restrict Dj = D + j * R;
        float sj = s ? s[j] : 1.0f;
        if (rstd_m) {
            float r = rstd_m[j], gdot = dot[j];
            /* db = r s g - (r s gdot / R) y = r s g - (r^2 s gdot / R) b */
            float a = r * sj, c = r * r * sj * gdot / (float)R;
#pragma omp simd
            for (int64_t i = 0; i < R; i++) Dj[i] = a * g[i] - c * Pj[i] * Wj[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < R; i++) Dj[i] = sj * g[i];
        }
        if (dp) {     /* the term is rounded to fp32 before it is added */
            float *restrict d = dW_now ? dp : dp + j * R;
#pragma omp simd
            for (int64_t i = 0; i < R; i++) d[i] = Dj[i] * Pj[i];
            if (dW_now) add_into(dW_now + j * R, d, R);
        }
#pragma omp simd
        for (int64_t i = 0; i < R; i++) Dj[i] *= Wj[i];
    }
    if (!GR) return;
    /* reverse sweep over P_m = P_{m-1} rows_{m-1}: G = dL/dP_m */
    memcpy(G, D + (N - 2) * R, (size_t)R * sizeof(float));
    for (int64_t m = N; m > 2; m--) {
        const float *restrict rk = table + id[m - 1] * R;
        const float *Pprev = P + (m - 3) * R;  /* P_{m-1} */
        const float *Dprev = D + (m - 3) * R;  /* direct gradient of P_{m-1} */
        float *restrict gk = GR + (m - 1) * R;
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

/* adds one token's terms (tok: GR (N, R), dp (N-1, R), dot (N-1), see token_grads) into the
 * gradients this thread owns: the dtable rows with row % nt == t, the dW columns [c0, c1), ds
 * on thread 0 */
static void add_token(const float *tok, const int64_t *id, int64_t N, int64_t R, int nt, int t,
                      int64_t c0, int64_t c1, float *dtable, float *dW, float *ds) {
    const float *dp = tok + N * R, *dot = dp + (N - 1) * R;
    for (int64_t k = N - 1; k >= 0 && dtable; k--)
        if (id[k] % nt == t) add_into(dtable + id[k] * R, tok + k * R, R);
    for (int64_t j = 0; j < N - 1 && dW; j++) add_into(dW + j * R + c0, dp + j * R + c0, c1 - c0);
    for (int64_t j = 0; j < N - 1 && ds && t == 0; j++) ds[j] += dot[j];
}

/* backward; any of dtable (N*V, R), dW (N-1, R), ds (N-1) may be NULL (not needed); the
 * non-NULL ones are accumulated into (the caller zeroes them). Tokens go in steps of S; in a
 * step the threads split the tokens and write each token's terms (token_grads) to a buffer,
 * then, after one barrier, each adds every token's terms, in token order, to the gradient
 * elements it owns (add_token): a dtable row to one thread, whole, and the dW columns in blocks
 * of 16 floats (64-byte lines). A step's buffer is kept until the next step's barrier, so one
 * barrier per step suffices; with one thread each token's terms are added as they come. */
void tn_lookup_backward(const void *grad, const float *table, const int64_t *idx,
                        const float *W, const float *s, const float *rstd,
                        int64_t M, int64_t N, int64_t R,
                        float *dtable, float *dW, float *ds, int nthreads, int grad_bf16) {
    if (M <= 0) return;
    int need_dot = rstd != NULL || ds != NULL, par = nthreads > 1 && M >= 32;
    int64_t per = (2 * N - 1) * R + N;     /* floats per token: GR, dp, dot */
    int64_t S = STEP_BYTES / (per * (int64_t)sizeof(float));
    S = (S < 1 ? 1 : S > 64 ? 64 : S) * (par ? nthreads : 1);
    float *buf = malloc((size_t)(2 * S * per) * sizeof(float));
#pragma omp parallel num_threads(nthreads) if (par)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t blocks = (R + COL_ALIGN - 1) / COL_ALIGN;
        int64_t c0 = (blocks * t / nt) * COL_ALIGN, c1 = (blocks * (t + 1) / nt) * COL_ALIGN;
        if (c0 > R) c0 = R;
        if (c1 > R) c1 = R;
        float *scratch = malloc((size_t)((2 * N - 1) * R) * sizeof(float));
        float *gwide = grad_bf16 ? malloc((size_t)((N - 1) * R) * sizeof(float)) : NULL;
        for (int64_t s0 = 0; s0 < M; s0 += S) {
            int64_t len = M - s0 < S ? M - s0 : S;
            float *step = buf + ((s0 / S) & 1) * S * per;
            for (int64_t m = s0 + len * t / nt; m < s0 + len * (t + 1) / nt; m++) {
                const float *g_m = (const float *)grad + m * (N - 1) * R;
                if (grad_bf16) {     /* widen the token's bf16 gradient rows (exact) */
                    const uint16_t *gb = (const uint16_t *)grad + m * (N - 1) * R;
#pragma omp simd
                    for (int64_t i = 0; i < (N - 1) * R; i++) gwide[i] = bf16_to_f32(gb[i]);
                    g_m = gwide;
                }
                float *tok = step + (nt == 1 ? 0 : (m - s0) * per);   /* one thread: one slot */
                token_grads(g_m, table, idx + m * N, W, s, rstd ? rstd + m * (N - 1) : NULL,
                            need_dot, N, R, tok + (2 * N - 1) * R, dW ? tok + N * R : NULL,
                            nt == 1 ? dW : NULL, dtable ? tok : NULL, scratch);
                if (nt == 1) add_token(tok, idx + m * N, N, R, 1, 0, 0, R, dtable, NULL, ds);
            }
            if (nt > 1) {
#pragma omp barrier
                for (int64_t m = s0; m < s0 + len; m++)
                    add_token(step + (m - s0) * per, idx + m * N, N, R, nt, t, c0, c1, dtable, dW,
                              ds);
            }
        }
        free(scratch);
        free(gwide);
    }
    free(buf);
}
