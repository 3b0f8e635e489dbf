/* The k largest values of each row of a float32 matrix, in one pass over the row.
 *
 * Plain C for every variant. corral.topk's two torch stages (block maxima, a topk over them, a gather
 * and a second topk) read a 262144-entry row of logits twice and run six kernels; here a row is read
 * once, 64 values at a time: a block none of whose values beats the current k-th is skipped (the
 * compiler vectorizes the comparisons), and the few values that do go into a heap of k. For a row of
 * random order, about k ln(n / k) values ever enter the heap (BENCHMARKS.md, "The vocabulary
 * projection at several rows").
 *
 * The result depends on the row alone: the k largest values, largest first, and of equal values the
 * lower index first (torch.topk leaves that order open). NaN ranks as -inf.
 */
#include <stdint.h>
#include <stdlib.h>

#define SCAN 64 /* values checked against the k-th at once */

/* Entry a ranks below entry b: a smaller value, or the same value at a later index. */
static inline int below(float va, int64_t ia, float vb, int64_t ib)
{
    return va < vb || (va == vb && ia > ib);
}

/* Restore the heap (its lowest-ranked entry at the root) below position i. */
static void sift_down(float *v, int64_t *ix, int64_t k, int64_t i)
{
    for (;;) {
        int64_t low = i, left = 2 * i + 1, right = left + 1;
        if (left < k && below(v[left], ix[left], v[low], ix[low]))
            low = left;
        if (right < k && below(v[right], ix[right], v[low], ix[low]))
            low = right;
        if (low == i)
            return;
        float tv = v[i];
        int64_t ti = ix[i];
        v[i] = v[low], ix[i] = ix[low];
        v[low] = tv, ix[low] = ti;
        i = low;
    }
}

static void row_topk(const float *x, int64_t n, int64_t k, float *v, int64_t *ix)
{
    int64_t filled = 0, i = 0;
    for (; i < n && filled < k; i++) /* the first k values, NaN as -inf (it never enters later) */
        v[filled] = x[i] == x[i] ? x[i] : -__builtin_inff(), ix[filled] = i, filled++;
    for (int64_t j = filled / 2 - 1; j >= 0; j--)
        sift_down(v, ix, filled, j);
    for (; i < n; i++) { /* scalar up to a multiple of SCAN */
        if (i % SCAN == 0)
            break;
        if (x[i] > v[0]) /* a later index ties below: only a larger value enters */
            v[0] = x[i], ix[0] = i, sift_down(v, ix, k, 0);
    }
    for (; i + SCAN <= n; i += SCAN) {
        const float floor = v[0];
        int hit = 0; /* an OR of comparisons: vectorized without reordering any arithmetic */
        for (int j = 0; j < SCAN; j++)
            hit |= x[i + j] > floor;
        if (!hit)
            continue;
        for (int j = 0; j < SCAN; j++)
            if (x[i + j] > v[0])
                v[0] = x[i + j], ix[0] = i + j, sift_down(v, ix, k, 0);
    }
    for (; i < n; i++)
        if (x[i] > v[0])
            v[0] = x[i], ix[0] = i, sift_down(v, ix, k, 0);
    /* heap order -> largest first: pop the lowest-ranked entry to the end, k times */
    for (int64_t end = filled - 1; end > 0; end--) {
        float tv = v[0];
        int64_t ti = ix[0];
        v[0] = v[end], ix[0] = ix[end];
        v[end] = tv, ix[end] = ti;
        sift_down(v, ix, end, 0);
    }
}

/* values [M][k], indices [M][k] (int64) of x [M][n]; k <= n (beyond n: -inf at index -1). */
void topk_rows(const float *x, int64_t M, int64_t n, int64_t k, float *values, int64_t *indices, int threads)
{
    if (k <= 0)
        return;
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        float *v = values + m * k;
        int64_t *ix = indices + m * k;
        for (int64_t j = 0; j < k; j++)
            v[j] = -__builtin_inff(), ix[j] = -1;
        row_topk(x + m * n, n, k, v, ix);
    }
}
