/* Attention of query rows over their sequences' cached keys, each row on its own, AVX-512.
 *
 * torch's CPU SDPA is slow for one query row in a decode step (its flash kernel is built for
 * blocks of queries); this reads each cached row once per kv head. A prompt's rows go through the
 * same code, each reading only the cells up to its last visible one (half of a causal square),
 * faster than SDPA there too (measured: BENCHMARKS.md, Measurements behind code decisions).
 * Each (row, query head) is computed alone, in float32, in a fixed order: a row's result does not
 * depend on the other rows, their lengths or the thread count.
 *
 * Heads h of kv head h / (heads / kv_heads). Dims are multiples of 16.
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
#define VALUE_TILE 4 /* 16-float chunks of a value row accumulated in registers at a time */

#define KEY_TILE 4 /* keys whose products share each load of the query heads' values */

/* scores[g][j] = scale * q_g . key_j for the region's cells, -inf where masked. Each partial[g][j]
 * sums the same products in the same order whatever the tiling: KEY_TILE keys at a time when the
 * group is small enough for their accumulators to stay in registers, one at a time otherwise. */
INLINE void scores_of(const float *q, int group, int64_t key_dim, const void *keys, int bf16, int64_t used,
                      const uint8_t *mask, float scale, float *scores)
{
    __m512 partial[MAX_GROUP][16];
    for (int64_t j0 = 0; j0 < used; j0 += 16) {
        int count = used - j0 < 16 ? (int)(used - j0) : 16;
        int j = 0;
        if (group <= 4) {
            for (; j + KEY_TILE <= count; j += KEY_TILE) {
                __m512 t[4][KEY_TILE];
                for (int g = 0; g < group; g++)
                    for (int i = 0; i < KEY_TILE; i++)
                        t[g][i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < key_dim; c += 16) {
                    __m512 qc[4];
                    for (int g = 0; g < group; g++)
                        qc[g] = _mm512_loadu_ps(q + g * key_dim + c);
                    for (int i = 0; i < KEY_TILE; i++) {
                        __m512 k = load16_all(keys, bf16, (j0 + j + i) * key_dim + c);
                        for (int g = 0; g < group; g++)
                            t[g][i] = _mm512_fmadd_ps(qc[g], k, t[g][i]);
                    }
                }
                for (int g = 0; g < group; g++)
                    for (int i = 0; i < KEY_TILE; i++)
                        partial[g][j + i] = t[g][i];
            }
        }
        for (; j < 16; j++) {
            for (int g = 0; g < group; g++)
                partial[g][j] = _mm512_setzero_ps();
            if (j >= count)
                continue;
            for (int64_t c = 0; c < key_dim; c += 16) {
                __m512 k = load16_all(keys, bf16, (j0 + j) * key_dim + c);
                for (int g = 0; g < group; g++)
                    partial[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * key_dim + c), k, partial[g][j]);
            }
        }
        __mmask16 lanes = (__mmask16)(count == 16 ? 0xFFFF : (1u << count) - 1);
        __mmask16 visible = lanes;
        if (mask) {
            __m128i m = _mm_maskz_loadu_epi8(lanes, mask + j0);
            visible = _mm_test_epi8_mask(m, m);
        }
        for (int g = 0; g < group; g++) {
            __m512 s = _mm512_mul_ps(sum16(partial[g]), _mm512_set1_ps(scale));
            s = _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), s);
            _mm512_mask_storeu_ps(scores + g * used + j0, lanes, s);
        }
    }
}

/* scores -> unnormalized probabilities in place; returns their sum */
static float softmax_numerators(float *scores, int64_t used)
{
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < used; j += 16) {
        __mmask16 lanes = (__mmask16)(used - j >= 16 ? 0xFFFF : (1u << (used - j)) - 1);
        top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, scores + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < used; j += 16) {
        __mmask16 lanes = (__mmask16)(used - j >= 16 ? 0xFFFF : (1u << (used - j)) - 1);
        __m512 s = _mm512_maskz_loadu_ps(lanes, scores + j);
        __mmask16 finite = _mm512_mask_cmp_ps_mask(lanes, s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 p = _mm512_maskz_mov_ps(finite, exp_nonpositive(_mm512_sub_ps(s, m)));
        sum = _mm512_add_ps(sum, p);
        _mm512_mask_storeu_ps(scores + j, lanes, p);
    }
    return _mm512_reduce_add_ps(sum);
}

/* out[g] = sum_j p[g][j] * value_j / total[g] */
INLINE void weighted_values(const float *p, const float *total, int group, int64_t used, const void *values, int bf16,
                            int64_t value_dim, float *out, int64_t out_stride)
{
    for (int64_t c0 = 0; c0 < value_dim; c0 += 16 * VALUE_TILE) {
        int tiles = (value_dim - c0) / 16 < VALUE_TILE ? (int)((value_dim - c0) / 16) : VALUE_TILE;
        __m512 acc[MAX_GROUP][VALUE_TILE];
        for (int g = 0; g < group; g++)
            for (int t = 0; t < VALUE_TILE; t++)
                acc[g][t] = _mm512_setzero_ps();
        for (int64_t j = 0; j < used; j++) {
            for (int t = 0; t < tiles; t++) {
                __m512 v = load16_all(values, bf16, j * value_dim + c0 + 16 * t);
                for (int g = 0; g < group; g++)
                    acc[g][t] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * used + j]), v, acc[g][t]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int t = 0; t < tiles; t++)
                _mm512_storeu_ps(out + g * out_stride + c0 + 16 * t, _mm512_div_ps(acc[g][t], _mm512_set1_ps(total[g])));
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
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 v = _mm512_loadu_ps(src + i);
            if (!bf16) {
                _mm512_storeu_ps((float *)buffer + at + i, v);
                continue;
            }
            __m512i bits = _mm512_castps_si512(v);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i up = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
            up = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)buffer + at + i), _mm512_cvtepi32_epi16(up));
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
