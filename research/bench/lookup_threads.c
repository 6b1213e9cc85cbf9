/* The C lookup at 1 and 2 threads, two builds of tngram_lookup.c side by side
 * (research/PERFORMANCE.md, "The C lookup on two threads", has the commands). Link the current
 * kernel and an older one compiled with -Dtn_lookup_backward=old_bwd -Dtn_lookup_forward=old_fwd
 * -Dtn_count_bad_ids=old_cnt.
 *
 *   ./lookup_threads REPS [M R V]   interleaved: per rep, for 1 then 2 threads, the forward, then
 *                                   the old and the new backward, each after a zero fill of the
 *                                   table gradient by that many threads (as torch.zeros does;
 *                                   not timed); medians and minima (ms), and whether the
 *                                   outputs are bit-identical across builds and thread counts
 *   ./lookup_threads one NT [M R V] the new forward and backward once at NT threads (for
 *                                   valgrind --tool=callgrind --separate-threads=yes)
 * Shapes default to `bench threads`: M = 4 x 256 tokens, N = 5, R = 1024, V = 1024; random
 * fp32 factors, ids, absorption and scales, norm on. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tn_lookup_forward(const float *, const int64_t *, const float *, const float *, int64_t,
                       int64_t, int64_t, int, float, void *, float *, int, int);
void tn_lookup_backward(const void *, const float *, const int64_t *, const float *, const float *,
                        const float *, int64_t, int64_t, int64_t, float *, float *, float *, int,
                        int);
void old_bwd(const void *, const float *, const int64_t *, const float *, const float *,
             const float *, int64_t, int64_t, int64_t, float *, float *, float *, int, int);

static uint32_t seed = 1;
static uint32_t next(void) { return seed = seed * 1664525u + 1013904223u; }
static float rnd(void) { return (float)(next() >> 8) / 16777216.0f * 2.0f - 1.0f; }
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static uint32_t hash(const float *x, int64_t n, uint32_t h) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        h = h * 31u + u;
    }
    return h;
}

int main(int argc, char **argv) {
    int one = argc > 1 && strcmp(argv[1], "one") == 0, a = one ? 3 : 2;
    if (argc < 2 || (one && argc < 3)) {
        fprintf(stderr, "usage: %s REPS [M R V] | one NT [M R V]\n", argv[0]);
        return 2;
    }
    int reps = one ? 1 : atoi(argv[1]), nt_one = one ? atoi(argv[2]) : 0;
    int64_t M = argc > a ? atoll(argv[a]) : 1024, R = argc > a + 1 ? atoll(argv[a + 1]) : 1024;
    int64_t V = argc > a + 2 ? atoll(argv[a + 2]) : 1024, N = 5, NVR = N * V * R;
    float *table = malloc(sizeof(float) * NVR), *W = malloc(sizeof(float) * (N - 1) * R), s[4];
    int64_t *idx = malloc(sizeof(int64_t) * M * N);
    float *g = malloc(sizeof(float) * M * (N - 1) * R);
    float *out = malloc(sizeof(float) * M * (N - 1) * R);
    float *rstd = malloc(sizeof(float) * M * (N - 1)), *dt = malloc(sizeof(float) * NVR);
    float *dW = malloc(sizeof(float) * (N - 1) * R), ds[4];
    for (int64_t i = 0; i < NVR; i++) table[i] = rnd();
    for (int64_t i = 0; i < (N - 1) * R; i++) W[i] = 1.0f + 0.1f * rnd();
    for (int j = 0; j < 4; j++) s[j] = 1.0f + 0.1f * (float)j;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < N; k++) idx[m * N + k] = (N - 1 - k) * V + (next() >> 8) % V;
    for (int64_t i = 0; i < M * (N - 1) * R; i++) g[i] = rnd();
    if (one) {
        memset(dt, 0, sizeof(float) * NVR);
        memset(dW, 0, sizeof(float) * (N - 1) * R);
        memset(ds, 0, sizeof ds);
        tn_lookup_forward(table, idx, W, s, M, N, R, 1, 1e-6f, out, rstd, nt_one, 0);
        tn_lookup_backward(g, table, idx, W, s, rstd, M, N, R, dt, dW, ds, nt_one, 0);
        printf("one run at %d threads: hash %08x\n", nt_one,
               hash(dt, NVR, hash(dW, (N - 1) * R, 0)));
        return 0;
    }
    const char *name[2] = {"old", "new"};
    double *tf[3], *tb[2][3];
    uint32_t h[2][3];
    for (int t = 1; t <= 2; t++) {
        tf[t] = malloc(sizeof(double) * reps);
        for (int v = 0; v < 2; v++) tb[v][t] = malloc(sizeof(double) * reps);
    }
    for (int r = -3; r < reps; r++) {        /* 3 warm-up reps */
        for (int nt = 1; nt <= 2; nt++) {
            double t0 = omp_get_wtime();
            tn_lookup_forward(table, idx, W, s, M, N, R, 1, 1e-6f, out, rstd, nt, 0);
            if (r >= 0) tf[nt][r] = omp_get_wtime() - t0;
            for (int v = 0; v < 2; v++) {
#pragma omp parallel for num_threads(nt) schedule(static)
                for (int64_t i = 0; i < NVR; i++) dt[i] = 0.0f;
                memset(dW, 0, sizeof(float) * (N - 1) * R);
                memset(ds, 0, sizeof ds);
                double t1 = omp_get_wtime();
                if (v == 0) old_bwd(g, table, idx, W, s, rstd, M, N, R, dt, dW, ds, nt, 0);
                else tn_lookup_backward(g, table, idx, W, s, rstd, M, N, R, dt, dW, ds, nt, 0);
                if (r >= 0) tb[v][nt][r] = omp_get_wtime() - t1;
                uint32_t ho = hash(out, M * (N - 1) * R, 0);
                h[v][nt] = hash(ds, 4, hash(dt, NVR, hash(dW, (N - 1) * R, ho)));
            }
        }
    }
    printf("C lookup, M %ld tokens, N %ld, R %ld, V %ld; %d interleaved reps after 3 warm-up; "
           "median (min) ms\n", (long)M, (long)N, (long)R, (long)V, reps);
    for (int t = 1; t <= 2; t++) qsort(tf[t], reps, sizeof(double), cmp);
    printf("forward       1 thread %6.2f (%5.2f)  2 threads %6.2f (%5.2f)  "
           "speed-up %.2f (min %.2f)\n",
           tf[1][reps / 2] * 1e3, tf[1][0] * 1e3, tf[2][reps / 2] * 1e3, tf[2][0] * 1e3,
           tf[1][reps / 2] / tf[2][reps / 2], tf[1][0] / tf[2][0]);
    for (int v = 0; v < 2; v++) {
        for (int t = 1; t <= 2; t++) qsort(tb[v][t], reps, sizeof(double), cmp);
        printf("backward %s  1 thread %6.2f (%5.2f)  2 threads %6.2f (%5.2f)  "
               "speed-up %.2f (min %.2f)\n",
               name[v], tb[v][1][reps / 2] * 1e3, tb[v][1][0] * 1e3, tb[v][2][reps / 2] * 1e3,
               tb[v][2][0] * 1e3, tb[v][1][reps / 2] / tb[v][2][reps / 2],
               tb[v][1][0] / tb[v][2][0]);
    }
    int same = h[0][1] == h[0][2] && h[1][1] == h[1][2] && h[0][1] == h[1][1];
    printf("outputs (forward, table gradient, dW, ds) bit-identical across builds and threads: "
           "%s\n",
           same ? "yes" : "NO");
    return !same;
}
