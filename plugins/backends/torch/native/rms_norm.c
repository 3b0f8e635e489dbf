/* RMS norm of float32 or bf16 rows, AVX-512: one call instead of torch's six kernels (pow, mean,
 * add, rsqrt and two products), whose dispatch costs far more than the arithmetic of a decode
 * step's row (measured: BENCHMARKS.md, Measurements behind code decisions).
 * y = x * (1 / sqrt(mean(x^2) + eps)) * w, float32 out, each row computed alone. */
#include "simd.h"

/* Rows from which the work is split across threads. */
#define PARALLEL_ROWS 16

static void norm_row(const void *x, int bf16, int64_t row, int64_t dim, const float *w, float eps, float *y)
{
    const int64_t base = row * dim;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = load16(x, bf16, base + i, lanes_left(dim - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 mask = lanes_left(dim - i);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(load16(x, bf16, base + i, mask), r), _mm512_maskz_loadu_ps(mask, w + i));
        _mm512_mask_storeu_ps(y + base + i, mask, v);
    }
}

void rms_norm(const void *x, int x_bf16, int64_t rows, int64_t dim, const float *w, float eps, float *y, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x, x_bf16, r, dim, w, eps, y);
}

/* y = residual + product, or with `norm`, residual + rms_norm(product) * norm: a linear's output
 * joining the residual stream (int4_blocks_added, int8_rows_added). Each sum is the one torch's add
 * computes (one rounded float addition). product may be y when there is no norm. */
__attribute__((unused)) static void join_residual(const float *product, const float *norm, float eps, const float *residual, float *y, int64_t M,
                          int64_t N, int threads)
{
    if (norm)
        rms_norm(product, 0, M, N, norm, eps, y, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * N >= 65536)
    for (int64_t i = 0; i < M * N; i++)
        y[i] = residual[i] + y[i];
}
