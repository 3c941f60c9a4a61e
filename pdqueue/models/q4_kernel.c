/* q4_1 linear layer for CPU decode: 4-bit weights (GGUF Q4_1 blocks of 32: w = d * q + m,
 * q in 0..15) times 8-bit activations (blocks of 32: x ~= da * qa, qa in -127..127), the
 * arithmetic of llama.cpp's Q4_1 x Q8_1 dot product, with the weights reused across the rows
 * of a batch.
 *
 * Why its own kernel: torch's int4 kernel (tinygemm) dequantizes the weights per row, so 8
 * rows cost ~3x one, and a decode step at batch 8 ~2.6x batch 1. Here the weights of 16
 * outputs are interleaved so that one integer multiply-add instruction (AVX-512 VNNI's
 * vpdpbusd; AVX2's vpmaddubsw) works on four inputs of each of 16 (or 8) outputs at once: a
 * block's 16 integer dot products land in the 16 lanes of one register, with no horizontal
 * sums, and the unpacked weights of a tile serve every row of the batch.
 *
 * The numbers of one row never depend on the other rows, on the tiling or on the ISA: the
 * 32-wide integer block sums are exact, and the float part is a fixed sequence of IEEE
 * operations that pdqueue.models.q4.reference_linear repeats in torch ops bit for bit (built
 * with -ffp-contract=off, so no multiply-add is fused). For row r and output n, over the
 * blocks b in order:
 *     acc  = acc  + (float)isum[r,n,b] * (d[n,b] * da[r,b])
 *     macc = macc + m[n,b] * sa[r,b]
 *   y[r,n] = acc + macc,   sa[r,b] = da[r,b] * (float)sum(qa[r, block b]).
 *
 * Layout (pdqueue.models.q4.interleave): tiles of 16 outputs (N padded with zero outputs to a
 * multiple of 16); per tile and block 256 bytes, four 64-byte groups p = 0..3, where byte
 * 4t + i of group p holds, for output t of the tile, q[4p + i] in its low nibble and
 * q[4p + 16 + i] in its high one; d and m as [tiles, blocks, 16] float16 (GGUF's precision;
 * widened exactly to float). x [M, K] float,
 * y [M, N] float (only the N real outputs are written). K must be a multiple of 32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define TILE 16
#define TILE_BYTES 256   /* one block of one tile: 16 outputs x 32 nibbles */

/* Quantize one row of K floats to int8 blocks of 32 (llama.cpp's Q8_1, but rounding to the
 * nearest even like torch.round): da = amax / 127, qa = rint(x / da), sa = da * sum(qa).
 * AVX2 (the kernel's baseline): the scalar loop called libm's nearbyintf per element; this
 * made a q4_1 step ~5% faster at batch 8 and 32 (docs/performance.md, session 13). The same
 * bits: the max is order-free (a NaN skipped as in `a > amax ? a : amax`), each product
 * x * id is one IEEE multiply, vroundps rounds to the nearest even as nearbyintf does, and
 * the integer sum is exact. */
__attribute__((target("avx2,fma,f16c")))
static void quantize_row(const float *x, int64_t K, int8_t *qa, float *da, float *sa, int32_t *asum) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);   /* NaN in the first operand: m kept */
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        float amax = 0.0f;
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        const float d = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        const int sum = _mm_cvtsi128_si32(t);
        /* int32 -> int8 (|q| <= 127: no saturation), back in element order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(qa + b * QK), _mm256_permutevar8x32_epi32(packed, order));
        da[b] = d;
        sa[b] = d * (float)sum;
        asum[b] = sum;
    }
}

/* Scratch (one set per thread), grown as needed: the rows' quantized activations (the
 * calling thread's) and one tile's unpacked weights (a nibble per byte; each OpenMP thread's). */
static _Thread_local int8_t *g_qa;
static _Thread_local float *g_da, *g_sa;
static _Thread_local int32_t *g_as;
static _Thread_local uint8_t *g_w;
static _Thread_local int64_t g_cap_qa, g_cap_da, g_cap_sa, g_cap_as, g_cap_w;

/* The rows' quantized activations (the calling thread's scratch, read by every thread). */
typedef struct {
    const int8_t *qa;
    const float *da, *sa;
    const int32_t *asum;   /* each block's sum of qa (q8_0: the offset of unsigned weights) */
} Rows;

static int grow(void **p, int64_t *cap, int64_t need) {
    if (need <= *cap) return 0;
    void *q = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
    if (!q) return -1;
    free(*p);
    *p = q;
    *cap = need;
    return 0;
}

/* Quantize M rows into this thread's scratch; -1 when memory ran out. */
static int quantize_rows(const float *x, int64_t M, int64_t K, Rows *rows) {
    const int64_t nb = K / QK;
    if (grow((void **)&g_qa, &g_cap_qa, M * K) || grow((void **)&g_da, &g_cap_da, M * nb * 4)
        || grow((void **)&g_sa, &g_cap_sa, M * nb * 4) || grow((void **)&g_as, &g_cap_as, M * nb * 4))
        return -1;
    for (int64_t r = 0; r < M; r++)
        quantize_row(x + r * K, K, g_qa + r * K, g_da + r * nb, g_sa + r * nb, g_as + r * nb);
    rows->qa = g_qa;
    rows->da = g_da;
    rows->sa = g_sa;
    rows->asum = g_as;
    return 0;
}

/* The outputs of the tile at n0 that exist (the last tile of N % 16 != 0 has padding). */
static inline int64_t tile_width(int64_t N, int64_t n0) {
    return N - n0 < TILE ? N - n0 : TILE;
}

/* The threads a call runs on: one below ~1M multiply-adds, where waking threads costs more
 * than it saves. */
static inline int threads_for(int threads, int64_t M, int64_t N, int64_t K) {
    return threads < 2 || M * N * K < (1 << 20) ? 1 : threads;
}

/* Store one tile's result row: all 16 outputs, or the first `valid` of them. */
static inline void store_tile(float *y, const float *v, int64_t valid) {
    memcpy(y, v, (size_t)valid * sizeof(float));
}

/* --- AVX2 (any x86-64 since 2013): 8 outputs per register ----------------------------- */

__attribute__((target("avx2,fma,f16c")))
static void tile_avx2(const uint8_t *tw, const uint16_t *td, const uint16_t *tm, const Rows *rows, uint8_t *wbuf,
                      int64_t M, int64_t K, int64_t N, int64_t n0, float *y) {
    const int64_t nb = K / QK;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    /* unpack: per block, 8 registers of 32 bytes: [half h][group p][lo, hi] */
    for (int64_t b = 0; b < nb; b++)
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 4; p++) {
                const __m256i z = _mm256_loadu_si256((const __m256i *)(tw + b * TILE_BYTES + p * 64 + h * 32));
                uint8_t *dst = wbuf + ((b * 2 + h) * 8 + p * 2) * 32;
                _mm256_store_si256((__m256i *)dst, _mm256_and_si256(z, mask));
                _mm256_store_si256((__m256i *)(dst + 32), _mm256_and_si256(_mm256_srli_epi16(z, 4), mask));
            }
    const int64_t valid = tile_width(N, n0);
    for (int64_t r = 0; r < M; r++) {
        const int8_t *qa = rows->qa + r * K;
        const float *da = rows->da + r * nb, *sa = rows->sa + r * nb;
        float out[TILE];
        for (int h = 0; h < 2; h++) {
            __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const int32_t *a = (const int32_t *)(qa + b * QK);
                const uint8_t *w = wbuf + (b * 2 + h) * 8 * 32;
                /* sums of pairs in int16: 8 of them stay below 8 * 2 * 15 * 127 = 30480 */
                __m256i s16 = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(w + p * 64)),
                                                                      _mm256_set1_epi32(a[p])));
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(w + p * 64 + 32)),
                                                                      _mm256_set1_epi32(a[p + 4])));
                }
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(td + b * TILE + h * 8)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tm + b * TILE + h * 8)));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(da[b]))));
                macc = _mm256_add_ps(macc, _mm256_mul_ps(m, _mm256_set1_ps(sa[b])));
            }
            _mm256_storeu_ps(out + h * 8, _mm256_add_ps(acc, macc));
        }
        store_tile(y + r * N + n0, out, valid);
    }
}

/* --- AVX-512 with VNNI: 16 outputs per register, one vpdpbusd per 4 inputs -------------- */

/* R rows (R constant at each call, so the loops unroll) of one tile from the unpacked weights
 * in wbuf, or (packed: with fewer than 4 rows, where unpacking once for all rows costs more
 * than it saves) straight from the tile's nibbles in tw: the eight weight loads of a block
 * serve the R rows, and each row's block sum runs in two independent chains (a single chain of
 * 8 dependent vpdpbusd was latency-bound). The same integer sums either way. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void rows_vnni(const int R, const int packed, const Rows *rows, const uint8_t *wbuf, const uint8_t *tw,
                             int64_t r0, int64_t nb, int64_t K, int64_t N, int64_t n0, const uint16_t *td,
                             const uint16_t *tm, int64_t valid, float *y) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[4], macc[4];
    for (int i = 0; i < R; i++) acc[i] = macc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = wbuf + b * 8 * 64;
        __m512i s0[4], s1[4];
        for (int i = 0; i < R; i++) s0[i] = s1[i] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i lo, hi;
            if (packed) {
                const __m512i z = _mm512_loadu_si512((const void *)(tw + b * TILE_BYTES + p * 64));
                lo = _mm512_and_si512(z, mask);
                hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), mask);
            } else {
                lo = _mm512_load_si512((const void *)(w + p * 128));
                hi = _mm512_load_si512((const void *)(w + p * 128 + 64));
            }
            for (int i = 0; i < R; i++) {
                const int32_t *a = (const int32_t *)(rows->qa + (r0 + i) * K + b * QK);
                s0[i] = _mm512_dpbusd_epi32(s0[i], lo, _mm512_set1_epi32(a[p]));
                s1[i] = _mm512_dpbusd_epi32(s1[i], hi, _mm512_set1_epi32(a[p + 4]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + b * TILE)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + b * TILE)));
        for (int i = 0; i < R; i++) {
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[i], s1[i]));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(rows->da[(r0 + i) * nb + b]))));
            macc[i] = _mm512_add_ps(macc[i], _mm512_mul_ps(m, _mm512_set1_ps(rows->sa[(r0 + i) * nb + b])));
        }
    }
    for (int i = 0; i < R; i++) {
        float out[TILE];
        _mm512_storeu_ps(out, _mm512_add_ps(acc[i], macc[i]));
        store_tile(y + (r0 + i) * N + n0, out, valid);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void tile_vnni(const uint8_t *tw, const uint16_t *td, const uint16_t *tm, const Rows *rows, uint8_t *wbuf,
                      int64_t M, int64_t K, int64_t N, int64_t n0, float *y) {
    const int64_t nb = K / QK;
    const int64_t valid = tile_width(N, n0);
    if (M < 4) {   /* no unpacking */
        for (int64_t r = 0; r < M; r++) rows_vnni(1, 1, rows, wbuf, tw, r, nb, K, N, n0, td, tm, valid, y);
        return;
    }
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++)      /* per block 8 registers of 64 bytes: [group p][lo, hi] */
        for (int p = 0; p < 4; p++) {
            const __m512i z = _mm512_loadu_si512((const void *)(tw + b * TILE_BYTES + p * 64));
            uint8_t *dst = wbuf + (b * 8 + p * 2) * 64;
            _mm512_store_si512((void *)dst, _mm512_and_si512(z, mask));
            _mm512_store_si512((void *)(dst + 64), _mm512_and_si512(_mm512_srli_epi16(z, 4), mask));
        }
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) rows_vnni(4, 0, rows, wbuf, tw, r, nb, K, N, n0, td, tm, valid, y);
    for (; r < M; r++) rows_vnni(1, 0, rows, wbuf, tw, r, nb, K, N, n0, td, tm, valid, y);
}

/* 1 when this CPU (and OS) runs the AVX-512 VNNI path. */
int pdq_q4_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vnni");
}

/* y[M, N] = x[M, K] @ W.T with `tw`, `td`, `tm` in the interleaved layout above; vnni: use
 * the AVX-512 path (the caller checked pdq_q4_has_vnni); threads: the tiles are shared among
 * that many OpenMP threads (the process's runtime: torch's libgomp when torch is loaded) when
 * the call is big enough to pay for it. The same bits whatever the path or the threads.
 * Returns 0, or -1 when K is not a multiple of 32 or memory ran out. */
int pdq_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *tw, const uint16_t *td, const uint16_t *tm,
                  int64_t N, float *y, int vnni, int threads) {
    if (K % QK) return -1;
    const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE;
    Rows rows;
    if (quantize_rows(x, M, K, &rows)) return -1;
    threads = threads_for(threads, M, N, K);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        if (grow((void **)&g_w, &g_cap_w, nb * 2 * TILE_BYTES)) {   /* this thread's unpacking buffer */
            failed = 1;
            continue;
        }
        const uint8_t *w = tw + t * nb * TILE_BYTES;
        const uint16_t *d = td + t * nb * TILE, *m = tm + t * nb * TILE;
        if (vnni)
            tile_vnni(w, d, m, &rows, g_w, M, K, N, t * TILE, y);
        else
            tile_avx2(w, d, m, &rows, g_w, M, K, N, t * TILE, y);
    }
    return failed ? -1 : 0;
}


/* --- q8_0: 8-bit weights (GGUF Q8_0 blocks of 32: w = d * q, q in -127..127) ------------
 * For the LM head of the q4_1 format. The same scheme: tiles of 16 outputs, per tile and block
 * 512 bytes, eight 64-byte groups p where byte 4t + i holds output t's q[4p + i] + 128 (an
 * unsigned byte, as vpdpbusd takes it; the 128 * sum(qa) it adds is taken off, exactly);
 * d as [tiles, blocks, 16] float16. For row r and output n, over the blocks b in order:
 *     acc = acc + (float)isum[r,n,b] * (d[n,b] * da[r,b]);   y[r,n] = acc. */

#define TILE8_BYTES 512

__attribute__((target("avx2,fma,f16c")))
static void tile8_avx2(const uint8_t *tw, const uint16_t *td, const Rows *rows, int64_t M, int64_t K, int64_t N,
                       int64_t n0, float *y) {
    const int64_t nb = K / QK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const int64_t valid = tile_width(N, n0);
    for (int64_t r = 0; r < M; r++) {
        const int8_t *qa = rows->qa + r * K;
        const float *da = rows->da + r * nb;
        float out[TILE];
        for (int h = 0; h < 2; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const int32_t *a = (const int32_t *)(qa + b * QK);
                const uint8_t *w = tw + b * TILE8_BYTES + h * 32;
                __m256i s = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    /* signed weights; |w| * sign(a, w) keeps the pair sums below 2 * 127 * 127 */
                    const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + p * 64)), flip);
                    const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(_mm256_set1_epi32(a[p]), ws));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(prod, ones));
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(td + b * TILE + h * 8)));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(da[b]))));
            }
            _mm256_storeu_ps(out + h * 8, acc);
        }
        store_tile(y + r * N + n0, out, valid);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void rows8_vnni(const int R, const Rows *rows, const uint8_t *tw, const uint16_t *td, int64_t r0,
                              int64_t nb, int64_t K, int64_t N, int64_t n0, int64_t valid, float *y) {
    __m512 acc[4];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tw + b * TILE8_BYTES;
        __m512i s0[4], s1[4];
        for (int i = 0; i < R; i++) s0[i] = s1[i] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p += 2) {
            const __m512i w0 = _mm512_loadu_si512((const void *)(w + p * 64));
            const __m512i w1 = _mm512_loadu_si512((const void *)(w + p * 64 + 64));
            for (int i = 0; i < R; i++) {
                const int32_t *a = (const int32_t *)(rows->qa + (r0 + i) * K + b * QK);
                s0[i] = _mm512_dpbusd_epi32(s0[i], w0, _mm512_set1_epi32(a[p]));
                s1[i] = _mm512_dpbusd_epi32(s1[i], w1, _mm512_set1_epi32(a[p + 1]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + b * TILE)));
        for (int i = 0; i < R; i++) {
            const __m512i off = _mm512_set1_epi32(128 * rows->asum[(r0 + i) * nb + b]);
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0[i], s1[i]), off));
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(rows->da[(r0 + i) * nb + b]))));
        }
    }
    for (int i = 0; i < R; i++) {
        float out[TILE];
        _mm512_storeu_ps(out, acc[i]);
        store_tile(y + (r0 + i) * N + n0, out, valid);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void tile8_vnni(const uint8_t *tw, const uint16_t *td, const Rows *rows, int64_t M, int64_t K, int64_t N,
                       int64_t n0, float *y) {
    const int64_t nb = K / QK, valid = tile_width(N, n0);
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) rows8_vnni(4, rows, tw, td, r, nb, K, N, n0, valid, y);
    for (; r < M; r++) rows8_vnni(1, rows, tw, td, r, nb, K, N, n0, valid, y);
}

/* y[M, N] = x[M, K] @ W.T with W in q8_0 tiles; as pdq_q4_linear otherwise. */
int pdq_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *tw, const uint16_t *td, int64_t N, float *y,
                  int vnni, int threads) {
    if (K % QK) return -1;
    const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE;
    Rows rows;
    if (quantize_rows(x, M, K, &rows)) return -1;
    threads = threads_for(threads, M, N, K);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        if (vnni)
            tile8_vnni(tw + t * nb * TILE8_BYTES, td + t * nb * TILE, &rows, M, K, N, t * TILE, y);
        else
            tile8_avx2(tw + t * nb * TILE8_BYTES, td + t * nb * TILE, &rows, M, K, N, t * TILE, y);
    }
    return 0;
}
