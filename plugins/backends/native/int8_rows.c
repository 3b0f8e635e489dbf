/* int8 weights with one scale per output row times 16-bit activations, AVX-512 (VNNI where the CPU
 * has it): the Int8Weight layout (codes int8 [N][K], scales bf16 [N]).
 *
 * torch's `_weight_int8pack_mm` takes ~2x the time of reading the weights at one row (140 us for
 * gemma3's 2048x640 in a decode step). Here each activation row is quantized to int16 with one
 * scale, as in int4_blocks.c, and a row's products are summed exactly in int32 lanes (flushed to
 * float every FLUSH columns, far below overflow), so every output element is computed by the same
 * operations whatever the number of rows. Requires K % 32 == 0 and N % 16 == 0.
 */
#include <stdlib.h>

#include "simd.h"

#define ROW_TILE 4
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

/* 16 output rows (a group) times up to ROW_TILE activation rows. */
static inline void group(const int8_t *codes, const uint16_t *scales, int64_t K, const int16_t *xq, const float *xs,
                         int rows, float *y, int64_t ldy)
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
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, x_bf16, m, K, xq + m * K, xs + m);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            group(codes + 16 * g * K, scales + 16 * g, K, xq + m * K, xs + m, rows, y + m * N + 16 * g, N);
        }
    }
    free(xq);
    free(xs);
}
