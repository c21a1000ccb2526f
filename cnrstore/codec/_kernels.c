/* The codec's compiled kernels, each the bit-for-bit twin of a torch/numpy implementation
 * that stays the reference (and the path where no compiler is found):
 *
 * - cnr_row_fingerprints: row fingerprints (docs/QUANTIZATION.md, "Row fingerprints",
 *   FINGERPRINT_VERSION 1) in one pass over each row (cnrstore/codec/fingerprint.py);
 * - cnr_encode_int8: int8 rows with fp16 scale/offset from the row's min/max
 *   (docs/QUANTIZATION.md, "Row encoding"; cnrstore/codec/quantize.py _encode_int and
 *   qparams.py), in one pass over each row.
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
int cnr_kernels_abi(void) { return 2; }

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

/* ---- int8 encode: every step is the float32 op qparams.py does, in the same order; built
 * with -ffp-contract=off so no multiply-add is fused (torch fuses none either). ---- */

#if defined(__FLT16_MAX__)
#define CNR_HAVE_F16 1
typedef _Float16 cnr_half;

static inline uint16_t half_bits(cnr_half h) { uint16_t b; memcpy(&b, &h, 2); return b; }
static inline cnr_half bits_half(uint16_t b) { cnr_half h; memcpy(&h, &b, 2); return h; }

/* qparams._fp16_round_down: the largest fp16 value <= v (|v| <= 65504). */
static inline float fp16_round_down(float v) {
    cnr_half h = (cnr_half)v;
    int32_t bits = (int16_t)half_bits(h);
    float hf = (float)h;
    int32_t down = hf > 0 ? bits - 1 : (hf == 0 ? -32767 : bits + 1);
    int32_t fixed = hf > v ? down : bits;
    return (float)bits_half((uint16_t)(int16_t)fixed);
}

/* qparams._fp16_round_up: the smallest fp16 value >= v (0 <= v <= 65504). */
static inline float fp16_round_up(float v) {
    cnr_half h = (cnr_half)v;
    int32_t bits = (int16_t)half_bits(h);
    int32_t fixed = (float)h < v ? bits + 1 : bits;
    return (float)bits_half((uint16_t)(int16_t)fixed);
}
#endif

int cnr_have_encode_int8(void) {
#if defined(CNR_HAVE_F16)
    return 1;
#else
    return 0;
#endif
}

#define CNR_FP16_MAX 65504.0f
#define CNR_MAGIC 12582912.0f

/* rows of `width` float32, `stride` floats apart -> out rows of 4 + width bytes (fp16
 * scale, fp16 offset, codes). flags[r]: bit 0 the row is not finite (its min or max, or the
 * scale, is NaN/Inf), bit 1 its range does not fit fp16 qparams (qparams.fits_fp16). */
#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void cnr_encode_int8(const float *x, int64_t rows, int64_t width, int64_t stride,
                     unsigned char *out, unsigned char *flags) {
#if defined(CNR_HAVE_F16)
    const int64_t rnb = 4 + width;
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * stride;
        unsigned char *o = out + r * rnb;
        /* min/max in 8 lanes (so gcc vectorizes it), reduced after; which of -0.0 and
         * +0.0 comes out does not matter: offset and scale are made canonical below. */
        float mn[8], mx[8];
        int nl[8];
        for (int l = 0; l < 8; l++) { mn[l] = mx[l] = p[0]; nl[l] = 0; }
        int64_t j0 = 0;
        for (; j0 + 8 <= width; j0 += 8) {
            for (int l = 0; l < 8; l++) {
                float v = p[j0 + l];
                nl[l] |= v != v;
                mn[l] = v < mn[l] ? v : mn[l];
                mx[l] = v > mx[l] ? v : mx[l];
            }
        }
        for (; j0 < width; j0++) {
            float v = p[j0];
            nl[0] |= v != v;
            mn[0] = v < mn[0] ? v : mn[0];
            mx[0] = v > mx[0] ? v : mx[0];
        }
        float lo = mn[0], hi = mx[0];
        int nan = nl[0];
        for (int l = 1; l < 8; l++) {
            lo = mn[l] < lo ? mn[l] : lo;
            hi = mx[l] > hi ? mx[l] : hi;
            nan |= nl[l];
        }  /* amin/amax propagate NaN: */
        unsigned char flag = 0;
        if (nan) { lo = hi = __builtin_nanf(""); }
        if (!(lo >= -CNR_FP16_MAX && hi <= CNR_FP16_MAX)) flag |= 2;
        float clo = lo < -CNR_FP16_MAX ? -CNR_FP16_MAX : (lo > CNR_FP16_MAX ? CNR_FP16_MAX : lo);
        float chi = hi < -CNR_FP16_MAX ? -CNR_FP16_MAX : (hi > CNR_FP16_MAX ? CNR_FP16_MAX : hi);
        float offset = fp16_round_down(clo) + 0.0f;
        float span = chi - offset;
        span = span < 0.0f ? 0.0f : span;
        float q = span / 255.0f;
        q = q > CNR_FP16_MAX ? CNR_FP16_MAX : q;
        float scale = fp16_round_up(q) + 0.0f;
        if (!__builtin_isfinite(lo) || !__builtin_isfinite(hi) || !__builtin_isfinite(scale))
            flag |= 1;
        flags[r] = flag;
        uint16_t sb = half_bits((cnr_half)scale), ob = half_bits((cnr_half)offset);
        memcpy(o, &sb, 2);
        memcpy(o + 2, &ob, 2);
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t j = 0; j < width; j++) {
            float y = p[j] - offset;
            y *= inv;
            y = y < 0.0f ? 0.0f : (y > 255.0f ? 255.0f : y);
            y += CNR_MAGIC;
            y -= CNR_MAGIC;
            o[4 + j] = (unsigned char)(int32_t)y;  /* an exact integer in [0, 255] */
        }
    }
#else
    (void)x; (void)rows; (void)width; (void)stride; (void)out; (void)flags;
#endif
}
