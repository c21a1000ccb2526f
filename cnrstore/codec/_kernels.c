/* The codec's compiled kernels, each the bit-for-bit twin of a torch/numpy implementation
 * that stays the reference (and the path where no compiler is found):
 *
 * - cnr_row_fingerprints: row fingerprints (docs/QUANTIZATION.md, "Row fingerprints",
 *   FINGERPRINT_VERSION 1) in one pass over each row (cnrstore/codec/fingerprint.py);
 * - cnr_encode_int8: int8 rows with fp16 scale/offset from the row's min/max
 *   (docs/QUANTIZATION.md, "Row encoding"; cnrstore/codec/quantize.py _encode_int and
 *   qparams.py), in one pass over each row;
 * - cnr_row_fingerprints_diff: the fingerprints, each compared with the previous put's as
 *   it is made, emitting the ids of the rows that differ (core/snapshot.py's diff);
 * - cnr_touched_fingerprints_diff: the fingerprints of a tracker's touched rows only, read
 *   where they lie in the table, each compared with (and, where it differs, written over)
 *   its entry of the new diff base (core/snapshot.py's touched diff);
 * - cnr_gather_check_f32: a non-blocking put's copy of its changed float32 rows with the
 *   refusal flags of their min/max (core/hostcodes.py snapshot_rows), in one pass;
 * - cnr_grow_union: a block's merge union after a put (core/chainpolicy.py), one merge;
 * - cnr_apply_rows: a grouped block's list of row objects checked, their ids decoded and
 *   each row copied once, from its last copy (format/rowapply.py; rowlists.py the reference).
 *
 * numpy takes five passes over every chunk (xor, multiply, shift, xor, multiply-sum) and ran
 * at a third of a plain uint64-multiply pass; here every word is read once, and gcc
 * vectorizes the word loop (vpmullq where the CPU has AVX-512DQ, chosen at load time by the
 * target clones), and prefetches 2 KiB ahead of the row it hashes (the hardware prefetcher
 * alone left it at ~70% of a plain read). Built and loaded by cnrstore/codec/native.py;
 * ctypes releases the GIL for the call, so the parts of a large table run on all cores.
 *
 * Words are read little-endian through memcpy (any alignment); native.py loads this only on
 * little-endian hosts. A row's last partial word is zero-padded, as the spec says.
 */
#include <stdint.h>
#include <string.h>

#define CNR_C 0x9E3779B97F4A7C15ULL

/* Bumped with any change to the functions' signatures (native.py checks it). */
int cnr_kernels_abi(void) { return 6; }

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 31;
    return h;
}

/* Software prefetch distance, in bytes of row data ahead of the row being hashed. With the
 * hardware prefetcher alone the pass ran at ~70% of a plain read on the 2-core VM (7.6
 * against 11 GB/s on 256 B rows, 4.6 on 64 B rows): the loads and the multiplies did not
 * overlap (docs/design/put-speed.md, "Fingerprint prefetch"). */
#ifndef CNR_PF_BYTES
#define CNR_PF_BYTES 2048
#endif
/* Words per block of a long row's word loop: it prefetches one block per block. */
#ifndef CNR_PF_WORDS
#define CNR_PF_WORDS 64
#endif

/* Every cache line of [p, p + n) prefetched (n > 0), at any alignment. A prefetch never
 * faults and reads nothing into the hash. */
static inline void prefetch_span(const unsigned char *p, int64_t n) {
    uintptr_t line = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + (uintptr_t)n;
    for (; line < end; line += 64) __builtin_prefetch((const void *)line);
}

/* Words [j0, j1) of a row, added into h: inlined into each caller (and each of its target
 * clones), so the word loop is vectorized for the clone's CPU. */
static inline __attribute__((always_inline)) uint64_t words_sum(
        const unsigned char *p, const uint64_t *a, const uint64_t *b, int64_t j0,
        int64_t j1, uint64_t h) {
    for (int64_t j = j0; j < j1; j++) {
        uint64_t w;
        memcpy(&w, p + 8 * j, 8);
        uint64_t x = (w ^ a[j]) * CNR_C;
        x ^= x >> 32;
        h += x * b[j];
    }
    return h;
}

/* The last partial word of a row (tail bytes, zero-padded), added into h. */
static inline __attribute__((always_inline)) uint64_t tail_sum(
        const unsigned char *p, const uint64_t *a, const uint64_t *b, int64_t full,
        int64_t tail, uint64_t h) {
    if (tail) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * full, (size_t)tail);
        uint64_t x = (w ^ a[full]) * CNR_C;
        x ^= x >> 32;
        h += x * b[full];
    }
    return h;
}

/* A long row's sum (nbytes > CNR_PF_BYTES): block by block, each block prefetching the one
 * CNR_PF_BYTES ahead, in this row or (near its end) in `next`, the next row (NULL: none). */
static inline __attribute__((always_inline)) uint64_t long_row_sum(
        const unsigned char *p, const unsigned char *next, const uint64_t *a,
        const uint64_t *b, int64_t full, int64_t tail) {
    const int64_t nbytes = 8 * full + tail;
    uint64_t h = 0;
    for (int64_t j0 = 0; j0 < full; j0 += CNR_PF_WORDS) {
        const int64_t ahead = 8 * j0 + CNR_PF_BYTES;  /* < 2 * nbytes */
        if (ahead < nbytes) {
            int64_t n = nbytes - ahead;
            prefetch_span(p + ahead, n < 8 * CNR_PF_WORDS ? n : 8 * CNR_PF_WORDS);
        } else if (next != NULL) {
            prefetch_span(next + (ahead - nbytes), 8 * CNR_PF_WORDS);
        }
        h = words_sum(p, a, b, j0, full - j0 > CNR_PF_WORDS ? j0 + CNR_PF_WORDS : full, h);
    }
    return tail_sum(p, a, b, full, tail, h);
}

/* Fingerprints of rows [0, rows) into out[]; with old != NULL, rows [0, compare) are also
 * checked against old[] and the ids of those that differ go to changed[] (ascending); returns
 * their count. Inlined into its two callers, so `old == NULL` is known there.
 *
 * Short rows (nbytes <= CNR_PF_BYTES) are prefetched before each row is hashed: dense rows
 * (stride == nbytes) as one run of bytes, each line once, up to CNR_PF_BYTES past the
 * row's end (`line` is the first line not yet prefetched); rows with gaps a whole row
 * `ahead` rows ahead. */
static inline __attribute__((always_inline)) int64_t fp_rows(
        const unsigned char *base, int64_t rows, int64_t stride, int64_t nbytes,
        const uint64_t *a, const uint64_t *b, uint64_t len_mix, uint64_t *out,
        const uint64_t *old, int64_t compare, int64_t *changed) {
    const int64_t full = nbytes / 8, tail = nbytes % 8;
    int64_t k = 0;
    if (nbytes > CNR_PF_BYTES) {
        for (int64_t r = 0; r < rows; r++) {
            const unsigned char *p = base + r * stride;
            uint64_t h = avalanche(long_row_sum(p, r + 1 < rows ? p + stride : NULL, a, b,
                                                full, tail) ^ len_mix);
            out[r] = h;
            if (old != NULL && r < compare && h != old[r]) changed[k++] = r;
        }
        return k;
    }
    const int dense = stride == nbytes;
    const int64_t ahead = nbytes ? (CNR_PF_BYTES + nbytes - 1) / nbytes : 0;
    uintptr_t line = (uintptr_t)base & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)base + (uintptr_t)(dense ? rows * nbytes : 0);
    for (int64_t r = 0; r < rows; r++) {
        const unsigned char *p = base + r * stride;
        if (dense) {
            uintptr_t lim = (uintptr_t)p + (uintptr_t)(nbytes + CNR_PF_BYTES);
            lim = lim < end ? lim : end;
            for (; line < lim; line += 64) __builtin_prefetch((const void *)line);
        } else if (ahead && r + ahead < rows) {
            prefetch_span(p + ahead * stride, nbytes);
        }
        uint64_t h = avalanche(tail_sum(p, a, b, full, tail, words_sum(p, a, b, 0, full, 0))
                               ^ len_mix);
        out[r] = h;
        if (old != NULL && r < compare && h != old[r]) changed[k++] = r;
    }
    return k;
}

#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void cnr_row_fingerprints(const unsigned char *base, int64_t rows, int64_t stride,
                          int64_t nbytes, const uint64_t *a, const uint64_t *b,
                          uint64_t len_mix, uint64_t *out) {
    /* rows of `nbytes` bytes, `stride` bytes apart; a and b hold ceil(nbytes / 8) keys. */
    fp_rows(base, rows, stride, nbytes, a, b, len_mix, out, NULL, 0, NULL);
}

/* cnr_row_fingerprints, with rows [0, compare) checked against old[] as they are hashed:
 * the ids (row offsets) of those that differ go to changed[] in ascending order, and their
 * count is returned. The fingerprints are written to out[] as before (the next put's base). */
#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int64_t cnr_row_fingerprints_diff(const unsigned char *base, int64_t rows, int64_t stride,
                                  int64_t nbytes, const uint64_t *a, const uint64_t *b,
                                  uint64_t len_mix, uint64_t *out, const uint64_t *old,
                                  int64_t compare, int64_t *changed) {
    return fp_rows(base, rows, stride, nbytes, a, b, len_mix, out, old, compare, changed);
}

/* The touched rows idx[0..n) (ascending, distinct) of the table at `base` (rows `stride`
 * bytes apart, `nbytes` each), hashed where they lie: fp[idx[r]] holds the row's previous
 * fingerprint on entry; where the new one differs it is written there and idx[r] goes to
 * changed[] (ascending). Returns their count. Apart (index_select of the rows, their
 * fingerprints, a gather of the old ones, the compare, index_copy_) the touched rows were
 * copied and every array written and read again in the stall of a tracker-driven put. A
 * scattered row is prefetched `ahead` rows before it is hashed, so its cache misses overlap
 * the hashing of the rows between. */
#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int64_t cnr_touched_fingerprints_diff(const unsigned char *base, int64_t stride,
                                      int64_t nbytes, const uint64_t *a, const uint64_t *b,
                                      uint64_t len_mix, const int64_t *idx, int64_t n,
                                      uint64_t *fp, int64_t *changed) {
    const int64_t full = nbytes / 8, tail = nbytes % 8;
    const int64_t ahead = nbytes ? 1 + CNR_PF_BYTES / (nbytes > 256 ? nbytes : 256) : 0;
    int64_t k = 0;
    for (int64_t r = 0; r < n; r++) {
        if (ahead && r + ahead < n)
            prefetch_span(base + idx[r + ahead] * stride, nbytes);
        const unsigned char *p = base + idx[r] * stride;
        uint64_t h = nbytes > CNR_PF_BYTES
            ? long_row_sum(p, NULL, a, b, full, tail)
            : tail_sum(p, a, b, full, tail, words_sum(p, a, b, 0, full, 0));
        h = avalanche(h ^ len_mix);
        if (h != fp[idx[r]]) {
            fp[idx[r]] = h;
            changed[k++] = idx[r];
        }
    }
    return k;
}

typedef float cnr_v4f __attribute__((vector_size(16)));
typedef int32_t cnr_v4i __attribute__((vector_size(16)));

static inline cnr_v4f cnr_pick(cnr_v4i m, cnr_v4f a, cnr_v4f b) {
    cnr_v4i ai, bi, r;
    cnr_v4f f;
    memcpy(&ai, &a, 16); memcpy(&bi, &b, 16);
    r = (ai & m) | (bi & ~m);
    memcpy(&f, &r, 16);
    return f;
}

/* cnr_encode_int8's flags of one float32 row (width >= 1) from its min/max: bit 0 a NaN or
 * +-Inf in the row, bit 1 its min/max beyond +-65504 (or NaN). Explicit 4-lane vectors:
 * gcc does not vectorize a float min/max reduction by itself (no reassociation), and the
 * scalar loop ran at a tenth of a copy. */
static inline int row_minmax(const float *p, int64_t width, float *lo_out, float *hi_out) {
    /* The row's min and max (exact: which of -0.0 and +0.0 comes out of a tie is not
     * fixed) and whether it holds a NaN (then lo/hi are unspecified). width >= 1. */
    cnr_v4f mn0, mx0, mn1, mx1;
    cnr_v4i bad = {0, 0, 0, 0};
    for (int l = 0; l < 4; l++) { mn0[l] = mx0[l] = mn1[l] = mx1[l] = p[0]; }
    int64_t j0 = 0;
    for (; j0 + 8 <= width; j0 += 8) {
        cnr_v4f v, w;
        memcpy(&v, p + j0, 16);
        memcpy(&w, p + j0 + 4, 16);
        bad |= (v != v) | (w != w);
        mn0 = cnr_pick(v < mn0, v, mn0);
        mx0 = cnr_pick(v > mx0, v, mx0);
        mn1 = cnr_pick(w < mn1, w, mn1);
        mx1 = cnr_pick(w > mx1, w, mx1);
    }
    float lo = mn0[0], hi = mx0[0];
    int nan = 0;
    for (int l = 0; l < 4; l++) {
        lo = mn0[l] < lo ? mn0[l] : lo;
        lo = mn1[l] < lo ? mn1[l] : lo;
        hi = mx0[l] > hi ? mx0[l] : hi;
        hi = mx1[l] > hi ? mx1[l] : hi;
        nan |= bad[l] != 0;
    }
    for (; j0 < width; j0++) {
        float v = p[j0];
        nan |= v != v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
    return nan;
}

static inline unsigned char row_flags(const float *p, int64_t width) {
    float lo, hi;
    int nan = row_minmax(p, width, &lo, &hi);
    unsigned char flag = 0;
    if (nan || !__builtin_isfinite(lo) || !__builtin_isfinite(hi)) flag |= 1;
    if (nan || !(lo >= -65504.0f && hi <= 65504.0f)) flag |= 2;
    return flag;
}

/* Rows idx[0..n) of the float32 table x (rows `stride` floats apart, `width` >= 1 floats
 * each) copied densely into out ([n, width]), with each row's row_flags in flags[r]. The
 * rows are copied a few at a time before they are checked: a scattered row's cache misses
 * then overlap those of the next rows (checked as it is read, each row waited for its own,
 * at half the speed of the copy alone). */
#if defined(CNR_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void cnr_gather_check_f32(const float *x, int64_t stride, const int64_t *idx, int64_t n,
                          int64_t width, float *out, unsigned char *flags) {
    const int64_t B = 32;
    for (int64_t r0 = 0; r0 < n; r0 += B) {
        int64_t r1 = r0 + B < n ? r0 + B : n;
        for (int64_t r = r0; r < r1; r++)
            memcpy(out + r * width, x + idx[r] * stride, (size_t)width * 4);
        for (int64_t r = r0; r < r1; r++)
            flags[r] = row_flags(out + r * width, width);
    }
}

/* A block's merge union after a put (core/chainpolicy.py _grow, its reference): the rows
 * that differ from the full block, ascending, with their full-block fingerprints. u/fs: the
 * union before (nu rows); rows/ofp/nfp: the rows that changed (nr, ascending) with their
 * previous and new fingerprints. A changed row already in the union leaves it when its new
 * fingerprint is its full-block one; a changed row not in it joins with its previous one.
 * One merge pass into out_u/out_f (room for nu + nr); returns the new union's length. */
int64_t cnr_grow_union(const int64_t *u, const int64_t *fs, int64_t nu, const int64_t *rows,
                       const int64_t *ofp, const int64_t *nfp, int64_t nr, int64_t *out_u,
                       int64_t *out_f) {
    int64_t i = 0, j = 0, k = 0;
    while (i < nu || j < nr) {
        if (j >= nr || (i < nu && u[i] < rows[j])) {
            out_u[k] = u[i]; out_f[k++] = fs[i++];
        } else if (i >= nu || rows[j] < u[i]) {
            out_u[k] = rows[j]; out_f[k++] = ofp[j++];
        } else {
            if (nfp[j] != fs[i]) { out_u[k] = u[i]; out_f[k++] = fs[i]; }
            i++; j++;
        }
    }
    return k;
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
        /* which of -0.0 and +0.0 comes out does not matter: offset and scale are made
         * canonical below. amin/amax propagate NaN: */
        float lo, hi;
        int nan = row_minmax(p, width, &lo, &hi);
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

/* ---- The grouped layout's row objects applied to a block (cnrstore/format/rowapply.py;
 * the reference is rowlists.apply_list_each with rowobjects.read_rows_header and
 * decode_rows_object, docs/MANIFEST.md "Row objects and list nodes"). Every object's header
 * is checked as read_rows_header checks it, against its list entry, and its ids decoded and
 * checked as decode_rows_object does (u16/u32, bitmap, Elias-Fano, Rice; spans); the
 * objects are then taken last to first, each row copied from the first object (the last in
 * list order) that holds it: each of the block's rows written once, however many copies
 * the list holds. Any object this refuses, or a row left without a copy, makes the caller
 * run the reference, which raises its own error: this may refuse more than it, never
 * less. ---- */

#define CNR_ROWS_HEAD 36

/* up to 8 bytes at p, little-endian, reading no more than avail (> 0) bytes */
static inline uint64_t load_le64(const unsigned char *p, int64_t avail) {
    uint64_t v = 0;
    if (avail >= 8) {
        memcpy(&v, p, 8);
    } else {
        for (int64_t b = 0; b < avail; b++) v |= (uint64_t)p[b] << (8 * b);
    }
    return v;
}

/* value i of `width` (<= 32) bits each, lsb first, in the section [p, p + nbytes) */
static inline uint64_t bits_value(const unsigned char *p, int64_t nbytes, int64_t i,
                                  int width) {
    if (!width) return 0;
    int64_t bit = i * width, at = bit >> 3;
    uint64_t w = load_le64(p + at, nbytes - at) >> (bit & 7);
    return w & ((1ULL << width) - 1);
}

static inline int64_t bit_length(uint64_t v) {
    return v ? 64 - __builtin_clzll(v) : 0;
}

static inline int64_t ceil8(int64_t bits) { return (bits + 7) >> 3; }

typedef struct {
    int64_t mode, elem, rated, nrows, rnb, count, start, step, cls, ids_at, body_at;
} cnr_rowhead;

/* read_rows_header's checks of payload p (len bytes): 0 and *h filled, or -1 */
static int rows_header(const unsigned char *p, int64_t len, cnr_rowhead *h) {
    if (len < CNR_ROWS_HEAD || memcmp(p, "CNRR", 4) != 0) return -1;
    int64_t ver = p[4], mode = p[5], elem = p[6], rated = p[7];
    uint32_t u;
    memcpy(&u, p + 8, 4); int64_t n = u;
    memcpy(&u, p + 12, 4); int64_t rnb = u;
    memcpy(&u, p + 16, 4); int64_t count = u;
    memcpy(&u, p + 20, 4); int64_t start = u;
    int64_t step; memcpy(&step, p + 24, 8);
    if (ver < 1 || ver > 3) return -1;
    if (mode > (ver == 1 ? 3 : ver == 2 ? 4 : 5) || rated > (ver == 1 ? 1 : ver == 2 ? 2 : 3))
        return -1;
    if (!(elem == 1 || elem == 2 || elem == 4 || elem == 8) || rnb % elem || count > n ||
        (mode == 0 && start + count > n) || (mode == 1 && n > (1 << 16)))
        return -1;
    /* count * rnb past the payload is refused by every mode's size check below */
    if (rnb && count > len / rnb) return -1;
    int64_t ids;
    if (mode == 0) {
        ids = 0;
    } else if (mode == 3) {
        ids = ceil8(n);
    } else if (mode == 4) {
        int64_t low = count ? (bit_length((uint64_t)(n / count)) - 1) : 0;
        if (low < 0) low = 0;
        int64_t up = count + ((n > 0 ? n - 1 : 0) >> low) + 1;
        ids = ceil8(count * low) + ceil8(up);
    } else if (mode == 5) {
        if (!count || len < CNR_ROWS_HEAD + 5) return -1;
        int64_t k = p[CNR_ROWS_HEAD];
        memcpy(&u, p + CNR_ROWS_HEAD + 1, 4); int64_t nup = u;
        if (k > 31 || nup < count || nup > count + ((n - count) >> k)) return -1;
        ids = 5 + ceil8(count * k) + ceil8(nup);
    } else {
        ids = count * (mode == 1 ? 2 : 4);
    }
    int64_t rates_at = CNR_ROWS_HEAD + ids, body_at;
    if (rated == 3) {
        body_at = len - count * rnb;
        if (len < rates_at + 2 || p[rates_at] + p[rates_at + 1] > 255) return -1;
        int64_t stream = body_at - rates_at - 2 - (p[rates_at + 1] + 2) / 2;
        if (stream < ceil8(count) || stream > ceil8(count * 15)) return -1;
    } else if (rated == 2) {
        if (len < rates_at + 2 || p[rates_at + 1] > 8) return -1;
        body_at = rates_at + 2 + ceil8(count * p[rates_at + 1]);
    } else {
        body_at = rates_at + (rated == 1 ? count : 0);
    }
    if (len != body_at + count * rnb) return -1;
    h->mode = mode; h->elem = elem; h->rated = rated; h->nrows = n; h->rnb = rnb;
    h->count = count; h->start = start; h->step = step; h->cls = p[32];
    h->ids_at = CNR_ROWS_HEAD; h->body_at = body_at;
    return 0;
}

/* the ids of bitmap `up` (nbits bits, lsb first, pad bits not read past nbytes) in
 * order, each as (position of its set bit): calls emit via the ids array. Returns the
 * number of set bits among the first nbits, writing at most max of them. */
static int64_t set_bits(const unsigned char *up, int64_t nbytes, int64_t nbits,
                        int64_t *pos, int64_t max) {
    int64_t found = 0;
    for (int64_t b = 0; b < nbytes; b += 8) {
        uint64_t w = load_le64(up + b, nbytes - b);
        int64_t left = nbits - 8 * b;
        if (left <= 0) break;
        if (left < 64) w &= (1ULL << left) - 1;
        while (w) {
            if (found < max) pos[found] = 8 * b + __builtin_ctzll(w);
            found++;
            w &= w - 1;
        }
    }
    return found;
}

/* the row ids of object p (header h) into ids[0..count): 0, or -1 where
 * decode_rows_object refuses them */
static int rows_ids(const unsigned char *p, int64_t len, const cnr_rowhead *h, int64_t *ids) {
    int64_t n = h->nrows, count = h->count;
    const unsigned char *q = p + h->ids_at;
    int64_t avail = len - h->ids_at;
    if (h->mode == 0) {
        for (int64_t i = 0; i < count; i++) ids[i] = h->start + i;
        return 0;
    }
    if (h->mode == 1 || h->mode == 2) {
        int64_t prev = -1;
        for (int64_t i = 0; i < count; i++) {
            int64_t v;
            if (h->mode == 1) { uint16_t s; memcpy(&s, q + 2 * i, 2); v = s; }
            else { uint32_t s; memcpy(&s, q + 4 * i, 4); v = s; }
            if (v <= prev || v >= n) return -1;
            ids[i] = prev = v;
        }
        return 0;
    }
    if (h->mode == 3) {
        return set_bits(q, ceil8(n), n, ids, count) == count ? 0 : -1;
    }
    if (h->mode == 4) {
        int64_t low = count ? (bit_length((uint64_t)(n / count)) - 1) : 0;
        if (low < 0) low = 0;
        int64_t nlow = ceil8(count * low), nup = count + ((n > 0 ? n - 1 : 0) >> low) + 1;
        const unsigned char *up = q + nlow;
        int64_t nupb = ceil8(nup);
        if ((nup & 7) && (up[nupb - 1] >> (nup & 7))) return -1;  /* a pad bit set */
        if (set_bits(up, nupb, nup, ids, count) != count) return -1;
        int64_t prev = -1;
        for (int64_t i = 0; i < count; i++) {
            int64_t v = ((ids[i] - i) << low) | (int64_t)bits_value(q, avail, i, (int)low);
            if (v <= prev || v >= n) return -1;
            ids[i] = prev = v;
        }
        return 0;
    }
    /* Rice: k, the unary part's bit count, the low bits, the unary part */
    int64_t k = q[0];
    uint32_t u; memcpy(&u, q + 1, 4);
    int64_t nup = u, nlow = ceil8(count * k), nupb = ceil8(nup);
    const unsigned char *lowp = q + 5, *up = lowp + nlow;
    if ((nup & 7) && (up[nupb - 1] >> (nup & 7))) return -1;  /* a pad bit set */
    if (!((up[(nup - 1) >> 3] >> ((nup - 1) & 7)) & 1)) return -1;  /* ends in a zero */
    int64_t found = 0, end = -1, id = -1;
    for (int64_t b = 0; b < nupb; b += 8) {
        uint64_t w = load_le64(up + b, nupb - b);
        while (w) {
            int64_t at = 8 * b + __builtin_ctzll(w);
            w &= w - 1;
            if (found >= count) return -1;
            int64_t gap = ((at - end - 1) << k) |
                          (int64_t)bits_value(lowp, avail - 5, found, (int)k);
            end = at;
            id += gap + 1;
            if (id >= n) return -1;
            ids[found++] = id;
        }
    }
    return found == count ? 0 : -1;
}

/* Apply nobj row objects (payloads obj[k] of len[k] bytes, in list order, each to match
 * its entry's count, class and step) to a block of nrows rows of rnb bytes at dst:
 * returns 0; -1 - k where object k is refused; or the count of rows no object holds.
 * covered (nrows zero bytes) and ids (room for the largest count) are the caller's
 * scratch. */
int64_t cnr_apply_rows(const unsigned char *const *obj, const int64_t *len, int64_t nobj,
                       const int64_t *want_count, const int64_t *want_cls,
                       const int64_t *want_step, int64_t nrows, int64_t rnb,
                       unsigned char *dst, unsigned char *covered, int64_t *ids) {
    int64_t left = nrows;
    for (int64_t k = nobj - 1; k >= 0; k--) {
        const unsigned char *p = obj[k];
        cnr_rowhead h;
        if (rows_header(p, len[k], &h) != 0 || h.nrows != nrows || h.rnb != rnb ||
            h.count != want_count[k] || h.cls != want_cls[k] || h.step != want_step[k] ||
            rows_ids(p, len[k], &h, ids) != 0)
            return -1 - k;
        const unsigned char *body = p + h.body_at;
        int64_t per = rnb / h.elem, plane = h.count * per;
        for (int64_t i = 0; i < h.count; i++) {
            int64_t r = ids[i];
            if (covered[r]) continue;
            covered[r] = 1;
            left--;
            unsigned char *d = dst + r * rnb;
            if (h.elem == 1) {
                memcpy(d, body + i * rnb, (size_t)rnb);
            } else {
                for (int64_t b = 0; b < h.elem; b++) {
                    const unsigned char *s = body + b * plane + i * per;
                    for (int64_t j = 0; j < per; j++) d[j * h.elem + b] = s[j];
                }
            }
        }
    }
    return left;
}
