/* The vocabulary projection's candidate ranking at several rows: 4-bit weights laid out by output
 * row, int8 activations with a scale per block of 32, AVX-512 (VNNI where the CPU has it).
 *
 * The coarse mode int4_blocks.c had before (its layout: a weight row's blocks in the lanes of a
 * vector) ended every 128 products of every activation row in a conversion, a multiply and a
 * multiply-add: at 8 rows
 * gemma3's 262144 x 640 projection took 15 of a 34 ms decode step (Intel Xeon, 2 threads; BENCHMARKS.md,
 * "The vocabulary projection at several rows"). Here a vector's 16 int32 lanes are 16 output rows
 * (a group): 4 weights of each, times the same 4 activations broadcast, are one multiply-add, so
 * a block of 32 is 8 of them per activation row and one conversion and two multiply-adds (the
 * block's scales, then its mins) for all 16 outputs. Every output element is computed by the
 * same sequence of operations whatever the number of rows or threads.
 *
 * Weights: w[n][k] = scale[n][b] * q + min[n][b], b = k / 32, q in 0..15. Codes [N / 16][K / 32][4][64]:
 * for group g, block b and quarter h (elements 8h..8h+7 of the block), byte 4i + j holds output
 * row 16g + i's element 8h + j in its low nibble and 8h + 4 + j in its high one (layouts.Int4Columns.pack).
 * Scales and mins [N / 16][K / 32][16], float16 when `half`, else float32. Requires K % 32 == 0 and
 * N % 16 == 0.
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
        __m512 first = load16_all(x, bf16, at), last = load16_all(x, bf16, at + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(last)));
        const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(first, last));
        scales[b] = top / 127.0f;
        _mm_storeu_si128((__m128i *)(codes + 32 * b), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(first, inv))));
        _mm_storeu_si128((__m128i *)(codes + 32 * b + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(last, inv))));
    }
}

/* 4 activation codes as every lane of a vector (the multiply-adds' broadcast operand). */
INLINE __m512i quad(const int8_t *q)
{
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi32(v);
}

INLINE __m512 load_group_values(const void *values, int half, int64_t at)
{
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)values + at)));
    return _mm512_loadu_ps((const float *)values + at);
}

/* One group of 16 output rows times `rows` (<= ROW_TILE) activation rows, into y[t][0..15];
 * `prefetch`: the group's first pass, which asks for its codes ahead. */
INLINE void columns_group(const uint8_t *codes, const void *scales, const void *mins, int half, int64_t blocks,
                          const int8_t *xq, const float *xs, const float *xsums, int rows, int prefetch, float *y,
                          int64_t ldy)
{
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t K = 32 * blocks;
    __m512 acc[ROW_TILE];
    for (int t = 0; t < ROW_TILE; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *w = codes + 256 * b;
        if (prefetch)
            for (int line = 0; line < 256; line += 64)
                _mm_prefetch((const char *)w + line + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512i even[ROW_TILE], odd[ROW_TILE]; /* two chains of multiply-adds a row, summed once */
        for (int t = 0; t < ROW_TILE; t++)
            even[t] = odd[t] = _mm512_setzero_si512();
        for (int h = 0; h < 4; h++) {
            const __m512i v = _mm512_loadu_si512(w + 64 * h);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int t = 0; t < rows; t++) {
                const int8_t *q = xq + t * K + 32 * b + 8 * h;
                even[t] = DOT8(even[t], lo, quad(q));
                odd[t] = DOT8(odd[t], hi, quad(q + 4));
            }
        }
        const __m512 sc = load_group_values(scales, half, 16 * b), mn = load_group_values(mins, half, 16 * b);
        for (int t = 0; t < rows; t++) {
            const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(even[t], odd[t]));
            acc[t] = _mm512_fmadd_ps(d, _mm512_mul_ps(sc, _mm512_set1_ps(xs[t * blocks + b])), acc[t]);
            acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsums[t * blocks + b]), acc[t]);
        }
    }
    for (int t = 0; t < rows; t++)
        _mm512_storeu_ps(y + t * ldy, acc[t]);
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
#define GROUP(R)                                                                                                      \
    do {                                                                                                              \
        if (half)                                                                                                     \
            columns_group(c, s, mn, 1, blocks, q, qs, qsums, R, m == 0, out, N);                                      \
        else                                                                                                          \
            columns_group(c, s, mn, 0, blocks, q, qs, qsums, R, m == 0, out, N);                                      \
    } while (0)
            FOR_ROW_COUNT(rows, GROUP);
#undef GROUP
        }
    }
    free(xq);
    free(xs);
    free(xsums);
    return 0;
}
