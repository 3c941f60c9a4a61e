/* The small operations of a decoder layer, for the q4_1 format's forward pass: RMSNorm, RoPE,
 * SiLU x up, and decode attention (one query per sequence) over each sequence's K/V, with the
 * new token's K/V stored on the way.
 *
 * Why in C: a decode step of SmolLM2 at batch 1 is ~8 ms of weights (the q4_1 kernel) and was
 * ~7 ms more of ~1,300 small torch ops (norms, RoPE, casts, K/V writes, one SDPA call per
 * sequence per layer, views): their fixed costs, not their bytes. Here each is one call per
 * layer for the whole batch.
 *
 * The numbers: every row (token) is computed alone, in a fixed order of IEEE operations that
 * depends on nothing else in the batch, on the threads or on the CPU (AVX2 and FMA only, also
 * on AVX-512 machines), so a sequence gets the same bits whatever runs beside it (the property
 * that makes disaggregated == colocated hold). RoPE is torch's bit for bit (x * cos +
 * swap(x) * signed_sin with one fused multiply-add, as torch's addcmul computes it in
 * models.llama.apply_rope); RMSNorm, SiLU and the softmax differ from torch's in the last bits
 * (their own summation order and exp).
 * Built into the same library as q4_kernel.c (models.q4), with -ffp-contract=off.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define V8 __attribute__((target("avx2,fma")))

/* The sums of the 8 lanes of a, b, c, d at once, each as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) +
 * (v6 + v7)): returns {sum a, sum b, sum c, sum d}. hsum8 is the same tree for one vector. */
V8 static inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

V8 static inline float hsum8(__m256 v) {
    return _mm_cvtss_f32(hsum8x4(v, v, v, v));
}

/* e^x for x in float, Cephes' polynomial (the one of avx_mathfun), ~1 ulp; exact IEEE steps
 * with explicit FMAs, so the same bits everywhere. Below -87.3 it returns ~1e-38, not 0. */
V8 static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

/* y[r] = (x[r] * rstd) * w, rstd = 1 / sqrt(sum(x[r]^2) / K + eps); K a multiple of 16. */
V8 void pdq_rms_norm(const float *x, const float *w, int64_t M, int64_t K, float eps, float *y) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * K;
        float *yr = y + r * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < K; i += 16) {
            __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        const float rstd = 1.0f / sqrtf(hsum8(_mm256_add_ps(a0, a1)) / (float)K + eps);
        const __m256 s = _mm256_set1_ps(rstd);
        for (int64_t i = 0; i < K; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), s), _mm256_loadu_ps(w + i)));
    }
}

/* gu [M, 2I] (gate, then up) -> y [M, I] = gate / (1 + e^-gate) * up; I a multiple of 8. */
V8 void pdq_silu_mul(const float *gu, int64_t M, int64_t I, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *yr = y + r * I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

/* In place on rows of `x` (row r at x + r * row_stride): heads 0..heads-1 of D floats each
 * (D a multiple of 16), rotated by position r's cos and signed sin ([M, D] each):
 * fma(swap_halves(x), ssin, x * cos), which is what torch's addcmul in models.llama.apply_rope
 * computes (bit for bit: tests/test_fused.py). */
V8 void pdq_rope(float *x, int64_t M, int64_t row_stride, int64_t heads, int64_t D, const float *cos,
                 const float *ssin) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < M; r++) {
        const float *c = cos + r * D, *s = ssin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * D;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 lo = _mm256_loadu_ps(v + i), hi = _mm256_loadu_ps(v + half + i);
                _mm256_storeu_ps(v + i, _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + i),
                                                        _mm256_mul_ps(lo, _mm256_loadu_ps(c + i))));
                _mm256_storeu_ps(v + half + i, _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + half + i),
                                                               _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i))));
            }
        }
    }
}

/* Per sequence of a decode step, where its K/V are (int64 each, META fields):
 *   k, v: addresses of token 0, kv head 0; head_stride, tok_stride: in floats;
 *   n: tokens to attend to, the new one included (the last);
 *   store: 1 to write the new token's K/V at token n - 1 first (a decode_kv copy), 0 when it is
 *   there already (gathered from the pool after the pool write). */
enum { M_K, M_V, M_HEAD, M_TOK, M_N, M_STORE, META };

/* out[g][i0 .. i0 + 8W) = inv[g] * sum over u of p[g][u] * V[u][i0 ..], for GC (<= 3) query heads
 * at once: each V row is loaded once for all of them (GC x W accumulators stay in registers).
 * Every output element is its own chain over u in order, so the chunking does not change it. */
__attribute__((target("avx2,fma"), always_inline))
static inline void v_chunk(const int GC, const int W, const float *const *p, const float *vb, int64_t tok, int64_t n,
                           int64_t i0, float *const *o, const float *inv) {
    __m256 acc[3][4];
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < W; j++) acc[g][j] = _mm256_setzero_ps();
    for (int64_t u = 0; u < n; u++) {
        const float *vr = vb + u * tok + i0;
        __m256 v[4];
        for (int j = 0; j < W; j++) v[j] = _mm256_loadu_ps(vr + 8 * j);
        for (int g = 0; g < GC; g++) {
            const __m256 w = _mm256_set1_ps(p[g][u]);
            for (int j = 0; j < W; j++) acc[g][j] = _mm256_fmadd_ps(w, v[j], acc[g][j]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < W; j++) _mm256_storeu_ps(o[g] + i0 + 8 * j, _mm256_mul_ps(acc[g][j], _mm256_set1_ps(inv[g])));
}

V8 static void v_pass(const int GC, const float *const *p, const float *vb, int64_t tok, int64_t n, int64_t D,
                      float *const *o, const float *inv) {
    int64_t i0 = 0;
    for (; i0 + 32 <= D; i0 += 32) {
        if (GC == 3) v_chunk(3, 4, p, vb, tok, n, i0, o, inv);
        else if (GC == 2) v_chunk(2, 4, p, vb, tok, n, i0, o, inv);
        else v_chunk(1, 4, p, vb, tok, n, i0, o, inv);
    }
    for (; i0 < D; i0 += 8) {
        if (GC == 3) v_chunk(3, 1, p, vb, tok, n, i0, o, inv);
        else if (GC == 2) v_chunk(2, 1, p, vb, tok, n, i0, o, inv);
        else v_chunk(1, 1, p, vb, tok, n, i0, o, inv);
    }
}

/* One (sequence, kv head): the G query heads that share it, over n tokens. q: G x D;
 * out: G x D; buf: G x n scores. */
V8 static void attend_head(const float *q, const float *kb, const float *vb, int64_t tok, int64_t n, int64_t G,
                           int64_t D, float scale, float *buf, float *out) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {   /* scores: four query heads at a time share each K row */
        const int64_t gc = G - g0 < 4 ? G - g0 : 4;
        const float *qs[4];
        for (int64_t g = 0; g < 4; g++) qs[g] = q + (g0 + (g < gc ? g : 0)) * D;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = kb + t * tok;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 k = _mm256_loadu_ps(kt + i);
                for (int g = 0; g < 4; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + i), k, acc[g]);
            }
            float sums[4];
            _mm_storeu_ps(sums, hsum8x4(acc[0], acc[1], acc[2], acc[3]));
            for (int64_t g = 0; g < gc; g++) buf[(g0 + g) * n + t] = sums[g] * scale;
        }
    }
    float inv[G];
    for (int64_t g = 0; g < G; g++) {   /* softmax numerators in place, and 1 / their sum */
        float *s = buf + g * n;
        float mx = s[0];
        for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
            _mm256_storeu_ps(s + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        if (t < n) {   /* the tail: the lanes past n add zeros */
            float pad[8];
            const int64_t rest = n - t;
            for (int64_t i = 0; i < 8; i++) pad[i] = i < rest ? s[t + i] - mx : 0.0f;
            _mm256_storeu_ps(pad, exp8(_mm256_loadu_ps(pad)));
            for (int64_t i = rest; i < 8; i++) pad[i] = 0.0f;
            sum8 = _mm256_add_ps(sum8, _mm256_loadu_ps(pad));
            for (int64_t i = 0; i < rest; i++) s[t + i] = pad[i];
        }
        inv[g] = 1.0f / hsum8(sum8);
    }
    for (int64_t g0 = 0; g0 < G; g0 += 3) {   /* the weighted sum of V, three query heads at a time */
        const int GC = G - g0 < 3 ? (int)(G - g0) : 3;
        const float *p[3];
        float *o[3];
        for (int g = 0; g < GC; g++) {
            p[g] = buf + (g0 + g) * n;
            o[g] = out + (g0 + g) * D;
        }
        v_pass(GC, p, vb, tok, n, D, o, inv + g0);
    }
}

/* A decode step's attention for B sequences, one query each: q rows at qkv + b * row_stride
 * (H heads, then the new K's Hkv heads, then the new V's), out [B, H, D]. The new K/V go to
 * the pool's slots first (pool_k/pool_v [slots, Hkv, D]; NULL: not written here) and, with
 * META's store, to the copy. D a multiple of 8, at most 256. Returns 0, or -1 without memory. */
V8 int pdq_decode_attention(const float *qkv, int64_t B, int64_t row_stride, int64_t H, int64_t Hkv, int64_t D,
                            float *pool_k, float *pool_v, const int64_t *slots, const int64_t *meta, float scale,
                            float *out, int threads) {
    const int64_t G = H / Hkv;
    for (int64_t b = 0; b < B; b++) {   /* the stores first: every head reads after them */
        const float *kn = qkv + b * row_stride + H * D, *vn = kn + Hkv * D;
        const int64_t *m = meta + b * META;
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t i = 0; i < D; i++) {
                if (pool_k) {
                    pool_k[(slots[b] * Hkv + h) * D + i] = kn[h * D + i];
                    pool_v[(slots[b] * Hkv + h) * D + i] = vn[h * D + i];
                }
                if (m[M_STORE]) {
                    ((float *)(intptr_t)m[M_K])[h * m[M_HEAD] + (m[M_N] - 1) * m[M_TOK] + i] = kn[h * D + i];
                    ((float *)(intptr_t)m[M_V])[h * m[M_HEAD] + (m[M_N] - 1) * m[M_TOK] + i] = vn[h * D + i];
                }
            }
    }
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++) longest = meta[b * META + M_N] > longest ? meta[b * META + M_N] : longest;
    int failed = 0;
    const int64_t tasks = B * Hkv;
    if (threads < 1 || tasks * longest < 4096) threads = 1;   /* small: a thread team costs more */
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * G * longest);
        if (!buf) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!buf) continue;
            const int64_t b = task / Hkv, h = task % Hkv;
            const int64_t *m = meta + b * META;
            const float *kb = (const float *)(intptr_t)m[M_K] + h * m[M_HEAD];
            const float *vb = (const float *)(intptr_t)m[M_V] + h * m[M_HEAD];
            attend_head(qkv + b * row_stride + h * G * D, kb, vb, m[M_TOK], m[M_N], G, D, scale, buf,
                        out + (b * H + h * G) * D);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
