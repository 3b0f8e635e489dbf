/* 4-bit weights in blocks of 32 times 16-bit activations, AVX-512 (VNNI where the CPU has it).
 *
 * torch's CPU int4 kernel dequantizes every weight to fp32 for each group of 4 activation rows,
 * so it is compute-bound even at one row and 8 rows cost several times one row
 * (measured: BENCHMARKS.md, Measurements behind code decisions).
 * Here weights stay integers: each activation row is quantized to int16 with one scale (error at
 * most 1/65534 of the row's largest value, finer than bf16 for all but tiny entries), and 32
 * products at a time are exact integer multiply-adds (vpdpwssd). A weight row is loaded and
 * unpacked once for up to 4 activation rows, and every output element is computed by the same
 * sequence of operations whatever the number of rows: results never depend on the batch.
 *
 * Weights: w[n][k] = scale[n][b] * q + min[n][b], b = k / 32, q in 0..15 (Q4_0, Q4_1, Q4_K map
 * onto it exactly). Codes [N][K / 2] in chunks of 4 blocks (128 weights, 64 bytes; a last chunk of 2
 * blocks where K % 128 == 64, 32 bytes): the chunk's first half holds elements 0-7 of each of its
 * blocks in turn in the low nibbles and elements 16-23 in the high ones, its second half elements 8-15
 * and 24-31 (layouts.Int4Blocks.pack; the AVX2 kernels read ggml's order instead). Unpacked, each
 * half gives two vectors of 32 int16 whose int32 lanes 4j..4j+3 all belong to block j, so that one
 * conversion and one multiply by the blocks' scales serve 128 products, with no shuffle (10-12%
 * faster than 2 blocks a vector: BENCHMARKS.md, "On the Zen 4 machine"). Scales: [N][K / 32]. Mins:
 * [N / 16][K / 32][16], each group of 16 rows transposed so one vector load serves the group. Both
 * float16 where they are exact in it (Q4_0, Q4_1: a sixth fewer bytes to read), else float32.
 * Requires K % 64 == 0 and N % 16 == 0.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "rms_norm.c" /* rms_norm: int4_blocks_normed norms its rows first with the same code */


/* One activation row -> int16 codes laid out like the unpacked weights (per chunk of B blocks, 4 or
 * a tail's 2: elements 0-7 of each of its blocks, then 8-15, 16-23 and 24-31 of each; K codes in
 * all), the row's scale, and each block's sum of the unquantized values (for the mins). */
static void quantize_row(const void *x, int bf16, int64_t row, int64_t K, int16_t *codes, float *scale, float *sums)
{
    const int64_t base = row * K;
    float inverse;
    *scale = int16_scale(x, bf16, base, K, &inverse);
    const __m512 inv = _mm512_set1_ps(inverse);
    for (int64_t b = 0; b < K / 32; b++) {
        const int64_t at = base + 32 * b;
        sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(load16_all(x, bf16, at), load16_all(x, bf16, at + 16)));
        const __m256i first = codes16(x, bf16, at, inv), last = codes16(x, bf16, at + 16, inv);
        const int64_t part = K - 128 * (b / 4) >= 128 ? 32 : 16; /* 8 elements of each of the chunk's blocks */
        int16_t *c = codes + 128 * (b / 4) + 8 * (b % 4);
        _mm_storeu_si128((__m128i *)c, _mm256_castsi256_si128(first));
        _mm_storeu_si128((__m128i *)(c + part), _mm256_extracti128_si256(first, 1));
        _mm_storeu_si128((__m128i *)(c + 2 * part), _mm256_castsi256_si128(last));
        _mm_storeu_si128((__m128i *)(c + 3 * part), _mm256_extracti128_si256(last, 1));
    }
}

/* Block b's and b+1's scales, as floats in lanes 0 and 1. */
INLINE __m128 scale_pair(const void *scales, int half, int64_t b)
{
    if (half)
        return _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)((const uint16_t *)scales + b)));
    return _mm_castpd_ps(_mm_load_sd((const double *)((const float *)scales + b)));
}

INLINE __m512 min16(const void *mins, int half, int64_t i)
{
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)mins + i)));
    return _mm512_loadu_ps((const float *)mins + i);
}

/* Row t's 16 outputs: sum16(acc[t]) times the row's scale, plus the mins times the row's block sums. */
INLINE void store_rows(__m512 acc[][16], const void *mins, int half, int64_t blocks, const float *xs, const float *xsums,
                       int rows, float *y, int64_t ldy)
{
    for (int t = 0; t < rows; t++) {
        /* mins are stored [blocks][16] per group: one vector per block */
        __m512 m = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++)
            m = _mm512_fmadd_ps(min16(mins, half, 16 * b), _mm512_set1_ps(xsums[t * blocks + b]), m);
        const __m512 sums = sum16(acc[t]);
        _mm512_storeu_ps(y + t * ldy, _mm512_fmadd_ps(sums, _mm512_set1_ps(xs[t]), m));
    }
}

/* Blocks b .. b + count - 1's scales (count 2 or 4) as floats in lanes 0..count - 1, the rest 0. */
INLINE __m128 scale_quad(const void *scales, int half, int64_t b, int count)
{
    if (count == 2)
        return scale_pair(scales, half, b);
    if (half)
        return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)scales + b)));
    return _mm_loadu_ps((const float *)scales + b);
}

/* One 4-block chunk p of a weight row times up to ROW_TILE activation rows, into their accumulators. */
INLINE void chunk_step(const uint8_t *wc, const void *scales, int half, int64_t p, const int16_t *xq, int64_t stride,
                       int rows, __m512 *a)
{
    const __m512i low = _mm512_set1_epi16(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i first = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wc + 64 * p)));
    const __m512i second = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wc + 64 * p + 32)));
    /* elements 0-7, 8-15, 16-23 and 24-31 of each block: lanes 4j..4j+3 hold block 4p+j's sums */
    const __m512i w0 = _mm512_and_si512(first, low), w1 = _mm512_and_si512(second, low);
    const __m512i w2 = _mm512_srli_epi16(first, 4), w3 = _mm512_srli_epi16(second, 4);
    const __m512 sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale_quad(scales, half, 4 * p, 4)));
    for (int t = 0; t < rows; t++) {
        const int16_t *q = xq + t * stride + 128 * p;
        __m512i s = DOT16(_mm512_setzero_si512(), w0, _mm512_loadu_si512(q));
        s = DOT16(s, w1, _mm512_loadu_si512(q + 32));
        s = DOT16(s, w2, _mm512_loadu_si512(q + 64));
        s = DOT16(s, w3, _mm512_loadu_si512(q + 96));
        a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, a[t]);
    }
}

/* The 2-block tail chunk p (32 bytes: its halves of 16): one vector of low and one of high nibbles,
 * lanes 0-3 and 8-11 block 4p's, lanes 4-7 and 12-15 block 4p+1's. */
INLINE void tail_step(const uint8_t *wc, const void *scales, int half, int64_t p, const int16_t *xq, int64_t stride,
                      int rows, __m512 *a)
{
    const __m512i low = _mm512_set1_epi16(0x0F);
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wc + 64 * p)));
    const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_srli_epi16(w, 4);
    const __m512 sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale_pair(scales, half, 4 * p)));
    for (int t = 0; t < rows; t++) {
        const int16_t *q = xq + t * stride + 128 * p;
        __m512i s = DOT16(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
        s = DOT16(s, hi, _mm512_loadu_si512(q + 32));
        a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, a[t]);
    }
}

/* 16 output rows (a group) times up to ROW_TILE activation rows. Scales and mins are float16
 * when `half` (a constant in each inlined copy), else float32. `prefetch`: the group's first pass,
 * which asks for its codes ahead (PREFETCH_AHEAD). */
INLINE void group(const uint8_t *codes, const void *scales, const void *mins, int half, int64_t K, const int16_t *xq,
                  int64_t stride, const float *xs, const float *xsums, int rows, int prefetch, float *y, int64_t ldy)
{
    const int64_t blocks = K / 32;
    const size_t width = half ? 2 : 4;
    __m512 acc[ROW_TILE][16];
    for (int n = 0; n < 16; n++) {
        const uint8_t *wc = codes + n * (K / 2);
        const void *ws = (const char *)scales + n * blocks * width;
        __m512 a[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++)
            a[t] = _mm512_setzero_ps();
        int64_t p = 0;
        for (; p < K / 128; p++) {
            if (prefetch)
                _mm_prefetch((const char *)(wc + 64 * p) + PREFETCH_AHEAD, _MM_HINT_T0);
            chunk_step(wc, ws, half, p, xq, stride, rows, a);
        }
        if (K % 128)
            tail_step(wc, ws, half, p, xq, stride, rows, a);
        for (int t = 0; t < rows; t++)
            acc[t][n] = a[t];
    }
    store_rows(acc, mins, half, blocks, xs, xsums, rows, y, ldy);
}

/* y[M][N] (float) = x[M][K] (float, or bf16 when x_bf16) times the weights' transpose; scales and
 * mins float16 when `half`, else float32. N % 16 == 0; mins laid out [N / 16][K / 32][16]. (The
 * vocabulary projection's coarse ranking is int4_columns.c's.) */
void int4_blocks_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                        const void *mins, int half, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return;
    const size_t width = half ? 2 : 4;
    int16_t *xq = aligned_alloc(64, (size_t)(M * K * 2 + 63) / 64 * 64);
    float *xs = malloc((size_t)M * sizeof(float));
    float *xsums = malloc((size_t)(M * (K / 32)) * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= PARALLEL_QUANTIZE_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, x_bf16, m, K, xq + m * K, xs + m, xsums + m * (K / 32));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        const uint8_t *c = codes + 16 * g * (K / 2);
        const char *s = (const char *)scales + 16 * g * (K / 32) * width, *mn = (const char *)mins + 16 * g * (K / 32) * width;
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            const int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            const int16_t *q = xq + m * K;
            const float *qs = xs + m, *qsums = xsums + m * (K / 32);
            float *out = y + m * N + 16 * g;
            /* one copy of the loop per scale width too */
#define GROUP(R)                                                                                                      \
    do {                                                                                                              \
        if (half)                                                                                                     \
            group(c, s, mn, 1, K, q, K, qs, qsums, R, m == 0, out, N);                                                \
        else                                                                                                          \
            group(c, s, mn, 0, K, q, K, qs, qsums, R, m == 0, out, N);                                                \
    } while (0)
            FOR_ROW_COUNT(rows, GROUP);
#undef GROUP
        }
    }
    free(xq);
    free(xs);
    free(xsums);
}

/* int4_blocks_matmul of rms_norm(x) * w (rms_norm.c): one call where a norm feeds a linear, the same
 * bits as the two calls (the normed rows go through the same functions in the same order). */
int int4_blocks_normed(const void *x, int x_bf16, int64_t M, int64_t K, const float *w, float eps, const uint8_t *codes,
                       const void *scales, const void *mins, int half, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *normed = malloc((size_t)(M * K) * sizeof(float));
    if (!normed)
        return -1;
    rms_norm(x, x_bf16, M, K, w, eps, normed, threads);
    int4_blocks_matmul(normed, 0, M, K, codes, scales, mins, half, N, y, threads);
    free(normed);
    return 0;
}

/* residual + int4_blocks_matmul(x, ...), float32 [M][N], or with `norm`, residual + rms_norm(the product) *
 * norm (rms_norm.c; Gemma's post-norms): a linear whose output joins the residual stream, in one
 * call (join_residual, rms_norm.c). The same bits as the separate calls: each step is the same
 * function. Returns -1 where memory runs out. */
int int4_blocks_added(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                      const void *mins, int half, int64_t N, const float *norm, float eps, const float *residual, float *y,
                      int threads)
{
    if (M <= 0)
        return 0;
    float *product = y;
    if (norm && !(product = malloc((size_t)(M * N) * sizeof(float))))
        return -1;
    int4_blocks_matmul(x, x_bf16, M, K, codes, scales, mins, half, N, product, threads);
    join_residual(product, norm, eps, residual, y, M, N, threads);
    if (product != y)
        free(product);
    return 0;
}
