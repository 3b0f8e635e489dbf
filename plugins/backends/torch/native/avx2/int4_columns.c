/* The vocabulary projection's candidate ranking at several rows, AVX2 (AVX-VNNI where the CPU has
 * it): native/int4_columns.c's layout and promises, in vectors of 8 output rows. A group's 16 rows
 * are two passes of 8 (the first and second 32 bytes of each 64-byte quarter), so that a row's
 * accumulators and the unpacked codes fit the 16 ymm registers.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* One activation row -> int8 codes with a scale per block of 32 (ggml's Q8_0, in element order),
 * and each block's sum of the unquantized values (for the mins). */
static void quantize_blocks(const void *x, int bf16, int64_t row, int64_t K, int8_t *codes, float *scales, float *sums)
{
    const int64_t base = row * K;
    for (int64_t b = 0; b < K / 32; b++) {
        const int64_t at = base + 32 * b;
        __m256 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = load8_all(x, bf16, at + 8 * i);
        const float top = reduce_max8(_mm256_max_ps(_mm256_max_ps(abs8(v[0]), abs8(v[1])), _mm256_max_ps(abs8(v[2]), abs8(v[3]))));
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        sums[b] = reduce_add8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        scales[b] = top / 127.0f;
        /* |code| <= 127: the saturating packs keep every value; then undo their lane interleave */
        __m256i first = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)), _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv)));
        __m256i last = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)), _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv)));
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(first, last), _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
        _mm256_storeu_si256((__m256i *)(codes + 32 * b), bytes);
    }
}

INLINE __m256i quad(const int8_t *q)
{
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

INLINE __m256 load_half_values(const void *values, int half, int64_t at)
{
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)values + at)));
    return _mm256_loadu_ps((const float *)values + at);
}

/* Output rows 8p..8p+7 of a group times `rows` (<= ROW_TILE) activation rows, into y[t][8p..8p+7]. */
INLINE void columns_half(const uint8_t *codes, const void *scales, const void *mins, int half, int64_t blocks, int p,
                         const int8_t *xq, const float *xs, const float *xsums, int rows, int prefetch, float *y,
                         int64_t ldy)
{
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t K = 32 * blocks;
    __m256 acc[ROW_TILE];
    for (int t = 0; t < ROW_TILE; t++)
        acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *w = codes + 256 * b + 32 * p;
        if (prefetch)
            for (int line = 0; line < 256; line += 64)
                _mm_prefetch((const char *)codes + 256 * b + line + PREFETCH_BYTES, _MM_HINT_T0);
        __m256i dots[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++)
            dots[t] = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int t = 0; t < rows; t++) {
                const int8_t *q = xq + t * K + 32 * b + 8 * h;
                dots[t] = DOT8(DOT8(dots[t], lo, quad(q)), hi, quad(q + 4));
            }
        }
        const __m256 sc = load_half_values(scales, half, 16 * b + 8 * p), mn = load_half_values(mins, half, 16 * b + 8 * p);
        for (int t = 0; t < rows; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]), _mm256_mul_ps(sc, _mm256_set1_ps(xs[t * blocks + b])), acc[t]);
            acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsums[t * blocks + b]), acc[t]);
        }
    }
    for (int t = 0; t < rows; t++)
        _mm256_storeu_ps(y + t * ldy + 8 * p, acc[t]);
}

/* y[M][N] (float) = x[M][K] (float, or bf16 when x_bf16) times the weights' transpose, coarsely:
 * for ranking candidates. Returns nonzero when its buffers cannot be allocated. */
int int4_columns_coarse(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                        const void *mins, int half, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return 0;
    const int64_t blocks = K / 32;
    const size_t width = half ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * blocks) * sizeof(float)), *xsums = malloc((size_t)(M * blocks) * sizeof(float));
    if (!xq || !xs || !xsums) {
        free(xq);
        free(xs);
        free(xsums);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= PARALLEL_QUANTIZE_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_blocks(x, x_bf16, m, K, xq + m * K, xs + m * blocks, xsums + m * blocks);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        const uint8_t *c = codes + g * 16 * (K / 2);
        const char *s = (const char *)scales + g * 16 * blocks * width, *mn = (const char *)mins + g * 16 * blocks * width;
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            const int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            const int8_t *q = xq + m * K;
            const float *qs = xs + m * blocks, *qsums = xsums + m * blocks;
            float *out = y + m * N + 16 * g;
            for (int p = 0; p < 2; p++) {
                const int prefetch = m == 0 && p == 0; /* the group's first pass (AVX2 kernels prefetch at every row count) */
#define GROUP(R)                                                                                                      \
    do {                                                                                                              \
        if (half)                                                                                                     \
            columns_half(c, s, mn, 1, blocks, p, q, qs, qsums, R, prefetch, out, N);                                  \
        else                                                                                                          \
            columns_half(c, s, mn, 0, blocks, p, q, qs, qsums, R, prefetch, out, N);                                  \
    } while (0)
                FOR_ROW_COUNT(rows, GROUP);
#undef GROUP
            }
        }
    }
    free(xq);
    free(xs);
    free(xsums);
    return 0;
}
