/*
 * Compiled key loops of the feature transform (loaded with ctypes by compiled_keys.py).
 *
 * A key is splitmix64(salt XOR value) (hashing.py). The numpy path makes five whole-array passes
 * for the mix and as many again to pick missing keys and masks; each of these makes one. The
 * results are bit for bit those of the numpy path (tests/unit/test_compiled_keys.py holds them to
 * it). No Python API is used: plain C over raw, C-contiguous buffers.
 */
#include <stdint.h>

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* out[i] = splitmix64(values[i] ^ salts[i % salt_count]) for n values (n a multiple of salt_count). */
void recserve_keys(const uint64_t *values, int64_t n, const uint64_t *salts, int64_t salt_count,
                   uint64_t *out) {
    for (int64_t start = 0; start < n; start += salt_count)
        for (int64_t c = 0; c < salt_count; c++)
            out[start + c] = splitmix64(values[start + c] ^ salts[c]);
}

/*
 * The keys of rows x cols categorical values: a column's missing key where absent, the value itself
 * for an identity column, else its hash with the column's salt.
 */
void recserve_categorical_keys(const uint64_t *values, const uint8_t *absent, int64_t rows,
                               int64_t cols, const uint64_t *salts, const uint8_t *identity,
                               const int64_t *missing, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * cols;
        for (int64_t c = 0; c < cols; c++) {
            const uint64_t value = values[at + c];
            out[at + c] = absent[at + c] ? missing[c]
                          : identity[c]  ? (int64_t)value
                                         : (int64_t)splitmix64(value ^ salts[c]);
        }
    }
}

/*
 * The keys of n item ids (-1: absent, the missing key). Returns -1, or the index of the first id
 * below -1 (out is then incomplete: the caller refuses the request).
 */
int64_t recserve_item_keys(const int64_t *items, int64_t n, uint64_t salt, int64_t missing,
                           int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t item = items[i];
        if (item < -1) return i;
        out[i] = item == -1 ? missing : (int64_t)splitmix64((uint64_t)item ^ salt);
    }
    return -1;
}

/*
 * A sequence's keys and mask, rows x bucket, from its ids (rows x width, each row's first, newest
 * last) and each row's length: on the right padding side a row's ids sit at positions 0..length-1,
 * on the left at the bucket's last positions; every other position holds the missing key and a
 * mask of 0. Returns 0, or 1 when a row is one the checks refuse or the bucket cannot hold (a
 * length below 0 or over max_length, the width or the bucket; an id at a position past max_length;
 * a negative id within a length): keys and mask are then incomplete.
 */
int64_t recserve_history_keys(const int64_t *items, int64_t rows, int64_t width,
                              const int32_t *lengths, int64_t bucket, int64_t max_length,
                              int32_t left, uint64_t salt, int64_t missing, int64_t *keys,
                              float *mask) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t length = lengths[r];
        const int64_t *row = items + r * width;
        if (length < 0 || length > max_length || length > width || length > bucket) return 1;
        for (int64_t p = max_length; p < width; p++)
            if (row[p] != 0) return 1;
        const int64_t first = left ? bucket - length : 0;
        int64_t *out = keys + r * bucket;
        float *on = mask + r * bucket;
        for (int64_t p = 0; p < bucket; p++) {
            const int64_t source = p - first;
            if (source >= 0 && source < length) {
                const int64_t item = row[source];
                if (item < 0) return 1;
                out[p] = (int64_t)splitmix64((uint64_t)item ^ salt);
                on[p] = 1.0f;
            } else {
                out[p] = missing;
                on[p] = 0.0f;
            }
        }
    }
    return 0;
}
