/*
 * Compiled hex parsing of the categorical inputs (loaded with ctypes by hex_parser.py).
 *
 * One pass per string over a fixed-width, NUL-padded byte array (numpy's "S<width>"), where the
 * numpy path of recserve.wire.parse_hex makes a dozen whole-array passes. The results are bit for
 * bit those of the numpy path (tests/unit/test_hex_parser.py holds them to it). No Python API is
 * used: plain C over raw buffers.
 */
#include <stdint.h>

/* Each byte's hex digit value; 16 for a byte that is not a hex digit. */
static const uint8_t DIGITS[256] = {
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
     0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 16, 16, 16, 16, 16, 16,
    16, 10, 11, 12, 13, 14, 15, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 10, 11, 12, 13, 14, 15, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
};

/*
 * Parse n strings of `width` bytes each (trailing NULs are padding; a string's length is up to its
 * last non-NUL byte, so an embedded NUL is a character, and not a hex digit). Writes each value to
 * out and whether it is empty to empty. Returns -1, or the index of the first string that is
 * longer than max_digits or holds a character that is not a hex digit (out and empty are then
 * incomplete).
 */
int64_t recserve_parse_hex(const uint8_t *fixed, int64_t n, int64_t width, int64_t max_digits,
                           uint64_t *out, uint8_t *empty) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = fixed + i * width;
        int64_t length = width;
        while (length > 0 && s[length - 1] == 0) length--;
        if (length > max_digits) return i;
        uint64_t value = 0;
        uint32_t seen = 0; /* a byte that is not a hex digit sets bit 4 */
        for (int64_t j = 0; j < length; j++) {
            uint32_t digit = DIGITS[s[j]];
            seen |= digit;
            value = (value << 4) | (digit & 15u);
        }
        if (seen & 16u) return i;
        out[i] = value;
        empty[i] = length == 0;
    }
    return -1;
}
