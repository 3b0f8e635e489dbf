/* Attention of query rows over their sequences' cached keys, each row on its own, AVX2 + FMA.
 *
 * The AVX-512 kernel's arguments and promises (native/row_attention.c), in 8-float lanes: one
 * query row reads each cached row once per kv head; a prompt row reads only the cells up to its
 * last visible one. Each (row, query head) is computed alone, in float32, in a fixed order: a row's
 * result does not depend on the other rows, their lengths or the thread count.
 *
 * Heads h of kv head h / (heads / kv_heads). Dims are multiples of 16 (as the AVX-512 kernel's).
 */
#include <stdlib.h>

#include "simd.h"

/* One call's arguments (native.py's RowAttentionArgs mirrors it field for field). */
struct row_attention_args {
    const float *q;   /* float32 [rows][heads][key_dim] */
    int64_t rows, heads, kv_heads, key_dim, value_dim;
    void *keys;       /* [kv_heads][cells][key_dim], bf16 or float32 */
    void *values;     /* [kv_heads][cells][value_dim], as keys */
    int64_t cells;
    int bf16;         /* keys and values are bf16 (else float32) */
    const int64_t *starts, *used; /* row s reads cells starts[s] .. starts[s] + used[s] */
    const int64_t *masks;         /* masks[s]: 0, or the address of used[s] bools (visible or not) */
    const int64_t *dest;          /* 0, or the cell of each row's new key and value */
    const float *new_keys, *new_values; /* float [rows][kv_heads][dim], rows key_stride and value_stride floats apart */
    int64_t key_stride, value_stride;
    float scale;
    float *out;       /* float32 [rows][heads][value_dim] */
    int threads;
};

#define MAX_GROUP 16 /* query heads per kv head */
#define VALUE_TILE 4 /* 8-float chunks of a value row accumulated in registers at a time, at most (value_tile) */

/* Lanes i < left all ones, the rest zero (as a float mask for and/blend). */
INLINE __m256 lanes_below(int64_t left)
{
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), index));
}

/* Keys scored two at a time where a group has at most KEY_TILE_GROUP heads: each q chunk is loaded
 * once for both keys, their 2 * group accumulators stay in registers, and every score's sum is the
 * same as one key at a time (measured with value_tile: BENCHMARKS.md, "AVX2 prompt kernels"). */
#define KEY_TILE 2
#define KEY_TILE_GROUP 4

/* scores[g][j] = scale * q_g . key_j for the region's cells, -inf where masked */
INLINE void scores_of(const float *q, int group, int64_t key_dim, const void *keys, int bf16, int64_t used,
                      const uint8_t *mask, float scale, float *scores)
{
    __m256 partial[MAX_GROUP][8];
    for (int64_t j0 = 0; j0 < used; j0 += 8) {
        int count = used - j0 < 8 ? (int)(used - j0) : 8;
        for (int j = 0; j < 8; j++) {
            for (int g = 0; g < group; g++)
                partial[g][j] = _mm256_setzero_ps();
            if (j >= count)
                continue;
            if (group <= KEY_TILE_GROUP && j + KEY_TILE <= count) {
                for (int g = 0; g < group; g++)
                    partial[g][j + 1] = _mm256_setzero_ps();
                for (int64_t c = 0; c < key_dim; c += 8) {
                    const __m256 k0 = load8_all(keys, bf16, (j0 + j) * key_dim + c);
                    const __m256 k1 = load8_all(keys, bf16, (j0 + j + 1) * key_dim + c);
                    for (int g = 0; g < group; g++) {
                        const __m256 qc = _mm256_loadu_ps(q + g * key_dim + c);
                        partial[g][j] = _mm256_fmadd_ps(qc, k0, partial[g][j]);
                        partial[g][j + 1] = _mm256_fmadd_ps(qc, k1, partial[g][j + 1]);
                    }
                }
                j++;
                continue;
            }
            for (int64_t c = 0; c < key_dim; c += 8) {
                __m256 k = load8_all(keys, bf16, (j0 + j) * key_dim + c);
                for (int g = 0; g < group; g++)
                    partial[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * key_dim + c), k, partial[g][j]);
            }
        }
        for (int g = 0; g < group; g++) {
            float s[8];
            _mm256_storeu_ps(s, _mm256_mul_ps(sum8(partial[g]), _mm256_set1_ps(scale)));
            for (int j = 0; j < count; j++)
                scores[g * used + j0 + j] = mask && !mask[j0 + j] ? -INFINITY : s[j];
        }
    }
}

/* scores -> unnormalized probabilities in place; returns their sum */
static float softmax_numerators(float *scores, int64_t used)
{
    __m256 top = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= used; j += 8)
        top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
    float most = reduce_max8(top);
    for (int64_t t = j; t < used; t++)
        most = scores[t] > most ? scores[t] : most;
    const __m256 m = _mm256_set1_ps(most), minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j < used; j += 8) {
        __m256 s = load8(scores, 0, j, used - j);
        __m256 keep = _mm256_and_ps(lanes_below(used - j), _mm256_cmp_ps(s, minus_inf, _CMP_NEQ_OQ));
        __m256 p = _mm256_and_ps(keep, exp_nonpositive(_mm256_sub_ps(s, m)));
        sum = _mm256_add_ps(sum, p);
        store8(scores + j, p, used - j);
    }
    return reduce_add8(sum);
}

/* 8-float chunks of a value row accumulated in registers at a time for a group of `group` heads:
 * group * tiles accumulators, the loaded chunk and a broadcast weight within the 16 ymm registers
 * (with 4 tiles, 4-8 heads' accumulators spilled). The same sums in the same order for any tile. */
INLINE int value_tile(int group)
{
    return group <= 3 ? VALUE_TILE : group <= 6 ? 2 : 1;
}

/* out[g] = sum_j p[g][j] * value_j / total[g] */
INLINE void weighted_values(const float *p, const float *total, int group, int64_t used, const void *values, int bf16,
                            int64_t value_dim, float *out, int64_t out_stride)
{
    const int tile = value_tile(group);
    for (int64_t c0 = 0; c0 < value_dim; c0 += 8 * tile) {
        int tiles = (value_dim - c0) / 8 < tile ? (int)((value_dim - c0) / 8) : tile;
        __m256 acc[MAX_GROUP][VALUE_TILE];
        for (int g = 0; g < group; g++)
            for (int t = 0; t < tile; t++)
                acc[g][t] = _mm256_setzero_ps();
        for (int64_t j = 0; j < used; j++) {
            for (int t = 0; t < tiles; t++) {
                __m256 v = load8_all(values, bf16, j * value_dim + c0 + 8 * t);
                for (int g = 0; g < group; g++)
                    acc[g][t] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * used + j]), v, acc[g][t]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int t = 0; t < tiles; t++)
                _mm256_storeu_ps(out + g * out_stride + c0 + 8 * t, _mm256_div_ps(acc[g][t], _mm256_set1_ps(total[g])));
    }
}

/* One (sequence, kv head): its group of query heads over the region's cells. Inlined for each
 * common group size, so that the per-head accumulators live in registers. */
INLINE void task(const float *qs, int group, int64_t key_dim, int64_t value_dim, const char *k, const char *v, int bf16,
                 int64_t n, const uint8_t *mask, float scale, float *p, float *out)
{
    float total[MAX_GROUP];
    scores_of(qs, group, key_dim, k, bf16, n, mask, scale, p);
    for (int g = 0; g < group; g++)
        total[g] = softmax_numerators(p + g * n, n);
    weighted_values(p, total, group, n, v, bf16, value_dim, out, value_dim);
}

static void task_any(const float *qs, int group, int64_t key_dim, int64_t value_dim, const char *k, const char *v, int bf16,
                     int64_t n, const uint8_t *mask, float scale, float *p, float *out)
{
    switch (group) {
#define GROUP(G) case G: task(qs, G, key_dim, value_dim, k, v, bf16, n, mask, scale, p, out); return;
        GROUP(1) GROUP(2) GROUP(3) GROUP(4) GROUP(5) GROUP(6) GROUP(8)
#undef GROUP
    default:
        task(qs, group, key_dim, value_dim, k, v, bf16, n, mask, scale, p, out);
    }
}

/* row [heads][dim] float -> cells `cell` of buffer [heads][cells][dim], bf16 rounded to nearest even
 * (as torch converts) or float */
static void store_row(const float *row, int64_t heads, int64_t dim, void *buffer, int bf16, int64_t cells, int64_t cell)
{
    for (int64_t h = 0; h < heads; h++) {
        const float *src = row + h * dim;
        const int64_t at = (h * cells + cell) * dim;
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            if (!bf16) {
                _mm256_storeu_ps((float *)buffer + at + i, v);
                continue;
            }
            __m256i bits = _mm256_castps_si256(v);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
            __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
            __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
            up = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(up), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
            /* 32 -> 16 bits (every value fits): packus interleaves 128-bit halves, put them back in order */
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(up, up), 0xD8);
            _mm_storeu_si128((__m128i *)((uint16_t *)buffer + at + i), _mm256_castsi256_si128(packed));
        }
    }
}

/* Returns 0, or -1 when a group of heads is larger than MAX_GROUP or memory runs out. When `dest`
 * is given, each row's new key and value are first stored in its cell dest[s]. Fewer (sequence,
 * kv head) pairs than threads are split by query heads, so that every thread has work: each head's
 * arithmetic is the same either way. */
int row_attention(const struct row_attention_args *args)
{
    const float *q = args->q, *new_keys = args->new_keys, *new_values = args->new_values;
    const int64_t S = args->rows, heads = args->heads, kv_heads = args->kv_heads, key_dim = args->key_dim;
    const int64_t value_dim = args->value_dim, cells = args->cells, key_stride = args->key_stride;
    const int64_t value_stride = args->value_stride;
    const int64_t *starts = args->starts, *used = args->used, *masks = args->masks, *dest = args->dest;
    void *keys = args->keys, *values = args->values;
    const int bf16 = args->bf16, threads = args->threads;
    const float scale = args->scale;
    float *out = args->out;
    for (int64_t s = 0; dest && s < S; s++) {
        store_row(new_keys + s * key_stride, kv_heads, key_dim, keys, bf16, cells, dest[s]);
        store_row(new_values + s * value_stride, kv_heads, value_dim, values, bf16, cells, dest[s]);
    }
    const int group = (int)(heads / kv_heads);
    if (group > MAX_GROUP)
        return -1;
    int64_t parts = 1; /* tasks per (sequence, kv head): the fewest that give every thread one */
    while (S * kv_heads * parts < threads && parts < group) {
        do
            parts++;
        while (group % parts);
    }
    const int part = group / (int)parts; /* query heads per task */
    int failed = 0;
    const size_t elem = bf16 ? 2 : 4;
    /* tasks dealt round-robin: a prompt's later rows read more cells than its first ones */
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)
    for (int64_t task = 0; task < S * kv_heads * parts; task++) {
        const int64_t s = task / (kv_heads * parts), kvh = task / parts % kv_heads, head = kvh * group + task % parts * part;
        const int64_t n = used[s];
        float *p = malloc((size_t)(part * n) * sizeof(float));
        if (!p) {
            failed = 1;
            continue;
        }
        const char *k = (const char *)keys + ((kvh * cells + starts[s]) * key_dim) * elem;
        const char *v = (const char *)values + ((kvh * cells + starts[s]) * value_dim) * elem;
        task_any(q + (s * heads + head) * key_dim, part, key_dim, value_dim, k, v, bf16, n, (const uint8_t *)(intptr_t)masks[s],
                 scale, p, out + (s * heads + head) * value_dim);
        free(p);
    }
    return failed ? -1 : 0;
}
