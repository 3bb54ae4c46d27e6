/*
 * The history columns of the features records, in one pass (loaded with ctypes by histories.py).
 *
 * The numpy path (histories.py) makes some forty whole-array passes for a build of a few requests;
 * this makes each column in one, with the interpreter lock released (ctypes.CDLL), so that a
 * request thread of the step's process never waits for the writer's build. The results are those
 * of the numpy path, value for value (tests/unit/test_request_log_histories.py holds them to it):
 * the same digests, the same "first owner with this digest" rule, the same check that the histories
 * are equal before one row names another's. No Python API: plain C over C-contiguous buffers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ull

/*
 * values: every owner's valid history keys, owner after owner; split [owners, sequences]: each
 * owner's sequences' lengths; counts [parts]: each request's rows; owner_counts [parts]: its owners.
 * Writes history_row [rows], offsets [rows + 1], absent [rows], kept_values (up to the values'
 * count), split_offsets [rows + 1] and kept_split (up to owners x sequences). Returns the count of
 * kept values (offsets[rows]), or -1 when scratch memory could not be had.
 */
int64_t recserve_history_columns(const int64_t *values, const int32_t *split, int64_t owners,
                                 int64_t sequences, const int64_t *counts,
                                 const int64_t *owner_counts, int64_t parts, int32_t *history_row,
                                 int32_t *offsets, uint8_t *absent, int64_t *kept_values,
                                 int32_t *split_offsets, int32_t *kept_split) {
    int64_t table_size = 16;
    while (table_size < 2 * owners) table_size <<= 1;
    int64_t *starts = malloc(sizeof(int64_t) * (owners + 1));
    int64_t *request = malloc(sizeof(int64_t) * (owners + 1));
    uint64_t *digest = malloc(sizeof(uint64_t) * (owners + 1));
    int64_t *found = malloc(sizeof(int64_t) * (owners + 1));
    int64_t *first_row = malloc(sizeof(int64_t) * (owners + 1));
    int64_t *table = malloc(sizeof(int64_t) * table_size);
    if (!starts || !request || !digest || !found || !first_row || !table) {
        free(starts), free(request), free(digest), free(found), free(first_row), free(table);
        return -1;
    }
    /* each owner's start, request and digest (as histories._first_equal makes it) */
    int64_t at = 0, owner = 0;
    for (int64_t p = 0; p < parts; p++)
        for (int64_t k = 0; k < owner_counts[p]; k++, owner++) request[owner] = p;
    for (int64_t o = 0; o < owners; o++) {
        uint64_t sum = 0, shape = 0;
        int64_t length = 0;
        for (int64_t s = 0; s < sequences; s++) {
            length += split[o * sequences + s];
            shape += (uint64_t)(int64_t)split[o * sequences + s] * (uint64_t)(2 * s + 3);
        }
        starts[o] = at;
        for (int64_t k = 0; k < length; k++) sum += (uint64_t)values[at + k] * GOLDEN;
        at += length;
        digest[o] = sum ^ (shape << 40) ^ (uint64_t)request[o];
    }
    starts[owners] = at;
    /* each owner's first owner with its digest, kept only where the histories are equal */
    memset(table, 0xff, sizeof(int64_t) * table_size);
    for (int64_t o = 0; o < owners; o++) {
        int64_t slot = (int64_t)((digest[o] * GOLDEN) >> 1) & (table_size - 1);
        while (table[slot] >= 0 && digest[table[slot]] != digest[o]) slot = (slot + 1) & (table_size - 1);
        if (table[slot] < 0) {
            table[slot] = o;
            found[o] = o;
            continue;
        }
        const int64_t other = table[slot];
        const int64_t length = starts[o + 1] - starts[o];
        int same = request[o] == request[other] &&
                   memcmp(split + o * sequences, split + other * sequences, sizeof(int32_t) * sequences) == 0 &&
                   memcmp(values + starts[o], values + starts[other], sizeof(int64_t) * length) == 0;
        found[o] = same ? other : o;
    }
    /* rows: each one's owner, the first row of each owner, and which rows carry a history */
    int64_t row = 0, row_start = 0, owner_start = 0, kept = 0, carrying = 0, next_owner = 0;
    offsets[0] = 0;
    split_offsets[0] = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t rows = counts[p], owned = owner_counts[p];
        for (int64_t r = 0; r < rows; r++, row++) {
            const int64_t mine = r * owned / rows + owner_start;
            while (next_owner <= mine) first_row[next_owner++] = row; /* searchsorted, left */
            const int64_t first = first_row[found[mine]];
            history_row[row] = (int32_t)(first - row_start);
            absent[row] = first != row;
            if (first == row) {
                const int64_t length = starts[mine + 1] - starts[mine];
                memcpy(kept_values + kept, values + starts[mine], sizeof(int64_t) * length);
                memcpy(kept_split + carrying * sequences, split + mine * sequences, sizeof(int32_t) * sequences);
                kept += length;
                carrying++;
            }
            offsets[row + 1] = (int32_t)kept;
            split_offsets[row + 1] = (int32_t)(carrying * sequences);
        }
        row_start += rows;
        owner_start += owned;
    }
    free(starts), free(request), free(digest), free(found), free(first_row), free(table);
    return kept;
}
