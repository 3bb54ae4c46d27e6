/*
 * Compiled probe-and-gather loops of the parameter store (loaded with ctypes by kernels.py).
 *
 * Each function does, in one pass over the keys of a batch, what the numpy path in store.py does
 * in several whole-array steps: hash, probe, compare, copy the row into the output, mark the tier,
 * and list the keys it could not serve. The results are bit for bit those of the numpy path
 * (tests/unit/test_kernels.py holds them to it). No Python API is used: plain C over raw buffers.
 *
 * Memory access is the cost (the tables are far larger than the CPU caches), so the loops work in
 * blocks: first the address of every key's bucket or slot is computed and prefetched, then the
 * probes run while the next loads are already in flight, then the rows found are prefetched and
 * copied.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define BUCKET 8
#define BUCKET_WORDS (BUCKET + BUCKET / 2) /* 8 slot keys, then 8 int32 rows packed in 4 words */
#define EMPTY_ROW (-1)
#define BLOCK 64

static inline void prefetch(const void *address) { __builtin_prefetch(address, 0, 1); }

static inline void prefetch_span(const void *address, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) prefetch((const char *)address + offset);
}

static inline float half_to_float(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu;
    uint32_t bits;
    float value;
    if (exponent == 0) {
        value = (float)mantissa * (1.0f / 16777216.0f); /* zero or subnormal: mantissa * 2^-24 */
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline void copy_row(float *out, const void *vectors, int64_t row, int64_t dim, int half) {
    if (!half) {
        memcpy(out, (const float *)vectors + row * dim, (size_t)dim * sizeof(float));
        return;
    }
    const uint16_t *source = (const uint16_t *)vectors + row * dim;
    for (int64_t d = 0; d < dim; d++) out[d] = half_to_float(source[d]);
}

static inline const void *row_address(const void *vectors, int64_t row, int64_t dim, int half) {
    return (const char *)vectors + row * dim * (half ? 2 : 4);
}

/*
 * L1, a direct-mapped cache: slot = (high 32 bits of key * GOLDEN) * slots >> 32.
 * Hits: out[i] = vectors[slot], tiers[i] = tier. Misses: their positions i go to `misses`.
 * Returns the number of misses.
 */
int64_t recserve_cache_take(const int64_t *keys, int64_t n, const int64_t *slot_keys, int64_t slots,
                            const float *vectors, int64_t dim, float *out, int8_t *tiers, int8_t tier,
                            int64_t *misses) {
    int64_t slot_of[BLOCK];
    int64_t missed = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        for (int64_t j = 0; j < count; j++) {
            uint64_t high = ((uint64_t)keys[start + j] * GOLDEN) >> 32;
            slot_of[j] = (int64_t)((high * (uint64_t)slots) >> 32);
            prefetch(slot_keys + slot_of[j]);
            prefetch_span(vectors + slot_of[j] * dim, dim * (int64_t)sizeof(float));
        }
        for (int64_t j = 0; j < count; j++) {
            int64_t i = start + j;
            if (slot_keys[slot_of[j]] == keys[i]) {
                memcpy(out + i * dim, vectors + slot_of[j] * dim, (size_t)dim * sizeof(float));
                tiers[i] = tier;
            } else {
                misses[missed++] = i;
            }
        }
    }
    return missed;
}

static int64_t find_row(const int64_t *bucket, int64_t key, const int64_t *overflow_keys,
                        const int32_t *overflow_rows, int64_t overflow) {
    const int32_t *rows = (const int32_t *)(bucket + BUCKET);
    for (int s = 0; s < BUCKET; s++) {
        if (bucket[s] == key && rows[s] != EMPTY_ROW) return rows[s];
    }
    if (overflow == 0 || rows[BUCKET - 1] == EMPTY_ROW) return EMPTY_ROW; /* bucket not full: absent */
    int64_t low = 0, high = overflow; /* sorted overflow list */
    while (low < high) {
        int64_t middle = low + (high - low) / 2;
        if (overflow_keys[middle] < key) low = middle + 1; else high = middle;
    }
    return low < overflow && overflow_keys[low] == key ? overflow_rows[low] : EMPTY_ROW;
}

/*
 * A hashed key index (keyindex.py) over a vector array, for the keys at `positions`:
 * bucket = key * GOLDEN >> shift. Found: out[p] = vectors[row] (float16 widened when `half`),
 * tiers[p] = tier. Not found: p goes to `misses`. Returns the number of misses.
 */
int64_t recserve_index_take(const int64_t *keys, const int64_t *positions, int64_t n,
                            const int64_t *buckets, int64_t shift, const int64_t *overflow_keys,
                            const int32_t *overflow_rows, int64_t overflow, const void *vectors,
                            int64_t dim, int32_t half, float *out, int8_t *tiers, int8_t tier,
                            int64_t *misses) {
    const int64_t *bucket_of[BLOCK];
    int64_t row_of[BLOCK];
    int64_t missed = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t count = n - start < BLOCK ? n - start : BLOCK;
        for (int64_t j = 0; j < count; j++) {
            uint64_t hashed = (uint64_t)keys[positions[start + j]] * GOLDEN;
            bucket_of[j] = buckets + (int64_t)(hashed >> shift) * BUCKET_WORDS;
            prefetch(bucket_of[j]);
            prefetch(bucket_of[j] + BUCKET_WORDS - 1); /* a bucket may straddle two cache lines */
        }
        for (int64_t j = 0; j < count; j++) {
            row_of[j] = find_row(bucket_of[j], keys[positions[start + j]], overflow_keys, overflow_rows, overflow);
            if (row_of[j] != EMPTY_ROW) prefetch_span(row_address(vectors, row_of[j], dim, half), dim * (half ? 2 : 4));
        }
        for (int64_t j = 0; j < count; j++) {
            int64_t p = positions[start + j];
            if (row_of[j] == EMPTY_ROW) {
                misses[missed++] = p;
                continue;
            }
            copy_row(out + p * dim, vectors, row_of[j], dim, half);
            tiers[p] = tier;
        }
    }
    return missed;
}

/*
 * out[p] = rows[table_ids[p]] and tiers[p] = tier for each of the n positions p (the default rows;
 * `tables` of them; out, tiers and table_ids have `size` entries). Returns 0, or -1 before writing
 * anything when a position is outside them or its table id is not one of the rows.
 */
int64_t recserve_fill_rows(const int64_t *positions, int64_t n, int64_t size, const int16_t *table_ids,
                           const float *rows, int64_t tables, int64_t dim, float *out, int8_t *tiers,
                           int8_t tier) {
    for (int64_t i = 0; i < n; i++)
        if (positions[i] < 0 || positions[i] >= size || table_ids[positions[i]] < 0 ||
            table_ids[positions[i]] >= tables)
            return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = positions[i];
        memcpy(out + p * dim, rows + (int64_t)table_ids[p] * dim, sizeof(float) * (size_t)dim);
        tiers[p] = tier;
    }
    return 0;
}

/* counts[table_ids[i] * tier_count + tiers[i]] += 1 for every key of the batch. */
void recserve_count(const int16_t *table_ids, const int8_t *tiers, int64_t n, int64_t tier_count,
                    int64_t *counts) {
    for (int64_t i = 0; i < n; i++) counts[table_ids[i] * tier_count + tiers[i]] += 1;
}
