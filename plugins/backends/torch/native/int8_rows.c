/* int8 weights with one scale per output row times 16-bit activations, AVX-512 (VNNI where the CPU
 * has it): the Int8Weight layout (codes int8 [N][K], scales bf16 [N]).
 *
 * torch's `_weight_int8pack_mm` takes well over the time of reading the weights at one row
 * (measured: BENCHMARKS.md, Measurements behind code decisions). Here each activation row is
 * quantized to int16 with one scale, as in int4_blocks.c, and a row's products are summed exactly
 * in int32 lanes (flushed to float every FLUSH columns, far below overflow), so every output
 * element is computed by the same operations whatever the number of rows. Requires K % 32 == 0
 * and N % 16 == 0.
 */
#include <stdlib.h>

#include "simd.h"
#include "rms_norm.c" /* rms_norm: int8_rows_normed norms its rows first with the same code */

/* Columns summed in int32 lanes before converting: each lane then holds FLUSH / 16 products of
 * at most 127 * 32767, below 2^31. */
#define FLUSH 2048

static void quantize_row(const void *x, int bf16, int64_t row, int64_t K, int16_t *codes, float *scale)
{
    const int64_t base = row * K;
    float inverse;
    *scale = int16_scale(x, bf16, base, K, &inverse);
    const __m512 inv = _mm512_set1_ps(inverse);
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(codes + k), codes16(x, bf16, base + k, inv));
}

/* 16 output rows (a group) times up to ROW_TILE activation rows; `prefetch`: the group's first pass,
 * which asks for its weights ahead (PREFETCH_AHEAD). */
INLINE void group(const int8_t *codes, const uint16_t *scales, int64_t K, const int16_t *xq, const float *xs, int rows,
                  int prefetch, float *y, int64_t ldy)
{
    __m512 acc[ROW_TILE][16];
    for (int n = 0; n < 16; n++) {
        const int8_t *w = codes + n * K;
        __m512 sums[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++)
            sums[t] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += FLUSH) {
            const int64_t k1 = K - k0 < FLUSH ? K : k0 + FLUSH;
            __m512i dots[ROW_TILE];
            for (int t = 0; t < ROW_TILE; t++)
                dots[t] = _mm512_setzero_si512();
            for (int64_t k = k0; k < k1; k += 32) {
                if (prefetch && (k & 63) == 0)
                    _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD, _MM_HINT_T0);
                __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k)));
                for (int t = 0; t < rows; t++)
                    dots[t] = DOT16(dots[t], w16, _mm512_loadu_si512(xq + t * K + k));
            }
            for (int t = 0; t < rows; t++)
                sums[t] = _mm512_add_ps(sums[t], _mm512_cvtepi32_ps(dots[t]));
        }
        for (int t = 0; t < rows; t++)
            acc[t][n] = sums[t];
    }
    const __m512 ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)scales)), 16));
    for (int t = 0; t < rows; t++)
        _mm512_storeu_ps(y + t * ldy, _mm512_mul_ps(_mm512_mul_ps(sum16(acc[t]), _mm512_set1_ps(xs[t])), ws));
}

/* y[M][N] (float) = x[M][K] (float, or bf16 when x_bf16) times (codes * scales)^T. */
void int8_rows_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scales,
                      int64_t N, float *y, int threads)
{
    if (M <= 0)
        return;
    int16_t *xq = aligned_alloc(64, (size_t)(M * K * sizeof(int16_t) + 63) / 64 * 64);
    float *xs = malloc((size_t)M * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= PARALLEL_QUANTIZE_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, x_bf16, m, K, xq + m * K, xs + m);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            const int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            const int8_t *c = codes + 16 * g * K;
            const int16_t *q = xq + m * K;
            float *out = y + m * N + 16 * g;
#define GROUP(R) group(c, scales + 16 * g, K, q, xs + m, R, m == 0, out, N)
            FOR_ROW_COUNT(rows, GROUP);
#undef GROUP
        }
    }
    free(xq);
    free(xs);
}

/* Prompt rows for torch._int_mm (int8 x int8, exact): each row in two levels, x ~ s1 q1 + s2 q2,
 * the second rounding what the first left (error ~1/32000 of the row's largest value). codes:
 * int8 [2M][K] (all first levels, then all second levels); scales: float [2][M]. */
void int8_two_levels(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *codes, float *scales, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int64_t base = m * K;
        const float top = absmax(x, x_bf16, base, K);
        const float s1 = top / 127.0f, inv1 = top > 0.0f ? 127.0f / top : 0.0f;
        __m512 rest_top = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) { /* the first level's leftovers, for the second's scale */
            __mmask16 lanes = lanes_left(K - k);
            __m512 v = load16(x, x_bf16, base + k, lanes);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv1)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            rest_top = _mm512_max_ps(rest_top, _mm512_abs_ps(_mm512_fnmadd_ps(q, _mm512_set1_ps(s1), v)));
        }
        const float top2 = _mm512_reduce_max_ps(rest_top);
        const float s2 = top2 / 127.0f, inv2 = top2 > 0.0f ? 127.0f / top2 : 0.0f;
        for (int64_t k = 0; k < K; k += 16) {
            __mmask16 lanes = lanes_left(K - k);
            __m512 v = load16(x, x_bf16, base + k, lanes);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv1)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_fnmadd_ps(q, _mm512_set1_ps(s1), v), _mm512_set1_ps(inv2)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_mask_storeu_epi8(codes + base + k, lanes, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
            _mm_mask_storeu_epi8(codes + M * K + base + k, lanes, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
        }
        scales[m] = s1;
        scales[M + m] = s2;
    }
}

/* y[M][N] = (s1 * first[m] + s2 * second[m]) * weight scale, from _int_mm's int32 [2M][N]. */
void int8_two_level_out(const int32_t *products, const float *scales, const uint16_t *weight_scales, int64_t M, int64_t N,
                        float *y, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const __m512 s1 = _mm512_set1_ps(scales[m]), s2 = _mm512_set1_ps(scales[M + m]);
        for (int64_t n = 0; n < N; n += 16) {
            __mmask16 lanes = lanes_left(N - n);
            __m512 a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, products + m * N + n));
            __m512 b = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, products + (M + m) * N + n));
            __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, weight_scales + n)), 16));
            _mm512_mask_storeu_ps(y + m * N + n, lanes, _mm512_mul_ps(_mm512_fmadd_ps(b, s2, _mm512_mul_ps(a, s1)), w));
        }
    }
}

/* int8_rows_matmul of rms_norm(x) * w (rms_norm.c): one call where a norm feeds a linear, the same
 * bits as the two calls (the normed rows go through the same functions in the same order). */
int int8_rows_normed(const void *x, int x_bf16, int64_t M, int64_t K, const float *w, float eps, const int8_t *codes,
                     const uint16_t *scales, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *normed = malloc((size_t)(M * K) * sizeof(float));
    if (!normed)
        return -1;
    rms_norm(x, x_bf16, M, K, w, eps, normed, threads);
    int8_rows_matmul(normed, 0, M, K, codes, scales, N, y, threads);
    free(normed);
    return 0;
}

/* residual + int8_rows_matmul(x, ...), float32 [M][N], or with `norm`, residual + rms_norm(the product) *
 * norm (rms_norm.c; Gemma's post-norms): a linear whose output joins the residual stream, in one
 * call (join_residual, rms_norm.c). The same bits as the separate calls: each step is the same
 * function. Returns -1 where memory runs out. */
int int8_rows_added(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scales,
                    int64_t N, const float *norm, float eps, const float *residual, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *product = y;
    if (norm && !(product = malloc((size_t)(M * N) * sizeof(float))))
        return -1;
    int8_rows_matmul(x, x_bf16, M, K, codes, scales, N, product, threads);
    join_residual(product, norm, eps, residual, y, M, N, threads);
    if (product != y)
        free(product);
    return 0;
}
