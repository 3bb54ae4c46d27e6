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
#include <math.h>
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

/* ln n as float for the counts a state usually holds, computed once when the library is loaded. */
#define LOG_COUNTS 4097
static float log_counts[LOG_COUNTS];
__attribute__((constructor)) static void fill_log_counts(void) {
    for (int64_t n = 1; n < LOG_COUNTS; n++) log_counts[n] = (float)log((double)n);
}

/* The fields of one row of the merge's table (user_tokens.merge_histories builds it). */
enum { ROW_ITEMS, ROW_COUNTS, ROW_SIZE, ROW_SEQ, ROW_TAIL, ROW_NEWEST, ROW_FIELDS };
/* The fields of one row of the merge's result. */
enum { OUT_LENGTH, OUT_GAP, OUT_LAG, OUT_FIELDS };

/*
 * One row's state tokens (items/counts, size of them: distinct, oldest first) merged with its
 * newer events (events[0 .. newer)). The events are grouped by item in a small open-addressing
 * table (slots: up to 4 * newer + 2, then four arrays of newer entries); each state token either
 * joins its group's count or is written as it is; then the groups are written in the order of
 * their last occurrence. Returns the number of tokens written to out_items/out_counts.
 */
static int64_t merge_one(const int64_t *items, const int64_t *counts, int64_t size,
                         const int64_t *events, int64_t newer, int64_t width, int64_t *scratch,
                         int64_t *out_items, int64_t *out_counts) {
    int64_t *slots = scratch;                  /* group index + 1 per slot, 0: empty */
    int64_t *group_item = scratch + 4 * width + 2; /* per group */
    int64_t *group_count = group_item + width;
    int64_t *group_last = group_count + width;
    int64_t *column_group = group_last + width; /* per newer event */
    int64_t groups = 0, bits = 1, written = 0;
    while (((int64_t)1 << bits) < 2 * newer) bits++;
    int64_t mask = ((int64_t)1 << bits) - 1;
    memset(slots, 0, sizeof(int64_t) * (size_t)(mask + 1));
    for (int64_t j = 0; j < newer; j++) {
        int64_t item = events[j];
        int64_t slot = (int64_t)(((uint64_t)item * GOLDEN) >> (64 - bits));
        while (slots[slot] && group_item[slots[slot] - 1] != item) slot = (slot + 1) & mask;
        if (!slots[slot]) {
            slots[slot] = ++groups;
            group_item[groups - 1] = item;
            group_count[groups - 1] = 0;
        }
        int64_t g = slots[slot] - 1;
        group_count[g] += 1;
        group_last[g] = j;
        column_group[j] = g;
    }
    for (int64_t i = 0; i < size; i++) {
        int64_t slot = (int64_t)(((uint64_t)items[i] * GOLDEN) >> (64 - bits));
        while (groups && slots[slot] && group_item[slots[slot] - 1] != items[i]) slot = (slot + 1) & mask;
        if (groups && slots[slot]) {
            group_count[slots[slot] - 1] += counts[i];
        } else {
            out_items[written] = items[i];
            out_counts[written++] = counts[i];
        }
    }
    for (int64_t j = 0; j < newer; j++) {
        int64_t g = column_group[j];
        if (group_last[g] == j) {
            out_items[written] = group_item[g];
            out_counts[written++] = group_count[g];
        }
    }
    return written;
}

/*
 * A batch's rows merged with their users' stored tokens, written as a history
 * (user_tokens.merge_histories). Row r of table (ROW_FIELDS int64 each): the addresses of its
 * state's items and counts, the state's size (-1: no state), its sequence number, the row's tail
 * length and the sequence number of the tail's newest event. The tail is the row's first
 * tail-length columns of keys (width columns a row), or with left its last. The tail's events at
 * or below the state's sequence number are in the state already; the newer ones are merged.
 *
 * The history's width is the first of widths (ascending, width_count of them) that holds the
 * longest merged row (at least 1 token), and at least width. It is written in out (room for
 * max_width columns): keys (int64), mask and weights (float32), rows * W each, then out_rows
 * (OUT_FIELDS int64 per row). A merged row's tokens go to its first columns or, with left, end at
 * its last, each with mask 1 and the weight ln count; a row without a state keeps its keys and
 * mask on the same side. Other positions get pad_key, mask 0 and weight 0. A row's out_rows: its
 * number of tokens (-1: no state), 1 when events between the state and the tail are in neither (a
 * gap), and its lag (newest minus the state's sequence number, at least 0; -1: no state).
 *
 * Returns W, or -1 before writing anything when max_width is below width, a row's tail does not
 * fit the width, its state and tail do not fit max_width, or no width up to max_width holds the
 * longest merged row.
 */
int64_t recserve_merge_histories(const int64_t *table, int64_t rows, const int64_t *keys,
                                 const float *mask, int64_t width, int64_t left, int64_t pad_key,
                                 const int64_t *widths, int64_t width_count, int64_t max_width,
                                 uint8_t *out) {
    if (max_width < width) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *row = table + r * ROW_FIELDS;
        if (row[ROW_TAIL] < 0 || row[ROW_TAIL] > width || row[ROW_SIZE] < -1 ||
            (row[ROW_SIZE] >= 0 && row[ROW_SIZE] > max_width - row[ROW_TAIL]))
            return -1;
    }
    /* the groups' table (8 * width + 2), each row's merged items and counts (max_width each),
     * then each row's out_rows fields until the history's width is known */
    size_t room = (size_t)(8 * width + 2) + (size_t)rows * (2 * (size_t)max_width + OUT_FIELDS);
    int64_t *scratch = malloc(sizeof(int64_t) * room);
    if (!scratch) return -1;
    int64_t *items = scratch + 8 * width + 2, *counts = items + rows * max_width;
    int64_t *lengths = counts + rows * max_width;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *row = table + r * ROW_FIELDS;
        int64_t size = row[ROW_SIZE], seq = row[ROW_SEQ], length = row[ROW_TAIL];
        int64_t *fields = lengths + OUT_FIELDS * r;
        if (size < 0) {
            fields[OUT_LENGTH] = -1, fields[OUT_GAP] = 0, fields[OUT_LAG] = -1;
            continue;
        }
        int64_t first = row[ROW_NEWEST] - length + 1; /* the tail's oldest event */
        int64_t skip = seq < first ? 0 : (seq - first + 1 < length ? seq - first + 1 : length);
        const int64_t *events = keys + r * width + (left ? width - length : 0) + skip;
        int64_t n = merge_one((const int64_t *)(intptr_t)row[ROW_ITEMS],
                              (const int64_t *)(intptr_t)row[ROW_COUNTS], size, events, length - skip,
                              width, scratch, items + r * max_width, counts + r * max_width);
        fields[OUT_LENGTH] = n;
        fields[OUT_GAP] = length > 0 && first - 1 > seq;
        fields[OUT_LAG] = row[ROW_NEWEST] > seq ? row[ROW_NEWEST] - seq : 0;
        if (n > longest) longest = n;
    }
    int64_t w = -1;
    for (int64_t i = 0; i < width_count && w < 0; i++)
        if (widths[i] >= (longest > 1 ? longest : 1)) w = widths[i];
    if (w >= 0 && w < width) w = width;
    if (w < 0 || w > max_width) {
        free(scratch);
        return -1;
    }
    int64_t cells = rows * w;
    int64_t *out_keys = (int64_t *)out, *out_rows = (int64_t *)(out + 16 * cells);
    float *out_mask = (float *)(out + 8 * cells), *out_weights = (float *)(out + 12 * cells);
    for (int64_t r = 0; r < rows; r++) {
        int64_t *row_keys = out_keys + r * w, *fields = lengths + OUT_FIELDS * r;
        float *row_mask = out_mask + r * w, *row_weights = out_weights + r * w;
        for (int64_t j = 0; j < w; j++) row_keys[j] = pad_key;
        memset(row_mask, 0, sizeof(float) * (size_t)w);
        memset(row_weights, 0, sizeof(float) * (size_t)w);
        memcpy(out_rows + r * OUT_FIELDS, fields, sizeof(int64_t) * OUT_FIELDS);
        int64_t n = fields[OUT_LENGTH];
        if (n < 0) {
            int64_t at = left ? w - width : 0;
            memcpy(row_keys + at, keys + r * width, sizeof(int64_t) * (size_t)width);
            memcpy(row_mask + at, mask + r * width, sizeof(float) * (size_t)width);
            continue;
        }
        const int64_t *row_items = items + r * max_width, *row_counts = counts + r * max_width;
        int64_t at = left ? w - n : 0;
        for (int64_t j = 0; j < n; j++) {
            row_keys[at + j] = row_items[j];
            row_mask[at + j] = 1.0f;
            int64_t c = row_counts[j];
            row_weights[at + j] = c > 0 && c < LOG_COUNTS ? log_counts[c] : (float)log((double)c);
        }
    }
    free(scratch);
    return w;
}
