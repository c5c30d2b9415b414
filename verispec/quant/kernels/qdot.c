/* Integer-dot products for 4-bit and 8-bit group-quantized weights on a CPU (the GGUF Q4_0 / Q4_1 /
 * Q8_0 families, and any affine 4 / 8-bit layer in groups of 32), included by cpu_layers.c (one
 * library, quant/kernels/cpu_library.py) and called through ctypes by quant/kernels/cpu_qdot.py.
 *
 * y[m, n] = sum over 32-blocks b of  d[n,b] * dx[m,b] * (q[n,b] . xq[m,b])  +  o[n,b] * dx[m,b] * sum(xq[m,b])
 * where the weight is w = q * d + o per block (q unsigned 4-bit, or signed 8-bit with the offset
 * re-centred) and each activation block is rounded to int16 with its own scale dx = max|x| / 32767
 * (llama.cpp rounds to int8, which changed this project's default model's answers; 16 bits are
 * finer than bfloat16's rounding). The block dot products are exact integers; each output's float
 * sum runs over its blocks in order, whatever the row count, the other rows or the thread split,
 * so a row's bits are the same alone, in a batch, in a verify pass and in a prompt chunk.
 *
 * Weight layout (packed by cpu_qdot.pack): per output row, K/32 blocks of
 *   4-bit: { uint16 d (f16), uint16 o (f16), uint8 q[16] }   q[j] holds values j (low) and j+16 (high)
 *   8-bit: { uint16 d (f16), uint16 o (f16), int8 q[32] }
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_pool.h"

#define QK 32
#define MAX_TILE_ROWS 4

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

typedef struct { uint16_t d, o; uint8_t q[16]; } block4;
typedef struct { uint16_t d, o; int8_t q[32]; } block8;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: renormalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {  /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = man >> shift, rest = man & ((1u << shift) - 1);
        if (rest > half || (rest == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = man >> 13, rest = man & 0x1fff;
    uint32_t h = sign | ((uint32_t)exp << 10) | r;
    if (rest > 0x1000 || (rest == 0x1000 && (r & 1))) h++;
    return (uint16_t)h;
}

#ifdef __F16C__
#define HALF(h) _cvtsh_ss(h)
#define TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT)
#else
#define HALF(h) f16_to_f32(h)
#define TO_HALF(f) f32_to_f16(f)
#endif

static inline float load_x(const void *x, int dtype, size_t i) {
    if (dtype == DT_F32) return ((const float *)x)[i];
    if (dtype == DT_F16) return HALF(((const uint16_t *)x)[i]);
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void store_y(void *y, int dtype, size_t i, float v) {
    if (dtype == DT_F32) {
        ((float *)y)[i] = v;
    } else if (dtype == DT_F16) {
        ((uint16_t *)y)[i] = TO_HALF(v);
    } else {  /* bfloat16, round to nearest even */
        uint32_t bits;
        memcpy(&bits, &v, 4);
        if ((bits & 0x7fffffff) > 0x7f800000) {
            ((uint16_t *)y)[i] = (uint16_t)((bits >> 16) | 0x40);
        } else {
            bits += 0x7fff + ((bits >> 16) & 1);
            ((uint16_t *)y)[i] = (uint16_t)(bits >> 16);
        }
    }
}

/* One row's activations as int8 blocks: xq [K], dx [K/32] (scale), sx [K/32] (dx * sum of codes). */
static void quantize_row(const void *x, int dtype, size_t offset, int K, int16_t *xq, float *dx, float *sx) {
    for (int b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            v[j] = load_x(x, dtype, offset + (size_t)b * QK + j);
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(v[j] * id);
            q = q > 32767 ? 32767 : (q < -32767 ? -32767 : q);
            xq[b * QK + j] = (int16_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {  /* a fixed pairing: the same bits for the same lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 weights (as int16) times 16 activations, pairs summed: 8 int32 lanes; |sum| <= 32 * 128 * 32767 */
static inline __m256i dot16(__m256i w, const int16_t *xq) {
    return _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
}

static inline __m256 block_dot4(const block4 *w, const int16_t *xq) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)w->q);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256i first = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low));                     /* values 0..15 */
    __m256i second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low)); /* values 16..31 */
    return _mm256_cvtepi32_ps(_mm256_add_epi32(dot16(first, xq), dot16(second, xq + 16)));
}

static inline __m256 block_dot8(const block8 *w, const int16_t *xq) {
    __m256i first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->q));
    __m256i second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w->q + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(dot16(first, xq), dot16(second, xq + 16)));
}
#endif

static inline int32_t block_dot4_scalar(const block4 *w, const int16_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += (w->q[j] & 0x0f) * xq[j] + (w->q[j] >> 4) * xq[j + 16];
    return s;
}

static inline int32_t block_dot8_scalar(const block8 *w, const int16_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += w->q[j] * xq[j];
    return s;
}

/* Outputs n of R rows from m0 (R a constant, so the accumulators stay in registers). Each (m, n)
 * runs the same operations in the same order whatever R is: even blocks go to one accumulator,
 * odd ones to another (two chains of multiply-adds in flight), summed once at the end. */
#ifdef __AVX2__
#define BLOCK_STEP(BLOCK, DOT, R, b, acc, off)                                                        \
    do {                                                                                          \
        const BLOCK *w_ = (const BLOCK *)wrow + (b);                                              \
        const float d_ = HALF(w_->d), o_ = HALF(w_->o);                                           \
        for (int r = 0; r < R; r++) {                                                             \
            const size_t i_ = (size_t)(m0 + r) * nblocks + (b);                                    \
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_ * dx[i_]), DOT(w_, xq + i_ * QK), acc[r]);  \
            off[r] = fmaf(o_, sx[i_], off[r]);                                                    \
        }                                                                                         \
    } while (0)

#define DEFINE_TILE(NAME, BLOCK, DOT, R)                                                          \
    static void NAME(const void *wrow, int nblocks, const int16_t *xq, const float *dx, const float *sx, \
                     int m0, float *out) {                                                        \
        __m256 even[R], odd[R];                                                                   \
        float even_off[R], odd_off[R];                                                            \
        for (int r = 0; r < R; r++) {                                                             \
            even[r] = odd[r] = _mm256_setzero_ps();                                               \
            even_off[r] = odd_off[r] = 0.0f;                                                      \
        }                                                                                         \
        int b = 0;                                                                                \
        for (; b + 1 < nblocks; b += 2) {                                                         \
            BLOCK_STEP(BLOCK, DOT, R, b, even, even_off);                                            \
            BLOCK_STEP(BLOCK, DOT, R, b + 1, odd, odd_off);                                          \
        }                                                                                         \
        if (b < nblocks) BLOCK_STEP(BLOCK, DOT, R, b, even, even_off);                               \
        for (int r = 0; r < R; r++)                                                               \
            out[r] = hsum8(_mm256_add_ps(even[r], odd[r])) + (even_off[r] + odd_off[r]);          \
    }
#else
#define DEFINE_TILE(NAME, BLOCK, DOT, R)                                                          \
    static void NAME(const void *wrow, int nblocks, const int16_t *xq, const float *dx, const float *sx, \
                     int m0, float *out) {                                                        \
        for (int r = 0; r < R; r++) {                                                             \
            float acc = 0.0f, off = 0.0f;                                                         \
            for (int b = 0; b < nblocks; b++) {                                                   \
                const BLOCK *w_ = (const BLOCK *)wrow + b;                                        \
                const size_t i_ = (size_t)(m0 + r) * nblocks + b;                                 \
                acc = fmaf(HALF(w_->d) * dx[i_], (float)DOT##_scalar(w_, xq + i_ * QK), acc);      \
                off = fmaf(HALF(w_->o), sx[i_], off);                                             \
            }                                                                                     \
            out[r] = acc + off;                                                                   \
        }                                                                                         \
    }
#endif

DEFINE_TILE(tile4_1, block4, block_dot4, 1)
DEFINE_TILE(tile4_2, block4, block_dot4, 2)
DEFINE_TILE(tile4_3, block4, block_dot4, 3)
DEFINE_TILE(tile4_4, block4, block_dot4, 4)
DEFINE_TILE(tile8_1, block8, block_dot8, 1)
DEFINE_TILE(tile8_2, block8, block_dot8, 2)
DEFINE_TILE(tile8_3, block8, block_dot8, 3)
DEFINE_TILE(tile8_4, block8, block_dot8, 4)

typedef void (*tile_fn)(const void *, int, const int16_t *, const float *, const float *, int, float *);
static const tile_fn TILES4[MAX_TILE_ROWS] = {tile4_1, tile4_2, tile4_3, tile4_4};
static const tile_fn TILES8[MAX_TILE_ROWS] = {tile8_1, tile8_2, tile8_3, tile8_4};

/* The tile that sums `rows` (1..MAX_TILE_ROWS) activation rows against one weight row */
static inline tile_fn tile_for(int bits, int rows) { return (bits == 4 ? TILES4 : TILES8)[rows - 1]; }

/* A weight row's bytes in the packed layout */
static inline size_t weight_row_bytes(int bits, int nblocks) {
    return (size_t)nblocks * (bits == 4 ? sizeof(block4) : sizeof(block8));
}

/* How far ahead of its products a thread asks the memory for its weights: a decode step streams
 * every weight once from DRAM, and one sequential stream per core runs ahead of what the hardware
 * prefetcher fetches by itself (docs/benchmarks.md, "The default model on a CPU") */
#define PREFETCH_AHEAD 2048

/* Asks for the cache lines of [p + PREFETCH_AHEAD, + bytes) of a thread's weights, before [p, + bytes)
 * is read; none at or past `end`, where its share ends. A hint: the products read the same bytes */
static inline void prefetch_ahead(const char *p, size_t bytes, const char *end) {
#ifdef __AVX2__
    const uintptr_t stop = (uintptr_t)p + PREFETCH_AHEAD + bytes, last = (uintptr_t)end;
    for (uintptr_t q = (uintptr_t)p + PREFETCH_AHEAD; q < stop && q < last; q += 64)
        _mm_prefetch((const char *)q, _MM_HINT_T0);
#else
    (void)p; (void)bytes; (void)end;
#endif
}

/* Rows lo..hi-1 of x [M, K] (dtype x_dtype) as int16 blocks: xq [M, K], dx / sx [M, K/32] */
static void quantize_rows(const void *x, int x_dtype, int K, int lo, int hi, int16_t *xq, float *dx, float *sx) {
    const int nblocks = K / QK;
    for (int m = lo; m < hi; m++)
        quantize_row(x, x_dtype, (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nblocks, sx + (size_t)m * nblocks);
}

typedef struct {  /* one qdot_linear call, shared by the pool's threads */
    const void *x, *w;
    void *y;
    int x_dtype, y_dtype, M, K, N, bits;
    int16_t *xq;
    float *dx, *sx;
} linear_job_t;

static void linear_rows(void *arg, pool_t *pool, int thread) {
    const int threads = pool->threads;
    const linear_job_t *job = arg;
    const int nblocks = job->K / QK;
    const size_t row_bytes = weight_row_bytes(job->bits, nblocks);
    int lo, hi;
    pool_share(job->M, thread, threads, &lo, &hi);
    quantize_rows(job->x, job->x_dtype, job->K, lo, hi, job->xq, job->dx, job->sx);
    pool_barrier(pool);
    pool_share(job->N, thread, threads, &lo, &hi);
    float out[MAX_TILE_ROWS];
    const char *share_end = (const char *)job->w + (size_t)hi * row_bytes;
    for (int n = lo; n < hi; n++) {
        const void *wrow = (const char *)job->w + (size_t)n * row_bytes;
        prefetch_ahead(wrow, row_bytes, share_end);
        for (int m0 = 0; m0 < job->M; m0 += MAX_TILE_ROWS) {
            int rows = job->M - m0 < MAX_TILE_ROWS ? job->M - m0 : MAX_TILE_ROWS;
            tile_for(job->bits, rows)(wrow, nblocks, job->xq, job->dx, job->sx, m0, out);
            for (int r = 0; r < rows; r++) store_y(job->y, job->y_dtype, (size_t)(m0 + r) * job->N + n, out[r]);
        }
    }
}

/* y [M, N] (dtype y_dtype) = x [M, K] (dtype x_dtype) times the packed weight's transpose; K % 32 == 0;
 * on `threads` threads of the pool. Returns 0, or -1 when scratch memory could not be had. */
int qdot_linear(const void *x, int x_dtype, int M, int K, const void *w, int bits, int N, void *y, int y_dtype,
                int threads) {
    const int nblocks = K / QK;
    linear_job_t job = {.x = x, .w = w, .y = y, .x_dtype = x_dtype, .y_dtype = y_dtype, .M = M, .K = K, .N = N,
                        .bits = bits};
    job.xq = malloc(sizeof(int16_t) * (size_t)M * K);
    job.dx = malloc(sizeof(float) * (size_t)M * nblocks);
    job.sx = malloc(sizeof(float) * (size_t)M * nblocks);
    const int failed = !job.xq || !job.dx || !job.sx;
    if (!failed) pool_run(linear_rows, &job, threads);
    free(job.xq); free(job.dx); free(job.sx);
    return failed ? -1 : 0;
}

/* Rows ids[0..n-1] of a packed weight [N, K] as values: out [n, K] (dtype out_dtype), each value
 * w = q * d + o in float32 as cpu_qdot.unpack and dequantize.decode_values give it (q * d is exact, so
 * one rounding for the add and one for the store, fused or not); 8-bit codes and their re-centred
 * offset back to unsigned codes and the checkpoint's offset (o - 128 d, exact: pack checked it).
 * A tied table's embedding lookup, one call instead of a dozen torch ops a step. Returns 0, or -1
 * (nothing written) when an id is not a row of the weight's N. */
int qdot_decode_rows(const void *w, int bits, int K, int N, const int64_t *ids, int n, void *out, int out_dtype) {
    const int nblocks = K / QK;
    const size_t row_bytes = weight_row_bytes(bits, nblocks);
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return -1;
    for (int r = 0; r < n; r++) {
        const char *wrow = (const char *)w + (size_t)ids[r] * row_bytes;
        for (int b = 0; b < nblocks; b++) {
            const size_t at = (size_t)r * K + (size_t)b * QK;
            if (bits == 4) {
                const block4 *blk = (const block4 *)wrow + b;
                const float d = HALF(blk->d), o = HALF(blk->o);
                for (int j = 0; j < 16; j++) {
                    store_y(out, out_dtype, at + j, (float)(blk->q[j] & 0x0f) * d + o);
                    store_y(out, out_dtype, at + j + 16, (float)(blk->q[j] >> 4) * d + o);
                }
            } else {
                const block8 *blk = (const block8 *)wrow + b;
                const float d = HALF(blk->d), o = HALF(blk->o) - 128.0f * d;
                for (int j = 0; j < QK; j++) store_y(out, out_dtype, at + j, (float)(blk->q[j] + 128) * d + o);
            }
        }
    }
    return 0;
}

/* Which instruction set this build sums with (for the log). */
const char *qdot_isa(void) {
#ifdef __AVX2__
    return "avx2";
#else
    return "scalar";
#endif
}
