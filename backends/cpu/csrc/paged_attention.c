/* Paged attention kernels for the cpu backend, part of its one native library (native_ops.py): the
 * ps_* entry points with C linkage through csrc/paged_attention_abi.cpp, called with ctypes
 * (portside.backends.cpu.kernels), and the kernels' pieces inside csrc/decode_attention.cpp and
 * csrc/fused_decode.cpp. Each includes this file as C++: keep it valid in both languages.
 *
 * Plain C, no torch headers. Cache layout of one layer (the canonical one):
 *     kv_cache[2][num_blocks][block_size][num_kv_heads][head_size]
 * so key row (slot, kv_head) starts at ((slot * num_kv_heads) + kv_head) * head_size of plane 0,
 * where slot = block * block_size + offset; plane 1 holds the values. Queries and outputs are
 * fp32 (queries bf16 too for the AVX-512 bf16 kernel: `paged_decode`'s q_bf16), new K/V fp32 (bf16
 * too for a bf16 cache); the cache is fp32 (`ps_*_f32`), 8-bit
 * (`ps_*_q8`, formats PS_KV_*, as portside.backend_api.quantize_kv stores them: one byte a value,
 * and for int8 each (token, KV head) row's fp32 scale after its head_size values) or bf16
 * (`ps_paged_decode_q8` with PS_KV_BF16, `ps_write_kv_bf16`: a bf16 model's cache, read as fp32 by
 * a 16-bit shift, attended in fp32).
 *
 * Built with -O3 -march=native -fopenmp: the inner loops over head_size are `omp simd` so the
 * compiler vectorizes them; (sequence, 128-token split) tasks are spread over OpenMP threads.
 *
 * Every entry point returns 0 on success or a PS_ERR_* code; nothing is written past the
 * buffers described by its size arguments.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h> /* the 8-bit loads (raw8); C++ includers include it before their namespace */
#define PS_X86_LOADS 1
#endif

#define PS_OK 0
#define PS_ERR_BLOCK 1   /* a block id outside [0, num_blocks) */
#define PS_ERR_NOMEM 2   /* scratch allocation failed */
#define PS_ERR_LEN 3     /* a seq_len larger than its block-table row can hold */
#define PS_ERR_SLOT 4    /* a slot >= num_blocks * block_size */
#define PS_ERR_FORMAT 5  /* an unknown 8-bit cache format */

/* Cache formats: fp32, or one of the 8-bit ones of portside.backend_api.quantize_kv. */
#define PS_KV_F32 0
#define PS_KV_INT8 1 /* int8 values, then the row's fp32 scale (value = int8 * scale) */
#define PS_KV_E4M3 2 /* OCP float8 e4m3fn, saturated to +-448 */
#define PS_KV_E5M2 3 /* OCP float8 e5m2, saturated to +-57344 */
#define PS_KV_BF16 4 /* bfloat16 (a bf16 model's cache, kv_cache_dtype auto): 2 bytes a value, no scale */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Sequences longer than this are attended in splits of this many tokens, one task each, then
 * merged. Measured on the CI machine's Zen 4 (2 threads, 9 query / 3 KV heads, D 64, 30 layer
 * caches, 14 MB of weights streamed between calls as in a decode step), per call: batch 1 x 256
 * tokens 64.5 -> 42.9 us (one task per KV head before: 3 tasks on 2 threads, each walking every
 * page), 1 x 1024 tokens 146 -> 81 us; batch 64 x 256 unchanged (1215 -> 1169 us); splits of 64
 * tokens were no faster at batch 1 and 6% slower at batch 64. */
#ifndef SPLIT_TOKENS
#define SPLIT_TOKENS 128
#endif
#ifndef PREFETCH_TOKENS
#define PREFETCH_TOKENS 4
#endif
/* While pass 1 reads token t's key row it prefetches the key and the value rows of token
 * t + PREFETCH_TOKENS (block ids come from the table, so rows past a block boundary are found
 * too): two streams in flight instead of one, and pass 2 then finds a sequence's values (~150 KB
 * for the default model) in L2. Measured on the CI machine's Zen 4 (64 sequences x 128-256 tokens,
 * 9 query / 3 KV heads, D 64, 30 layer caches in DRAM), per layer: whole blocks prefetched two
 * ahead in bursts 2.32 ms on 1 thread / 1.22 ms on 2 (no better than none); one key row 8 tokens
 * ahead in each pass 2.00 / 1.08; keys and values 4 tokens ahead in pass 1 1.67 / 0.88. */

/* Prefetch one cache row of `width` floats. */
ALWAYS_INLINE void prefetch_row(const float *p, int64_t width) {
    for (int64_t d = 0; d < width; d += 16) __builtin_prefetch(p + d, 0, 3);
}

/* Shapes and strides of one decode call (element strides, innermost dim contiguous). */
typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_size;
    int64_t num_blocks, block_size, max_blocks;
    int64_t q_stride_tok, q_stride_head;     /* query [num_seqs, num_heads, head_size] */
    int64_t out_stride_tok, out_stride_head; /* out, same shape */
    int64_t table_stride;                    /* block_tables row stride */
    float scale;
    float softcap;  /* > 0: scores -> softcap * tanh(scores / softcap) before the softmax (0: none) */
    int64_t window; /* > 0: a query at position p sees keys p - window < k <= p (0: every key) */
    int q_bf16;     /* the queries are bf16 (decode_range_bf16 only: bf16_queries), else fp32 */
    const float *sinks; /* [num_heads] attention sinks (gpt-oss): one more logit in each head's softmax
                         * denominator, no value (NULL: none; last, so C++ initialisers may omit it) */
} decode_shape;

/* Row r's sink share of its softmax denominator, in units of its numerators e^(s - m): e^(sink_r - m). */
ALWAYS_INLINE float sink_share(const decode_shape *sh, int64_t r, float m) {
    return sh->sinks ? expf(sh->sinks[r] - m) : 0.0f;
}

/* GNU C vector types (gcc, clang): the compiler lowers them to whatever SIMD the target has. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

ALWAYS_INLINE v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* Without AVX-512 a v16f is two ymm registers, and GCC kept such accumulators in memory (stored
 * and reloaded in 8-byte pieces every iteration, as in row_dot.h). There the 16-lane sums below
 * are spelled as pairs of v8f (one register each): the same operations lane by lane, so the same
 * results bit for bit. */
#if !defined(__AVX512F__)
#define PS_V8_PAIRS 1
#endif

ALWAYS_INLINE v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

ALWAYS_INLINE float hsum8x2(const v8f lo, const v8f hi) { /* halving tree: no chain of 16 scalar adds */
    const v8f s8 = lo + hi;
    v4f a, b;
    memcpy(&a, &s8, sizeof a);
    memcpy(&b, (const char *)&s8 + sizeof a, sizeof b);
    const v4f s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

ALWAYS_INLINE float hsum16(v16f v) {
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    return hsum8x2(lo, hi);
}

/* a . b over n floats: 16-lane partial sums, then one tree reduction (n % 16 == 0), else a
 * plain simd loop. */
ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, const int64_t n) {
    if (n % 16 == 0) {
#ifdef PS_V8_PAIRS
        v8f lo = {0}, hi = {0};
        for (int64_t c = 0; c < n; c += 16) {
            lo += load8f(a + c) * load8f(b + c);
            hi += load8f(a + c + 8) * load8f(b + c + 8);
        }
        return hsum8x2(lo, hi);
#else
        v16f acc = {0};
        for (int64_t c = 0; c < n; c += 16) acc += load16(a + c) * load16(b + c);
        return hsum16(acc);
#endif
    }
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* exp(x) for x <= 0 (softmax numerators after max subtraction), vectorizable (libm's expf is
 * not without -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
 * polynomial (relative error ~1e-7), times 2^n built in the exponent bits. Below -87 it
 * clamps (exp(-87) ~ 1.6e-38: negligible next to the max term, which is 1). */
ALWAYS_INLINE float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest (1.5 * 2^23) */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 split: hi + lo */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* tanh(x), vectorizable (libm's tanhf is not without -ffast-math), relative error ~1e-7: cephes'
 * odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) (no cancellation there), sign
 * restored. */
ALWAYS_INLINE float tanh_f32(const float x) {
    const float a = fabsf(x), z = x * x;
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                          1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    const float e = exp_nonpos(-2.0f * a); /* e^-2|x| in (0, 1] */
    const float large = (1.0f - e) / (1.0f + e);
    return a < 0.625f ? small : (x < 0.0f ? -large : large);
}

/* ---- 8-bit caches ---------------------------------------------------------------------------
 * A row's values are read as "raw" fp32 numbers times a row factor: int8 -> the int8 value, times
 * the row's scale; e5m2 -> its value, times 1; e4m3 -> its value / 256, times 256 (its bits
 * placed in an fp16's, which F16C converts 8 at a time: the sign, then the exponent and mantissa
 * one bit lower, i.e. an fp16 of exponent bias 15 holding a bias-7 number: exact, subnormals
 * included). e4m3fn's NaN (0x7f / 0xff) is never stored: writes saturate. */

typedef int32_t v8i __attribute__((vector_size(32)));

/* One raw value (scalar; the tails of head sizes that are not a multiple of 8, and CPUs without
 * AVX2/F16C). */
ALWAYS_INLINE float raw1(const uint8_t b, const int fmt) {
    if (fmt == PS_KV_INT8) return (float)(int8_t)b;
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    if (fmt == PS_KV_E5M2) {
        const int e = (b >> 2) & 31, m = b & 3;
        return sign * (e ? ldexpf(1.0f + m * 0.25f, e - 15) : ldexpf((float)m, -16));
    }
    const int e = (b >> 3) & 15, m = b & 7; /* e4m3, / 256 */
    return sign * (e ? ldexpf(1.0f + m * 0.125f, e - 15) : ldexpf((float)m, -17));
}

/* Eight raw values from p. */
ALWAYS_INLINE v8f raw8(const uint8_t *p, const int fmt) {
#ifdef PS_X86_LOADS
    const __m128i x = _mm_loadl_epi64((const __m128i *)p);
    if (fmt == PS_KV_INT8) return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), x); /* each byte in the high half of a 16-bit lane */
    if (fmt == PS_KV_E4M3) /* s eeee mmm 0^8 -> s 0 eeee mmm 0^7: shift right one keeping the sign, clear bit 14 */
        h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xBFFF));
    return (v8f)_mm256_cvtph_ps(h);
#else
    v8f r;
    for (int i = 0; i < 8; ++i) r[i] = raw1(p[i], fmt);
    return r;
#endif
}

/* bf16 -> fp32: the 16 bits are the high half of the fp32 (exact). */
ALWAYS_INLINE float bf16_to_f32(const uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even (torch's conversion, c10::round_to_nearest_even; NaN -> a quiet NaN). */
ALWAYS_INLINE uint16_t f32_to_bf16(const float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Eight bf16 values from p as fp32: zero-extend each to 32 bits, shift it into the high half. */
ALWAYS_INLINE v8f bf16x8(const uint16_t *p) {
#ifdef PS_X86_LOADS
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    v8f r;
    for (int i = 0; i < 8; ++i) r[i] = bf16_to_f32(p[i]);
    return r;
#endif
}

/* n heads' rows of an 8-bit or bf16 cache (rb bytes each, from src) -> dst [n][D] fp32 values. */
ALWAYS_INLINE void dequant_heads(float *restrict dst, const uint8_t *src, const int64_t n, const int64_t D,
                                 const int64_t rb, const int fmt) {
    if (fmt == PS_KV_BF16) { /* rb == 2 D: the n rows are one run of n D values */
        const uint16_t *s = (const uint16_t *)src;
        int64_t c = 0;
        for (; c + 8 <= n * D; c += 8) {
            const v8f r = bf16x8(s + c);
            memcpy(dst + c, &r, sizeof r);
        }
        for (; c < n * D; ++c) dst[c] = bf16_to_f32(s[c]);
        return;
    }
    for (int64_t h = 0; h < n; ++h) {
        const uint8_t *row = src + h * rb;
        float f = fmt == PS_KV_E4M3 ? 256.0f : 1.0f;
        if (fmt == PS_KV_INT8) memcpy(&f, row + D, sizeof f);
        float *o = dst + h * D;
        int64_t c = 0;
        for (; c + 8 <= D; c += 8) {
            const v8f r = raw8(row + c, fmt) * f;
            memcpy(o + c, &r, sizeof r);
        }
        for (; c < D; ++c) o[c] = raw1(row[c], fmt) * f;
    }
}

ALWAYS_INLINE uint32_t f32_bits(const float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

ALWAYS_INLINE float f32_from_bits(const uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> OCP float8, saturating, round to nearest even: torch's conversion (c10's
 * fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value) after clamping to the format's range.
 * `mbits` mantissa bits, `bias` exponent bias, smallest normal exponent 1 - bias. */
ALWAYS_INLINE uint8_t to_fp8(float f, const float fmax, const int mbits, const int bias) {
    f = f > fmax ? fmax : (f < -fmax ? -fmax : f);
    uint32_t bits = f32_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t r;
    if (bits < (uint32_t)(127 + 1 - bias) << 23) { /* subnormal or zero: round at the subnormal step by an add */
        const uint32_t magic = (uint32_t)(127 + 23 - mbits - (bias - 1)) << 23;
        r = (uint8_t)(f32_bits(f32_from_bits(bits) + f32_from_bits(magic)) - magic);
    } else {
        const uint32_t odd = (bits >> (23 - mbits)) & 1;
        bits += ((uint32_t)(bias - 127) << 23) + ((1u << (22 - mbits)) - 1) + odd;
        r = (uint8_t)(bits >> (23 - mbits));
    }
    return r | (uint8_t)(sign >> 24);
}

/* One K or V row of D fp32 values -> its 8-bit row at dst (int8: D values, then the fp32 scale
 * amax / 127, values round(x / scale) half to even: quantize_kv's arithmetic exactly). */
ALWAYS_INLINE void quantize_row(uint8_t *restrict dst, const float *restrict x, const int64_t D, const int fmt) {
    if (fmt == PS_KV_INT8) {
        float amax = 0.0f;
        for (int64_t d = 0; d < D; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float scale = amax / 127.0f;
        for (int64_t d = 0; d < D; ++d) {
            float q = amax > 0.0f ? nearbyintf(x[d] / scale) : 0.0f;
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            dst[d] = (uint8_t)(int8_t)q;
        }
        memcpy(dst + D, &scale, sizeof scale);
    } else if (fmt == PS_KV_E4M3) {
        for (int64_t d = 0; d < D; ++d) dst[d] = to_fp8(x[d], 448.0f, 3, 7);
    } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = to_fp8(x[d], 57344.0f, 2, 15);
    }
}

/* Bytes of one (token, KV head) row of an 8-bit or bf16 cache (kv_row_bytes). */
ALWAYS_INLINE int64_t q8_row_bytes(const int64_t D, const int fmt) {
    return fmt == PS_KV_INT8 ? D + 4 : (fmt == PS_KV_BF16 ? 2 * D : D);
}

ALWAYS_INLINE void prefetch_bytes(const uint8_t *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Tokens of values dequantized at a time in decode_range_q8's pass 2 (its scratch holds them). */
#define Q8_CHUNK 16

/* scores [R][len] -> soft-capped (sh->softcap > 0), then each row's softmax numerators
 * e^(s - m_r), with m_r its max and l_r the numerators' sum. */
ALWAYS_INLINE void softmax_rows(const decode_shape *sh, float *restrict scores, const int64_t R, const int64_t len,
                                float *m_r, float *l_r) {
    if (sh->softcap > 0.0f) {
        const float cap = sh->softcap, inv_cap = 1.0f / cap;
#pragma omp simd
        for (int64_t i = 0; i < R * len; ++i) scores[i] = cap * tanh_f32(scores[i] * inv_cap);
    }
    for (int64_t r = 0; r < R; ++r) {
        float *s = scores + r * len;
        float m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
            s[t] = exp_nonpos(s[t] - m);
            total += s[t];
        }
        m_r[r] = m;
        l_r[r] = total;
    }
}

/* One sequence's tokens [t_begin, t_end), all its KV heads: its R = H query rows attend over
 * those keys. Two passes over the paged rows; each K and V row is read once for all R query rows
 * (the heads of a cache row are adjacent in memory):
 *   1. scores[r][t] = scale * q_r . k_t, soft-capped when sh->softcap > 0 (then per-row max m_r,
 *      exp, sum l_r: an exact softmax)
 *   2. acc[r] = sum_t p[r][t] * v_t
 * With `out` the result is final: out_r = acc[r] / l_r. Without (out == NULL) the range is one
 * split of a longer sequence and `part` receives acc ([R][D]), then m ([R]), then l ([R]) for
 * `merge_splits`. `scratch` holds R * (t_end - t_begin) scores + R * D scaled queries. The
 * caller has checked every block id. D is a compile-time constant in the specialised callers. */
ALWAYS_INLINE void decode_range(const decode_shape *sh, float *out, float *part, const float *q, const float *kv,
                                const int32_t *table, int64_t t_begin, int64_t t_end, float *restrict scratch,
                                const int64_t D) {
    const int64_t G = sh->num_heads / sh->num_kv_heads, R = sh->num_heads;
    const int64_t BS = sh->block_size, row = sh->num_kv_heads * D; /* floats per cache row */
    const float *k_plane = kv, *v_plane = kv + sh->num_blocks * BS * row;
    const int64_t len = t_end - t_begin;
    float *restrict scores = scratch;        /* [R][len] */
    float *restrict qs = scores + R * len;   /* [R][D]: scale * q */
    float *restrict acc = part ? part : qs + R * D; /* [R][D] (the caller sized scratch for it) */

    for (int64_t r = 0; r < R; ++r) {
        const float *qr = q + r * sh->q_stride_head;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qr[d] * sh->scale;
    }
    for (int64_t t = t_begin; t < t_begin + PREFETCH_TOKENS && t < t_end; ++t) {
        const int64_t off = (table[t / BS] * BS + t % BS) * row;
        prefetch_row(k_plane + off, row);
        prefetch_row(v_plane + off, row);
    }
    /* pass 1: scores */
    for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t ahead = t + PREFETCH_TOKENS;
        if (ahead < t_end) {
            const int64_t off = (table[ahead / BS] * BS + ahead % BS) * row;
            prefetch_row(k_plane + off, row);
            prefetch_row(v_plane + off, row);
        }
        const float *k = k_plane + (table[t / BS] * BS + t % BS) * row;
        for (int64_t r = 0; r < R; ++r) scores[r * len + t - t_begin] = dot(qs + r * D, k + (r / G) * D, D);
    }
    /* softmax numerators, max-subtracted; acc zeroed */
    float m_r[R], l_r[R];
    softmax_rows(sh, scores, R, len, m_r, l_r);
    for (int64_t r = 0; r < R; ++r)
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
    /* pass 2: weighted sum of values, a block's piece of the range at a time */
    for (int64_t t0 = t_begin; t0 < t_end;) {
        const int64_t in_blk = t0 % BS, n = (t_end - t0 < BS - in_blk) ? t_end - t0 : BS - in_blk;
        const float *v = v_plane + (table[t0 / BS] * BS + in_blk) * row;
        for (int64_t r = 0; r < R; ++r) { /* row r's accumulator stays in registers over the piece */
            const float *p = scores + r * len + (t0 - t_begin), *vr = v + (r / G) * D;
            float *restrict a = acc + r * D;
            if (D % 16 == 0 && D <= 256) {
#ifdef PS_V8_PAIRS
                v8f a8[D % 16 == 0 && D <= 256 ? D / 8 : 1];
                for (int64_t c = 0; c < D / 8; ++c) a8[c] = load8f(a + 8 * c);
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t c = 0; c < D / 8; ++c) a8[c] += p[j] * load8f(vr + j * row + 8 * c);
                memcpy(a, a8, D * sizeof(float));
#else
                v16f a16[D % 16 == 0 && D <= 256 ? D / 16 : 1];
                for (int64_t c = 0; c < D / 16; ++c) a16[c] = load16(a + 16 * c);
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t c = 0; c < D / 16; ++c) a16[c] += p[j] * load16(vr + j * row + 16 * c);
                memcpy(a, a16, D * sizeof(float));
#endif
            } else {
                for (int64_t j = 0; j < n; ++j)
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) a[d] += p[j] * vr[j * row + d];
            }
        }
        t0 += n;
    }
    if (part) {
        memcpy(part + R * D, m_r, R * sizeof(float));
        memcpy(part + R * D + R, l_r, R * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < R; ++r) {
        float *o = out + r * sh->out_stride_head;
        const float inv = 1.0f / (l_r[r] + sink_share(sh, r, m_r[r]));
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    }
}

static void decode_range_any(const decode_shape *sh, float *out, float *part, const float *q, const float *kv,
                             const int32_t *table, int64_t t_begin, int64_t t_end, float *scratch) {
    switch (sh->head_size) { /* constant D: fully unrolled, vectorized dot products */
    case 64: decode_range(sh, out, part, q, kv, table, t_begin, t_end, scratch, 64); break;
    case 128: decode_range(sh, out, part, q, kv, table, t_begin, t_end, scratch, 128); break;
    case 256: decode_range(sh, out, part, q, kv, table, t_begin, t_end, scratch, 256); break;
    default: decode_range(sh, out, part, q, kv, table, t_begin, t_end, scratch, sh->head_size);
    }
}

/* `decode_range` over an 8-bit or bf16 cache (format `fmt`): each token's key rows are converted to
 * fp32 (8-bit: scales applied; bf16: a 16-bit shift) before its dot products, and values Q8_CHUNK tokens at a time before the
 * weighted sum, so every query head of a KV head uses one conversion; the rest is decode_range's
 * arithmetic. Scratch: decode_range's, then (1 + Q8_CHUNK) * num_kv_heads * D floats. */
ALWAYS_INLINE void decode_range_q8(const decode_shape *sh, float *out, float *part, const float *q, const uint8_t *kv,
                                   const int32_t *table, int64_t t_begin, int64_t t_end, float *restrict scratch,
                                   const int64_t D, const int fmt) {
    const int64_t G = sh->num_heads / sh->num_kv_heads, R = sh->num_heads, KVH = sh->num_kv_heads;
    const int64_t BS = sh->block_size, rb = q8_row_bytes(D, fmt), row = KVH * rb; /* bytes per cache row */
    const uint8_t *k_plane = kv, *v_plane = kv + sh->num_blocks * BS * row;
    const int64_t len = t_end - t_begin, frow = KVH * D; /* floats per dequantized row */
    float *restrict scores = scratch;       /* [R][len] */
    float *restrict qs = scores + R * len;  /* [R][D]: scale * q */
    float *restrict acc = qs + R * D;       /* [R][D] (part's, when given) */
    float *restrict kf = acc + R * D;       /* [KVH * D]: one token's keys */
    float *restrict vf = kf + frow;         /* [Q8_CHUNK][KVH * D]: values */
    if (part) acc = part;

    for (int64_t r = 0; r < R; ++r) {
        const float *qr = q + r * sh->q_stride_head;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qr[d] * sh->scale;
    }
    for (int64_t t = t_begin; t < t_begin + PREFETCH_TOKENS && t < t_end; ++t) {
        const int64_t off = (table[t / BS] * BS + t % BS) * row;
        prefetch_bytes(k_plane + off, row);
        prefetch_bytes(v_plane + off, row);
    }
    /* pass 1: scores */
    for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t ahead = t + PREFETCH_TOKENS;
        if (ahead < t_end) {
            const int64_t off = (table[ahead / BS] * BS + ahead % BS) * row;
            prefetch_bytes(k_plane + off, row);
            prefetch_bytes(v_plane + off, row);
        }
        dequant_heads(kf, k_plane + (table[t / BS] * BS + t % BS) * row, KVH, D, rb, fmt);
        for (int64_t r = 0; r < R; ++r) scores[r * len + t - t_begin] = dot(qs + r * D, kf + (r / G) * D, D);
    }
    float m_r[R], l_r[R];
    softmax_rows(sh, scores, R, len, m_r, l_r);
    for (int64_t r = 0; r < R; ++r)
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
    /* pass 2: values, up to Q8_CHUNK tokens of one block at a time */
    for (int64_t t0 = t_begin; t0 < t_end;) {
        const int64_t in_blk = t0 % BS, left = BS - in_blk < t_end - t0 ? BS - in_blk : t_end - t0;
        const int64_t n = left < Q8_CHUNK ? left : Q8_CHUNK;
        dequant_heads(vf, v_plane + (table[t0 / BS] * BS + in_blk) * row, n * KVH, D, rb, fmt); /* rows are adjacent */
        for (int64_t r = 0; r < R; ++r) {
            const float *p = scores + r * len + (t0 - t_begin), *vr = vf + (r / G) * D;
            float *restrict a = acc + r * D;
            if (D % 16 == 0 && D <= 256) {
#ifdef PS_V8_PAIRS
                v8f a8[D % 16 == 0 && D <= 256 ? D / 8 : 1];
                for (int64_t c = 0; c < D / 8; ++c) a8[c] = load8f(a + 8 * c);
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t c = 0; c < D / 8; ++c) a8[c] += p[j] * load8f(vr + j * frow + 8 * c);
                memcpy(a, a8, D * sizeof(float));
#else
                v16f a16[D % 16 == 0 && D <= 256 ? D / 16 : 1];
                for (int64_t c = 0; c < D / 16; ++c) a16[c] = load16(a + 16 * c);
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t c = 0; c < D / 16; ++c) a16[c] += p[j] * load16(vr + j * frow + 16 * c);
                memcpy(a, a16, D * sizeof(float));
#endif
            } else {
                for (int64_t j = 0; j < n; ++j)
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) a[d] += p[j] * vr[j * frow + d];
            }
        }
        t0 += n;
    }
    if (part) {
        memcpy(part + R * D, m_r, R * sizeof(float));
        memcpy(part + R * D + R, l_r, R * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < R; ++r) {
        float *o = out + r * sh->out_stride_head;
        const float inv = 1.0f / (l_r[r] + sink_share(sh, r, m_r[r]));
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    }
}

#define Q8_CASE(FMT)                                                                                                 \
    switch (sh->head_size) {                                                                                         \
    case 64: decode_range_q8(sh, out, part, q, kv, table, t_begin, t_end, scratch, 64, FMT); break;                  \
    case 128: decode_range_q8(sh, out, part, q, kv, table, t_begin, t_end, scratch, 128, FMT); break;                \
    default: decode_range_q8(sh, out, part, q, kv, table, t_begin, t_end, scratch, sh->head_size, FMT);              \
    }

#if defined(__AVX512F__) && defined(PS_X86_LOADS)
#define PS_BF16_EVEN_ODD 1
/* `decode_range` over a bf16 cache on AVX-512, head sizes a multiple of 32 up to 256, queries fp32
 * or (sh->q_bf16) bf16. Both passes walk the tokens in the outer loop, so the rows fetched from
 * memory (K and V of the token PREFETCH_TILE ahead, prefetched as pass 1 goes) arrive while the
 * heads' arithmetic runs, not in a burst for the first head:
 *   1. scores, 16 tokens at a time: each token's key row against every query head's chunks (heads
 *      in register groups), one 16-lane partial sum per (head, token) kept in `sums`, reduced 16 at
 *      a time by one transposing tree (`hsum16x16`) and scaled;
 *   2. values, KV head by KV head: each value row widened once for the query heads of its group.
 * Scores with AVX512-BF16 (`vdpbf16ps`: bf16 pairs, fp32 products and sums) on the query split
 * into a bf16 part and, when it is not exactly bf16 (an fp32 model's queries), the bf16 rounding
 * of the rest, so the products are those of the fp32 query to ~2^-16; without it each 64-byte key
 * load is widened without a shuffle (odd values are the high halves of their 32-bit lanes, masked;
 * even ones shifted up) against the query split into even and odd lanes. Values are widened so and
 * summed in fp32 registers, then merged back into head order once. No converted copies of K or V. */
ALWAYS_INLINE __m512 bf16_even(const __m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
ALWAYS_INLINE __m512 bf16_odd(const __m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }

/* Lane j: the sum of s[j]'s 16 lanes. */
ALWAYS_INLINE __m512 hsum16x16(const __m512 *s) {
    __m512 a[8], b[4], c[2];
    for (int k = 0; k < 8; ++k)
        a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; ++k)
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)
        c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), t);
}

/* 32 query values in the form the key products take (see above). */
#ifdef __AVX512BF16__
typedef struct {
    __m512bh hi, lo;
} qchunk;
#define QCHUNK_REGS(LO) ((LO) ? 2 : 1)
ALWAYS_INLINE qchunk qchunk_f32(const float *x) {
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    qchunk q;
    q.hi = _mm512_cvtne2ps_pbh(x1, x0);
    const __m512i h = (__m512i)q.hi;
    const __m512 r0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
    const __m512 r1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
    q.lo = _mm512_cvtne2ps_pbh(r1, r0);
    return q;
}
ALWAYS_INLINE qchunk qchunk_bf16(const uint16_t *x) {
    qchunk q;
    q.hi = (__m512bh)_mm512_loadu_si512(x);
    q.lo = (__m512bh)_mm512_setzero_si512();
    return q;
}
ALWAYS_INLINE int qchunk_exact(const qchunk q) { return _mm512_test_epi32_mask((__m512i)q.lo, (__m512i)q.lo) == 0; }
ALWAYS_INLINE __m512 qk_chunk(const __m512 acc, const qchunk q, const uint16_t *k, const int LO) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(k);
    const __m512 s = _mm512_dpbf16_ps(acc, q.hi, w);
    return LO ? _mm512_dpbf16_ps(s, q.lo, w) : s;
}
#else
typedef struct {
    __m512 e, o;
} qchunk;
#define QCHUNK_REGS(LO) 2
ALWAYS_INLINE qchunk qchunk_f32(const float *x) {
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    qchunk q;
    q.e = _mm512_permutex2var_ps(x0, ie, x1);
    q.o = _mm512_permutex2var_ps(x0, io, x1);
    return q;
}
ALWAYS_INLINE qchunk qchunk_bf16(const uint16_t *x) {
    const __m512i w = _mm512_loadu_si512(x);
    qchunk q;
    q.e = bf16_even(w);
    q.o = bf16_odd(w);
    return q;
}
ALWAYS_INLINE int qchunk_exact(const qchunk q) { return 1; }
ALWAYS_INLINE __m512 qk_chunk(const __m512 acc, const qchunk q, const uint16_t *k, const int LO) {
    const __m512i w = _mm512_loadu_si512(k);
    return _mm512_fmadd_ps(q.o, bf16_odd(w), _mm512_fmadd_ps(q.e, bf16_even(w), acc));
}
#endif

/* Tokens a row prefetch runs ahead in pass 1 (keys and values of token t + PREFETCH_TILE). */
#ifndef PREFETCH_TILE
#define PREFETCH_TILE 16
#endif

/* Prefetch the key and the value row (`row` bf16 values each) of the token at `off`. */
ALWAYS_INLINE void prefetch_kv(const uint16_t *k_plane, const uint16_t *v_plane, const int64_t off, const int64_t row) {
    prefetch_bytes((const uint8_t *)(k_plane + off), 2 * row);
    prefetch_bytes((const uint8_t *)(v_plane + off), 2 * row);
}

/* Query heads a pass-1 group holds in registers (their chunks and one sum each: <= 24 zmm). */
ALWAYS_INLINE int64_t group_heads(const int64_t D, const int LO) {
    const int64_t n = 24 / (D / 32 * QCHUNK_REGS(LO) + 1);
    return n < 1 ? 1 : (n > 8 ? 8 : n);
}

/* Pass 1 for heads [r0, r0 + nb) of tokens [t0, t0 + n): `sums[r * 16 + j]`, token t0 + j's partial sums. */
ALWAYS_INLINE void score_group(const qchunk *qv, const uint16_t *k_plane, const uint16_t *v_plane, const int64_t *off,
                               int64_t t0, int64_t n, int64_t len, int64_t r0, int64_t nb, int64_t G, int64_t row,
                               __m512 *sums, const int64_t D, const int RB, const int LO, const int prefetch) {
    const int64_t C = D / 32;
    qchunk q[8][8]; /* [RB][C], in registers once unrolled */
    int64_t kh[8];  /* each head's key within a cache row */
    for (int b = 0; b < RB; ++b)
        if (b < nb) {
            for (int64_t c = 0; c < C; ++c) q[b][c] = qv[(r0 + b) * C + c];
            kh[b] = (r0 + b) / G * D;
        }
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        if (prefetch && t + PREFETCH_TILE < len) prefetch_kv(k_plane, v_plane, off[t + PREFETCH_TILE], row);
        const uint16_t *kr = k_plane + off[t];
        for (int b = 0; b < RB; ++b) {
            if (b >= nb) break;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; ++c) acc = qk_chunk(acc, q[b][c], kr + kh[b] + 32 * c, LO);
            sums[(r0 + b) * 16 + j] = acc;
        }
    }
}

ALWAYS_INLINE void decode_range_bf16(const decode_shape *sh, float *out, float *part, const float *q, const uint8_t *kv,
                                     const int32_t *table, int64_t t_begin, int64_t t_end, const int64_t D) {
    const int64_t G = sh->num_heads / sh->num_kv_heads, R = sh->num_heads, KVH = sh->num_kv_heads;
    const int64_t BS = sh->block_size, row = KVH * D, C = D / 32; /* bf16 values a cache row; chunks a head */
    const uint16_t *k_plane = (const uint16_t *)kv, *v_plane = k_plane + sh->num_blocks * BS * row;
    const int64_t len = t_end - t_begin;
    float scores[R * len];  /* [R][len] */
    int64_t off[len];       /* each token's cache row (values from the plane's start) */
    __m512 sums[R * 16];    /* pass 1's partial sums of 16 tokens */
    qchunk qv[R * C];       /* the queries, chunk by chunk */
    for (int64_t t = 0, blk = t_begin / BS, i = t_begin % BS; t < len; ++t) { /* no division a token */
        off[t] = (table[blk] * BS + i) * row;
        if (++i == BS) i = 0, ++blk;
    }
    for (int64_t t = 0; t < PREFETCH_TILE && t < len; ++t) prefetch_kv(k_plane, v_plane, off[t], row);
    int exact = 1;
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
            qchunk *x = qv + r * C + c;
            if (sh->q_bf16) {
                *x = qchunk_bf16((const uint16_t *)q + r * sh->q_stride_head + 32 * c);
            } else {
                *x = qchunk_f32(q + r * sh->q_stride_head + 32 * c);
                exact &= qchunk_exact(*x);
            }
        }
    /* pass 1: scores, the heads in as few register groups as fit, of near-equal size */
    const __m512 scale = _mm512_set1_ps(sh->scale);
    const int64_t rb_max = group_heads(D, !exact), groups = (R + rb_max - 1) / rb_max, rb = (R + groups - 1) / groups;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        for (int64_t r = 0; r < R; ++r) /* a last tile's unused sums: zeros, not stale values */
            for (int64_t j = n; j < 16; ++j) sums[r * 16 + j] = _mm512_setzero_ps();
        for (int64_t r0 = 0; r0 < R; r0 += rb) {
            const int64_t nb = R - r0 < rb ? R - r0 : rb;
            const int pf = r0 == 0;
            if (!exact)
                score_group(qv, k_plane, v_plane, off, t0, n, len, r0, nb, G, row, sums, D, group_heads(D, 1), 1, pf);
            else
                score_group(qv, k_plane, v_plane, off, t0, n, len, r0, nb, G, row, sums, D, group_heads(D, 0), 0, pf);
        }
        for (int64_t r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(scores + r * len + t0, (__mmask16)((1u << n) - 1),
                                  _mm512_mul_ps(hsum16x16(sums + r * 16), scale));
    }
    float m_r[R], l_r[R];
    softmax_rows(sh, scores, R, len, m_r, l_r);
    /* pass 2: values, KV head by KV head, its query heads GB at a time; then the sums back in head
     * order: into `part` (m and l after them) or normalized into out */
    enum { GB = 4 };
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const int64_t gb = C <= 2 ? GB : (C <= 4 ? 2 : 1);
    for (int64_t h = 0; h < KVH; ++h)
        for (int64_t g0 = 0; g0 < G; g0 += gb) {
            const int64_t nb = G - g0 < gb ? G - g0 : gb, r0 = h * G + g0;
            const uint16_t *vh = v_plane + h * D;
            __m512 ae[GB][8], ao[GB][8];
            for (int b = 0; b < GB; ++b)
                for (int64_t c = 0; c < C; ++c) ae[b][c] = ao[b][c] = _mm512_setzero_ps();
            for (int64_t t = 0; t < len; ++t) {
                const uint16_t *vr = vh + off[t];
                __m512 e[8], o[8];
                for (int64_t c = 0; c < C; ++c) {
                    const __m512i w = _mm512_loadu_si512(vr + 32 * c);
                    e[c] = bf16_even(w);
                    o[c] = bf16_odd(w);
                }
                for (int b = 0; b < GB; ++b) {
                    if (b >= nb) break;
                    const __m512 pt = _mm512_set1_ps(scores[(r0 + b) * len + t]);
                    for (int64_t c = 0; c < C; ++c) {
                        ae[b][c] = _mm512_fmadd_ps(pt, e[c], ae[b][c]);
                        ao[b][c] = _mm512_fmadd_ps(pt, o[c], ao[b][c]);
                    }
                }
            }
            for (int b = 0; b < GB; ++b) {
                if (b >= nb) break;
                const int64_t r = r0 + b;
                float *o = part ? part + r * D : out + r * sh->out_stride_head;
                const __m512 inv = _mm512_set1_ps(part ? 1.0f : 1.0f / (l_r[r] + sink_share(sh, r, m_r[r])));
                for (int64_t c = 0; c < C; ++c) {
                    _mm512_storeu_ps(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(ae[b][c], lo, ao[b][c]), inv));
                    _mm512_storeu_ps(o + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(ae[b][c], hi, ao[b][c]), inv));
                }
            }
        }
    if (part) {
        memcpy(part + R * D, m_r, R * sizeof(float));
        memcpy(part + R * D + R, l_r, R * sizeof(float));
    }
}
#endif

/* Whether decode_range_bf16 runs for this head size (and so paged_decode takes bf16 queries, q_bf16). */
static int bf16_queries(const int64_t head_size) {
#ifdef PS_BF16_EVEN_ODD
    return head_size % 32 == 0 && head_size <= 256;
#else
    (void)head_size;
    return 0;
#endif
}

static void decode_range_q8_any(const decode_shape *sh, float *out, float *part, const float *q, const uint8_t *kv,
                                const int32_t *table, int64_t t_begin, int64_t t_end, float *scratch, int fmt) {
    /* constant D and format: unrolled, vectorized conversions and dot products */
#ifdef PS_BF16_EVEN_ODD
    if (fmt == PS_KV_BF16 && bf16_queries(sh->head_size)) {
        switch (sh->head_size) {
        case 64: decode_range_bf16(sh, out, part, q, kv, table, t_begin, t_end, 64); return;
        case 128: decode_range_bf16(sh, out, part, q, kv, table, t_begin, t_end, 128); return;
        default: decode_range_bf16(sh, out, part, q, kv, table, t_begin, t_end, sh->head_size); return;
        }
    }
#endif
    if (fmt == PS_KV_INT8) {
        Q8_CASE(PS_KV_INT8)
    } else if (fmt == PS_KV_BF16) {
        Q8_CASE(PS_KV_BF16)
    } else if (fmt == PS_KV_E4M3) {
        Q8_CASE(PS_KV_E4M3)
    } else {
        Q8_CASE(PS_KV_E5M2)
    }
}
#undef Q8_CASE

/* out_r = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over a sequence's `n` splits (M = max_s m_s):
 * the exact softmax over the whole sequence from its splits' partial ones. */
static void merge_splits(const decode_shape *sh, float *out, const float *parts, int64_t n) {
    const int64_t R = sh->num_heads, D = sh->head_size, stride = R * (D + 2);
    for (int64_t r = 0; r < R; ++r) {
        float M = -INFINITY;
        for (int64_t s = 0; s < n; ++s) M = fmaxf(M, parts[s * stride + R * D + r]);
        float *o = out + r * sh->out_stride_head, total = 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        for (int64_t s = 0; s < n; ++s) {
            const float *p = parts + s * stride, w = exp_nonpos(p[R * D + r] - M);
            total += w * p[R * D + R + r];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += w * p[r * D + d];
        }
        const float inv = 1.0f / (total + sink_share(sh, r, M));
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

/* The first key a decode at position len - 1 sees: len - window with a window shorter than the sequence. */
ALWAYS_INLINE int64_t window_start(const decode_shape *sh, int64_t len) {
    return sh->window > 0 && len > sh->window ? len - sh->window : 0;
}

/* How many tasks a sequence of `len` keys is attended in: one, or one per SPLIT_TOKENS. */
ALWAYS_INLINE int64_t num_splits(int64_t len) { return len > SPLIT_TOKENS ? (len + SPLIT_TOKENS - 1) / SPLIT_TOKENS : 1; }

/* A buffer of at least `bytes`, kept per calling thread and grown as needed (the split index and
 * partial results of each decode call: allocating them per call costs page faults at large
 * batches). NULL when out of memory. */
static char *workspace(size_t bytes) {
    static _Thread_local char *buf = NULL;
    static _Thread_local size_t size = 0;
    if (bytes > size) {
        char *grown = (char *)realloc(buf, bytes);
        if (!grown) return NULL;
        buf = grown;
        size = bytes;
    }
    return buf;
}

/* Decode attention: sequence i has one query token (row i of `query`) and attends over all
 * seq_lens[i] tokens of its blocks block_tables[i, :ceil(seq_len / block_size)].
 *   out          [num_seqs, num_heads, head_size] fp32 (strides out_stride_tok / _head)
 *   query        [num_seqs, num_heads, head_size] fp32 (strides q_stride_tok / _head)
 *   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_size] fp32, contiguous
 *   block_tables [num_seqs, >= max_blocks] int32 (row stride table_stride)
 *   seq_lens     [num_seqs] int32
 * num_heads must be a multiple of num_kv_heads. A seq_len of 0 gives a zero output row.
 * `window` > 0: only the last `window` keys of each sequence are attended (and read); `softcap`
 * > 0: the scores are soft-capped (see decode_shape). 0 turns either off. `sinks` ([num_heads]
 * fp32, or NULL): each head's sink logit joins its softmax denominator (see decode_shape).
 *
 * A task is one split of one sequence, all its heads (whole cache rows: one thread walks each
 * cache page, and every row it reads is contiguous). A sequence longer than SPLIT_TOKENS is cut
 * into ceil(seq_len / SPLIT_TOKENS) splits (of its attended keys) attended independently and
 * merged (flash-decoding), so a batch of one keeps every thread busy; the cut depends only on
 * seq_len and the window, so the result is the same whatever the thread count and whatever else
 * is in the batch.
 *
 * `q_bf16`: the queries are bf16 (strides in elements as above), over a bf16 cache with a head
 * size `bf16_queries` accepts; else fp32. */
static int paged_decode(float *out, const void *query, const void *kv_cache, const int fmt, const int32_t *block_tables,
                        const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_size, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                        int64_t q_stride_tok, int64_t q_stride_head, int64_t out_stride_tok,
                        int64_t out_stride_head, int64_t table_stride, float scale, int64_t window,
                        float softcap, int num_threads, int q_bf16, const float *sinks) {
    if (fmt < PS_KV_F32 || fmt > PS_KV_BF16) return PS_ERR_FORMAT;
    if (q_bf16 && !(fmt == PS_KV_BF16 && bf16_queries(head_size))) return PS_ERR_FORMAT;
    const decode_shape sh = {num_seqs, num_heads, num_kv_heads, head_size, num_blocks, block_size, max_blocks,
                             q_stride_tok, q_stride_head, out_stride_tok, out_stride_head, table_stride, scale,
                             softcap, window, q_bf16, sinks};
    int64_t max_len = 0, tasks = 0, split_tasks = 0;
    for (int64_t i = 0; i < num_seqs; ++i) { /* validate everything before touching the cache */
        const int64_t len = seq_lens[i], lo = window_start(&sh, len), n = num_splits(len - lo);
        if (len > max_blocks * block_size) return PS_ERR_LEN;
        for (int64_t b = lo / block_size; b < (len + block_size - 1) / block_size; ++b) { /* the blocks read */
            const int64_t blk = block_tables[i * table_stride + b];
            if (blk < 0 || blk >= num_blocks) return PS_ERR_BLOCK;
        }
        max_len = len - lo > max_len ? len - lo : max_len;
        tasks += n;
        split_tasks += n > 1 ? n : 0;
    }
    /* task_start[i]: sequence i's first task; split s of it covers tokens lo + [s, s + 1) * SPLIT_TOKENS.
     * Then the partial results of split tasks, indexed by task (only split tasks' entries are used). */
    const int64_t part_floats = num_heads * (head_size + 2);
    const size_t index_bytes = ((size_t)(num_seqs + 1) * sizeof(int64_t) + 63) / 64 * 64;
    char *work = workspace(index_bytes + (split_tasks ? (size_t)(tasks * part_floats) * sizeof(float) : 0));
    if (!work) return PS_ERR_NOMEM;
    int64_t *task_start = (int64_t *)work;
    float *parts = (float *)(work + index_bytes);
    task_start[0] = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        task_start[i + 1] = task_start[i] + num_splits(seq_lens[i] - window_start(&sh, seq_lens[i]));
    const int64_t scores_len = max_len < SPLIT_TOKENS ? max_len : SPLIT_TOKENS; /* the most tokens a task scores */
    const size_t scratch_floats = (size_t)(num_heads * (scores_len + 2 * head_size)) +
                                  (fmt ? (size_t)((1 + Q8_CHUNK) * num_kv_heads * head_size) : 0);
    const int threads = num_threads > 0 ? num_threads : 1;
    int status = PS_OK;

#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *scratch = (float *)malloc(scratch_floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            status = PS_ERR_NOMEM;
        }
        int64_t i = 0; /* the sequence of the task: tasks are visited in increasing order per thread */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (!scratch) continue;
            while (task_start[i + 1] <= task) ++i;
            const int64_t n = task_start[i + 1] - task_start[i], s = task - task_start[i];
            float *o = out + i * out_stride_tok;
            if (seq_lens[i] <= 0) {
                for (int64_t r = 0; r < num_heads; ++r) memset(o + r * out_stride_head, 0, head_size * sizeof(float));
                continue;
            }
            const int64_t len = seq_lens[i], t_begin = window_start(&sh, len) + s * SPLIT_TOKENS;
            const int64_t t_end = t_begin + SPLIT_TOKENS < len ? t_begin + SPLIT_TOKENS : len;
            float *part = n > 1 ? parts + task * part_floats : NULL;
            /* (a bf16 query row is read as such by decode_range_bf16: q_bf16 in sh) */
            const float *q = (const float *)((const char *)query + i * q_stride_tok * (q_bf16 ? 2 : 4));
            if (fmt == PS_KV_F32)
                decode_range_any(&sh, part ? NULL : o, part, q, (const float *)kv_cache,
                                 block_tables + i * table_stride, t_begin, t_end, scratch);
            else
                decode_range_q8_any(&sh, part ? NULL : o, part, q, (const uint8_t *)kv_cache,
                                    block_tables + i * table_stride, t_begin, t_end, scratch, fmt);
        }
        if (split_tasks && status == PS_OK) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t j = 0; j < num_seqs; ++j) {
                const int64_t n = task_start[j + 1] - task_start[j];
                if (n > 1) merge_splits(&sh, out + j * out_stride_tok, parts + task_start[j] * part_floats, n);
            }
        }
        free(scratch);
    }
    return status;
}

int ps_paged_decode_f32(float *out, const float *query, const float *kv_cache, const int32_t *block_tables,
                        const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_size, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                        int64_t q_stride_tok, int64_t q_stride_head, int64_t out_stride_tok,
                        int64_t out_stride_head, int64_t table_stride, float scale, int64_t window,
                        float softcap, int num_threads, const float *sinks) {
    return paged_decode(out, query, kv_cache, PS_KV_F32, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                        head_size, num_blocks, block_size, max_blocks, q_stride_tok, q_stride_head, out_stride_tok,
                        out_stride_head, table_stride, scale, window, softcap, num_threads, 0, sinks);
}

/* `ps_paged_decode_f32` over an 8-bit cache of format `fmt` (PS_KV_INT8, _E4M3, _E5M2) or a bf16 one
 * (PS_KV_BF16); queries and outputs stay fp32:
 *   kv_cache [2, num_blocks, block_size, num_kv_heads, row] bytes, row = q8_row_bytes(head_size, fmt). */
int ps_paged_decode_q8(float *out, const float *query, const uint8_t *kv_cache, int fmt, const int32_t *block_tables,
                       const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_size, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                       int64_t q_stride_tok, int64_t q_stride_head, int64_t out_stride_tok, int64_t out_stride_head,
                       int64_t table_stride, float scale, int64_t window, float softcap, int num_threads,
                       const float *sinks) {
    if (fmt == PS_KV_F32) return PS_ERR_FORMAT;
    return paged_decode(out, query, kv_cache, fmt, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                        head_size, num_blocks, block_size, max_blocks, q_stride_tok, q_stride_head, out_stride_tok,
                        out_stride_head, table_stride, scale, window, softcap, num_threads, 0, sinks);
}

/* Write the K/V rows of new tokens into the cache (vLLM's reshape_and_cache):
 *   kv_cache  [2, num_blocks * block_size, row] fp32 (row = num_kv_heads * head_size), contiguous
 *   key/value [num_tokens, row] fp32, token strides key_stride / value_stride
 *   slots     [num_tokens] int64; a slot < 0 skips its token (padding)
 * Checks every slot before writing anything. */
int ps_write_kv_f32(float *kv_cache, int64_t num_slots, int64_t row, const float *key, int64_t key_stride,
                    const float *value, int64_t value_stride, const int64_t *slots, int64_t num_tokens) {
    for (int64_t i = 0; i < num_tokens; ++i)
        if (slots[i] >= num_slots) return PS_ERR_SLOT;
    float *v_plane = kv_cache + num_slots * row;
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        memcpy(kv_cache + s * row, key + i * key_stride, row * sizeof(float));
        memcpy(v_plane + s * row, value + i * value_stride, row * sizeof(float));
    }
    return PS_OK;
}

/* `ps_write_kv_f32` into an 8-bit cache of format `fmt`, each (token, KV head) row quantized
 * (quantize_row):
 *   kv_cache  [2, num_blocks * block_size, num_kv_heads, row] bytes, row = q8_row_bytes(head_size, fmt)
 *   key/value [num_tokens, num_kv_heads, head_size] fp32, heads dense, token strides as above */
int ps_write_kv_q8(uint8_t *kv_cache, int fmt, int64_t num_slots, int64_t num_kv_heads, int64_t head_size,
                   const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                   const int64_t *slots, int64_t num_tokens) {
    if (fmt < PS_KV_INT8 || fmt > PS_KV_E5M2) return PS_ERR_FORMAT;
    for (int64_t i = 0; i < num_tokens; ++i)
        if (slots[i] >= num_slots) return PS_ERR_SLOT;
    const int64_t rb = q8_row_bytes(head_size, fmt), row = num_kv_heads * rb;
    uint8_t *v_plane = kv_cache + num_slots * row;
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            quantize_row(kv_cache + s * row + h * rb, key + i * key_stride + h * head_size, head_size, fmt);
            quantize_row(v_plane + s * row + h * rb, value + i * value_stride + h * head_size, head_size, fmt);
        }
    }
    return PS_OK;
}

/* `ps_write_kv_f32` into a bf16 cache: key/value rows fp32 (rounded to nearest even, torch's
 * conversion) or, with `src_bf16`, bf16 (copied):
 *   kv_cache  [2, num_blocks * block_size, row] bf16 (row = num_kv_heads * head_size), contiguous
 *   key/value [num_tokens, row], token strides key_stride / value_stride (elements) */
int ps_write_kv_bf16(uint16_t *kv_cache, int64_t num_slots, int64_t row, const void *key, int64_t key_stride,
                     const void *value, int64_t value_stride, int src_bf16, const int64_t *slots, int64_t num_tokens) {
    for (int64_t i = 0; i < num_tokens; ++i)
        if (slots[i] >= num_slots) return PS_ERR_SLOT;
    uint16_t *v_plane = kv_cache + num_slots * row;
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        if (src_bf16) {
            memcpy(kv_cache + s * row, (const uint16_t *)key + i * key_stride, row * sizeof(uint16_t));
            memcpy(v_plane + s * row, (const uint16_t *)value + i * value_stride, row * sizeof(uint16_t));
        } else {
            const float *k = (const float *)key + i * key_stride, *v = (const float *)value + i * value_stride;
            for (int64_t d = 0; d < row; ++d) kv_cache[s * row + d] = f32_to_bf16(k[d]);
            for (int64_t d = 0; d < row; ++d) v_plane[s * row + d] = f32_to_bf16(v[d]);
        }
    }
    return PS_OK;
}

/* ABI version of this file's entry points; kernels.py checks it after loading. */
int ps_abi_version(void) { return 5; }
