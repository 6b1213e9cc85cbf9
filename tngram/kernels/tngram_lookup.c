/* Fused TN-gram lookup (paper Eqs. 10-11) for CPU, fp32: one pass per token, everything in L1.
 *
 * Same math as the torch path in tngram_lookup.py (see its docstring for the derivation); this
 * file only removes what torch ops cannot: ~20 separate passes over each chunk, ~700 op
 * dispatches per call and the (c, N, R) gather/scatter buffers. Built and loaded by
 * tngram_c.py with the system C compiler; single-threaded (the caller decides threading).
 *
 * Layouts (row-major, contiguous):
 *   table (N*V, R)    factors A_N..A_1 viewed as rows; idx (M, N) row ids, column k = x_{t-k}
 *   W     (N-1, R)    absorption products W_j (all ones without absorption)
 *   s     (N-1)       scales exp(l_j), or NULL (s_j = 1)
 *   out   (M, N-1, R) e_j = s_j r_j b_j,  b_j = P_{j+2} W_j,  P_n = rows_0 * ... * rows_{n-1}
 *   rstd  (M, N-1)    r_j = 1 / sqrt(mean_R b_j^2 + eps), or NULL when use_norm == 0
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* forward; scratch: R floats (the running prefix product) */
void tn_lookup_forward(const float *table, const int64_t *idx, const float *W, const float *s,
                       int64_t M, int64_t N, int64_t R, int use_norm, float eps,
                       float *out, float *rstd, float *scratch) {
    float *restrict P = scratch;
    for (int64_t m = 0; m < M; m++) {
        const int64_t *id = idx + m * N;
        const float *r0 = table + id[0] * R;
        memcpy(P, r0, (size_t)R * sizeof(float));
        for (int64_t j = 0; j < N - 1; j++) {
            const float *restrict rk = table + id[j + 1] * R;
            const float *restrict Wj = W + j * R;
            float *restrict o = out + (m * (N - 1) + j) * R;
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
                rstd[m * (N - 1) + j] = r;
                f *= r;
            }
            if (f != 1.0f) {
#pragma omp simd
                for (int64_t i = 0; i < R; i++) o[i] *= f;
            }
        }
    }
}

/* backward; any of dtable (N*V, R), dW (N-1, R), ds (N-1) may be NULL (not needed); the
 * non-NULL ones are accumulated into (the caller zeroes them).
 * scratch: (N-1)*R floats for P_2..P_N, (N-1)*R for D (the gradient w.r.t. P), R for G. */
void tn_lookup_backward(const float *grad, const float *table, const int64_t *idx,
                        const float *W, const float *s, const float *rstd,
                        int64_t M, int64_t N, int64_t R,
                        float *dtable, float *dW, float *ds, float *scratch) {
    float *P = scratch;                    /* (N-1, R): P[j] = P_{j+2} */
    float *D = scratch + (N - 1) * R;      /* (N-1, R): gradient w.r.t. P_{j+2} */
    float *G = scratch + 2 * (N - 1) * R;  /* (R) */
    for (int64_t m = 0; m < M; m++) {
        const int64_t *id = idx + m * N;
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
        /* per order: RMSNorm + scale backward -> db, then dW and D = db W */
        for (int64_t j = 0; j < N - 1; j++) {
            const float *restrict g = grad + (m * (N - 1) + j) * R;
            const float *restrict Pj = P + j * R;
            const float *restrict Wj = W + j * R;
            float *restrict Dj = D + j * R;
            float sj = s ? s[j] : 1.0f;
            if (rstd) {
                float r = rstd[m * (N - 1) + j];
                float gdot = 0.0f;                 /* sum_R g y, y = r b */
#pragma omp simd reduction(+:gdot)
                for (int64_t i = 0; i < R; i++) gdot += g[i] * Pj[i] * Wj[i];
                gdot *= r;
                if (ds) ds[j] += gdot;
                /* db = r s g - (r s gdot / R) y = r s g - (r^2 s gdot / R) b */
                float a = r * sj, c = r * r * sj * gdot / (float)R;
#pragma omp simd
                for (int64_t i = 0; i < R; i++) Dj[i] = a * g[i] - c * Pj[i] * Wj[i];
            } else {
                if (ds) {
                    float gb = 0.0f;               /* sum_R g b */
#pragma omp simd reduction(+:gb)
                    for (int64_t i = 0; i < R; i++) gb += g[i] * Pj[i] * Wj[i];
                    ds[j] += gb;
                }
#pragma omp simd
                for (int64_t i = 0; i < R; i++) Dj[i] = sj * g[i];
            }
            if (dW) {
                float *restrict dWj = dW + j * R;
#pragma omp simd
                for (int64_t i = 0; i < R; i++) dWj[i] += Dj[i] * Pj[i];
            }
#pragma omp simd
            for (int64_t i = 0; i < R; i++) Dj[i] *= Wj[i];
        }
        if (!dtable) continue;
        /* reverse sweep over P_n = P_{n-1} rows_{n-1}: G = dL/dP_n, accumulated into the rows */
        memcpy(G, D + (N - 2) * R, (size_t)R * sizeof(float));
        for (int64_t n = N; n > 2; n--) {
            const float *restrict rk = table + id[n - 1] * R;
            const float *Pprev = P + (n - 3) * R;  /* P_{n-1} */
            const float *Dprev = D + (n - 3) * R;  /* direct gradient of P_{n-1} */
            float *restrict dk = dtable + id[n - 1] * R;
#pragma omp simd
            for (int64_t i = 0; i < R; i++) {
                float gi = G[i];
                dk[i] += gi * Pprev[i];
                G[i] = Dprev[i] + gi * rk[i];
            }
        }
        float *d0 = dtable + id[0] * R, *d1 = dtable + id[1] * R;
#pragma omp simd
        for (int64_t i = 0; i < R; i++) {
            d1[i] += G[i] * r0[i];
            d0[i] += G[i] * r1[i];
        }
    }
}
