/*
 * The lookup step's merge of users' stored states with their requests' real-time tails, written
 * as a history (loaded with ctypes by kernels.py and state_index.py, with the store's loops).
 *
 * recserve_merge_histories merges the rows of a table the caller builds; recserve_merge_cached
 * builds that table itself from the step's cached states (an index the Python cache keeps in step
 * with itself) when every row's user is cached and fresh. Plain C over raw buffers, no Python API;
 * history_merge.py has the numpy path it must equal (tests/unit/test_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL

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

/*
 * The cached states (state_index.py): slots of IX_FIELDS int64 each, a power of two of them (at
 * least 2, at most half full), probed linearly from (user * GOLDEN) >> (64 - bits). A used slot
 * holds its user, the addresses of the state's keys and counts (arrays the Python cache keeps
 * alive while the slot names them), the state's size, sequence number and mode, the time its cache
 * entry stops being fresh and the time it may no longer be served stale (the cache's clock, in
 * microseconds).
 */
enum { IX_USED, IX_USER, IX_ITEMS, IX_COUNTS, IX_SIZE, IX_SEQ, IX_MODE, IX_FRESH, IX_EXPIRES, IX_FIELDS };

static inline int64_t index_home(int64_t slots, int64_t user) {
    return (int64_t)(((uint64_t)user * GOLDEN) >> (64 - __builtin_ctzll((uint64_t)slots)));
}

/* The slot holding user, or the free slot where it would go; -1 when neither (a full index). */
static int64_t index_find(const int64_t *index, int64_t slots, int64_t user) {
    int64_t slot = index_home(slots, user);
    for (int64_t probes = 0; probes < slots; probes++, slot = (slot + 1) & (slots - 1)) {
        const int64_t *at = index + slot * IX_FIELDS;
        if (!at[IX_USED] || at[IX_USER] == user) return slot;
    }
    return -1;
}

/* Put entry (IX_USER .. IX_EXPIRES) in user's slot. Returns the slot, -1 when the index is full. */
int64_t recserve_index_put(int64_t *index, int64_t slots, const int64_t *entry) {
    int64_t slot = index_find(index, slots, entry[0]);
    if (slot < 0) return -1;
    index[slot * IX_FIELDS + IX_USED] = 1;
    memcpy(index + slot * IX_FIELDS + IX_USER, entry, sizeof(int64_t) * (IX_FIELDS - IX_USER));
    return slot;
}

/* Free user's slot, moving back the entries probed past it. Returns 1, or 0 when it is absent. */
int64_t recserve_index_remove(int64_t *index, int64_t slots, int64_t user) {
    int64_t hole = index_find(index, slots, user), mask = slots - 1;
    if (hole < 0 || !index[hole * IX_FIELDS + IX_USED]) return 0;
    for (int64_t next = (hole + 1) & mask; index[next * IX_FIELDS + IX_USED]; next = (next + 1) & mask) {
        int64_t home = index_home(slots, index[next * IX_FIELDS + IX_USER]);
        if (((next - home) & mask) >= ((next - hole) & mask)) { /* its home is not past the hole */
            memcpy(index + hole * IX_FIELDS, index + next * IX_FIELDS, sizeof(int64_t) * IX_FIELDS);
            hole = next;
        }
    }
    index[hole * IX_FIELDS + IX_USED] = 0;
    return 1;
}

/*
 * recserve_merge_histories with its table built from the index: row r's user users[r], the newest
 * sequence number of its tail newest[r] and the tail's length lengths[r]. Served only when every
 * row's tail is valid (0 .. tail_limit events, newest at least the length), its user's slot is
 * fresh at now (with stale_ok, not yet expired) and its state leaves the tail no gap (sequence
 * number at least newest - length): every row is then a hit. row_states gets each row's state
 * sequence number, mode, lag (its newest sequence number minus the state's, at least 0) and 1
 * where the state was served past its freshness (else 0).
 *
 * Returns what recserve_merge_histories returns (the history's width, or -1), or 0 when a row is
 * not served so: the history is not written then (the caller takes its other path, which checks
 * the request and fetches the states).
 */
int64_t recserve_merge_cached(const int64_t *index, int64_t slots, const int64_t *users,
                              const int64_t *newest, const int32_t *lengths, int64_t rows,
                              int64_t tail_limit, int64_t now, int64_t stale_ok, const int64_t *keys,
                              const float *mask, int64_t width, int64_t left, int64_t pad_key,
                              const int64_t *widths, int64_t width_count, int64_t max_width,
                              uint8_t *out, int64_t *row_states) {
    int64_t *table = malloc(sizeof(int64_t) * (size_t)(rows > 0 ? rows * ROW_FIELDS : 1));
    if (!table) return -1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t length = lengths[r], slot = index_find(index, slots, users[r]);
        const int64_t *at = index + (slot < 0 ? 0 : slot) * IX_FIELDS;
        if (length < 0 || length > tail_limit || newest[r] < length || slot < 0 || !at[IX_USED] ||
            now > at[stale_ok ? IX_EXPIRES : IX_FRESH] || at[IX_SEQ] < newest[r] - length) {
            free(table);
            return 0;
        }
        int64_t *row = table + r * ROW_FIELDS;
        row[ROW_ITEMS] = at[IX_ITEMS], row[ROW_COUNTS] = at[IX_COUNTS], row[ROW_SIZE] = at[IX_SIZE];
        row[ROW_SEQ] = at[IX_SEQ], row[ROW_TAIL] = length, row[ROW_NEWEST] = newest[r];
        int64_t *fields = row_states + 4 * r;
        fields[0] = at[IX_SEQ], fields[1] = at[IX_MODE];
        fields[2] = newest[r] > at[IX_SEQ] ? newest[r] - at[IX_SEQ] : 0;
        fields[3] = now > at[IX_FRESH];
    }
    int64_t w = recserve_merge_histories(table, rows, keys, mask, width, left, pad_key, widths,
                                         width_count, max_width, out);
    free(table);
    return w;
}
