/* Row fingerprints (docs/QUANTIZATION.md, "Row fingerprints", FINGERPRINT_VERSION 1) in one
 * pass over each row: the construction of cnrstore/codec/fingerprint.py, bit for bit.
 *
 * numpy takes five passes over every chunk (xor, multiply, shift, xor, multiply-sum) and ran
 * at a third of a plain uint64-multiply pass; here every word is read once, and gcc
 * vectorizes the word loop (vpmullq where the CPU has AVX-512DQ, chosen at load time by the
 * target clones). Built and loaded by cnrstore/codec/native.py; ctypes releases the GIL for
 * the call, so the parts of a large table run on all cores.
 *
 * Words are read little-endian through memcpy (any alignment); native.py loads this only on
 * little-endian hosts. A row's last partial word is zero-padded, as the spec says.
 */
#include <stdint.h>
#include <string.h>

#define CNR_C 0x9E3779B97F4A7C15ULL

/* Bumped with any change to the functions' signatures (native.py checks it). */
int cnr_fingerprint_abi(void) { return 1; }

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 31;
    return h;
}

#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void cnr_row_fingerprints(const unsigned char *base, int64_t rows, int64_t stride,
                          int64_t nbytes, const uint64_t *a, const uint64_t *b,
                          uint64_t len_mix, uint64_t *out) {
    /* rows of `nbytes` bytes, `stride` bytes apart; a and b hold ceil(nbytes / 8) keys. */
    const int64_t full = nbytes / 8, tail = nbytes % 8;
    for (int64_t r = 0; r < rows; r++) {
        const unsigned char *p = base + r * stride;
        uint64_t h = 0;
        for (int64_t j = 0; j < full; j++) {
            uint64_t w;
            memcpy(&w, p + 8 * j, 8);
            uint64_t x = (w ^ a[j]) * CNR_C;
            x ^= x >> 32;
            h += x * b[j];
        }
        if (tail) {
            uint64_t w = 0;
            memcpy(&w, p + 8 * full, (size_t)tail);
            uint64_t x = (w ^ a[full]) * CNR_C;
            x ^= x >> 32;
            h += x * b[full];
        }
        out[r] = avalanche(h ^ len_mix);
    }
}
