/* Whole decoder layers of the Llama family on a CPU, for a pass of R rows (tokens of one or more
 * sequences: a prompt chunk, a decode step, a verify pass), every product an integer-dot product
 * over the layers' quantized blocks (qdot.c), every layer asked for in one pass of a thread pool
 * (cpu_pool.h). Called through ctypes by quant/kernels/cpu_layers.py.
 *
 * Each layer does what models/llama.py's DecoderLayer does in torch, rounding to the model's dtype
 * (float16 or bfloat16) at the same points:
 *   x = x + update; h = rms_norm(x)              (statistics in float32, weight applied in the dtype)
 *   q, k, v = h Wqkv (+ bias); [per-head q/k RMSNorm]; RoPE (x cos + rotate_half(x) sin, each op rounded)
 *   k, v -> the paged pools at the rows' slots
 *   a = softmax(q k^T * scale) v over each row's own keys (float32), o = a Wo
 *   x = x + o; h = rms_norm(x); update = (silu(h Wgate) * h Wup) Wdown
 * Every row is computed alone, in one order, whatever the other rows of the pass, the pass's
 * width or the thread split: a row's bits are the same in a prompt chunk, a decode step, a verify
 * pass or a batch (tests/quant/test_layer_stack.py).
 */
#include "qdot.c"

typedef struct {
    const void *blocks;  /* cpu_qdot.pack's layout */
    const void *bias;    /* [n] in the model's dtype, or NULL */
    int bits, n, k;
} product_t;

typedef struct {
    product_t qkv, o, gate_up, down;
    const void *input_norm, *post_norm;  /* [hidden] in the model's dtype */
    const void *q_norm, *k_norm;         /* [head_dim], or NULL */
    void *keys, *values;                 /* pools [slots, kv_heads, head_dim] in the model's dtype */
    int window;                          /* 0: every earlier key */
} layer_t;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, dtype;
    float eps, scale;
} dims_t;

typedef struct {  /* the pass: R rows */
    int rows;
    const int64_t *positions;     /* [R] */
    const int64_t *write_slots;   /* [R] pool row of each row's key and value */
    const int64_t *block_tables;  /* [sequences, width]: row r belongs to sequence r / rows_per_sequence */
    int table_width, block_size, rows_per_sequence;
    const void *cos, *sin;        /* [R, head_dim] in the model's dtype */
} pass_t;

static inline float round_to(float v, int dtype) {  /* the nearest value of the model's dtype */
    if (dtype == DT_F32) return v;
    uint16_t h;
    store_y(&h, dtype, 0, v);
    return load_x(&h, dtype, 0);
}

/* y = x * rsqrt(mean(x^2) + eps) rounded, times the weight, rounded (as models/layers/fused.py) */
static void rms_norm_row(const float *x, const void *weight, int n, float eps, int dtype, float *y) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = round_to(load_x(weight, dtype, i) * round_to(x[i] * inv, dtype), dtype);
}

/* out [R, N] = the quantized rows [R, K] times the product's weight, each value rounded to the
 * dtype: this thread's share of the outputs */
static void product(const product_t *p, int R, const int16_t *xq, const float *dx, const float *sx, float *out,
                    int dtype, int thread, int threads) {
    const int nblocks = p->k / QK, N = p->n;
    const size_t row_bytes = weight_row_bytes(p->bits, nblocks);
    int lo, hi;
    pool_share(N, thread, threads, &lo, &hi);
    float sums[MAX_TILE_ROWS];
    const char *share_end = (const char *)p->blocks + (size_t)hi * row_bytes;
    for (int n = lo; n < hi; n++) {
        const void *wrow = (const char *)p->blocks + (size_t)n * row_bytes;
        prefetch_ahead(wrow, row_bytes, share_end);
        const float bias = p->bias ? load_x(p->bias, dtype, n) : 0.0f;
        for (int m0 = 0; m0 < R; m0 += MAX_TILE_ROWS) {
            const int rows = R - m0 < MAX_TILE_ROWS ? R - m0 : MAX_TILE_ROWS;
            tile_for(p->bits, rows)(wrow, nblocks, xq, dx, sx, m0, sums);
            for (int r = 0; r < rows; r++) {
                const float v = round_to(sums[r], dtype);
                out[(size_t)(m0 + r) * N + n] = p->bias ? round_to(v + bias, dtype) : v;
            }
        }
    }
}

/* RoPE on one head in place: x cos + rotate_half(x) sin, each product and the sum rounded */
static void rope_head(float *x, const void *cos, const void *sin, size_t offset, int d, int dtype) {
    const int half = d / 2;
    float rotated[512];
    for (int i = 0; i < half; i++) {
        rotated[i] = -x[i + half];
        rotated[i + half] = x[i];
    }
    for (int i = 0; i < d; i++) {
        float a = round_to(x[i] * load_x(cos, dtype, offset + i), dtype);
        float b = round_to(rotated[i] * load_x(sin, dtype, offset + i), dtype);
        x[i] = round_to(a + b, dtype);
    }
}

/* Calls BODY for each run of keys that sit in one block of the sequence's table: `j0` (the first
 * key's position), `count` keys, `offset` (where key j0's row of kv_head starts in pools of
 * kv_heads heads of d values; the next key's is kv_heads * d further). Positions past the table
 * read the scratch block. */
#define FOR_EACH_RUN(pass, table, start, end, kv_heads, kv_head, d, BODY)                         \
    do {                                                                                          \
        const int64_t bs_ = (pass)->block_size;                                                   \
        for (int64_t j0 = (start); j0 < (end);) {                                                 \
            const int64_t column_ = j0 / bs_;                                                     \
            const int64_t block_ = column_ < (pass)->table_width ? (table)[column_] : 0;          \
            const int64_t stop_ = (column_ + 1) * bs_ < (end) ? (column_ + 1) * bs_ : (end);     \
            const int count = (int)(stop_ - j0);                                                  \
            const size_t offset = (((size_t)block_ * bs_ + (size_t)(j0 - column_ * bs_)) * (kv_heads) + (kv_head)) * (d); \
            BODY;                                                                                 \
            j0 = stop_;                                                                           \
        }                                                                                         \
    } while (0)

#ifdef __AVX2__
static inline __m256 load8(const void *src, int dtype, size_t offset) {  /* 8 values of a 16-bit dtype */
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + offset));
    return dtype == DT_F16 ? _mm256_cvtph_ps(raw)
                           : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

/* scores[i] = (q . key i) * scale for `count` keys `stride` apart from `offset`: each key's dot
 * product in one order (8 lanes, then a fixed pairing), four keys in flight at a time */
static void key_scores(const float *q, const void *keys, int dtype, size_t offset, size_t stride, int count, int d,
                       float scale, float *scores) {
    int i = 0;
#ifdef __AVX2__
    if (d % 8 == 0 && dtype != DT_F32) {
        for (; i + 4 <= count; i += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const size_t o = offset + (size_t)i * stride;
            for (int c = 0; c < d; c += 8) {
                const __m256 qc = _mm256_loadu_ps(q + c);
                a0 = _mm256_fmadd_ps(qc, load8(keys, dtype, o + c), a0);
                a1 = _mm256_fmadd_ps(qc, load8(keys, dtype, o + stride + c), a1);
                a2 = _mm256_fmadd_ps(qc, load8(keys, dtype, o + 2 * stride + c), a2);
                a3 = _mm256_fmadd_ps(qc, load8(keys, dtype, o + 3 * stride + c), a3);
            }
            scores[i] = hsum8(a0) * scale;
            scores[i + 1] = hsum8(a1) * scale;
            scores[i + 2] = hsum8(a2) * scale;
            scores[i + 3] = hsum8(a3) * scale;
        }
        for (; i < count; i++) {
            __m256 a = _mm256_setzero_ps();
            const size_t o = offset + (size_t)i * stride;
            for (int c = 0; c < d; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(keys, dtype, o + c), a);
            scores[i] = hsum8(a) * scale;
        }
        return;
    }
#endif
    for (; i < count; i++) {  /* without AVX2: one chain, in element order */
        float acc = 0.0f;
        for (int c = 0; c < d; c++) acc = fmaf(q[c], load_x(keys, dtype, offset + (size_t)i * stride + c), acc);
        scores[i] = acc * scale;
    }
}

/* out[c] += sum over the run's keys, in order, of weights[i] * value i [c] (element by element:
 * the same sums at any vector width); a head's 64 lanes stay in registers across the keys */
static void add_values(float *out, const float *weights, const void *values, int dtype, size_t offset, size_t stride,
                       int count, int d) {
    int c0 = 0;
#ifdef __AVX2__
    if (dtype != DT_F32) {
        for (; c0 + 64 <= d; c0 += 64) {
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(out + c0 + 8 * c);
            for (int i = 0; i < count; i++) {
                const __m256 w = _mm256_set1_ps(weights[i]);
                const size_t o = offset + (size_t)i * stride + c0;
                #pragma GCC unroll 8
                for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(w, load8(values, dtype, o + 8 * c), acc[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + c0 + 8 * c, acc[c]);
        }
    }
#endif
    for (int i = 0; i < count; i++)
        for (int c = c0; c < d; c++) out[c] = fmaf(weights[i], load_x(values, dtype, offset + (size_t)i * stride + c), out[c]);
}

/* One row and query head over the row's own keys, in key order; scores: scratch for its keys */
static void attend_row(const dims_t *m, const layer_t *L, const pass_t *pass, int r, int head, const float *q,
                       float *scores, float *out) {
    const int d = m->head_dim, kv_head = head / (m->heads / m->kv_heads), dtype = m->dtype;
    const size_t stride = (size_t)m->kv_heads * d;
    const int64_t position = pass->positions[r];
    const int64_t end = position + 1 > 1 ? position + 1 : 1;  /* padding rows: any key, output unused */
    const int64_t start = L->window > 0 && end > L->window ? end - L->window : 0;
    const int64_t *table = pass->block_tables + (size_t)(r / pass->rows_per_sequence) * pass->table_width;
    FOR_EACH_RUN(pass, table, start, end, m->kv_heads, kv_head, d,
                 key_scores(q, L->keys, dtype, offset, stride, count, d, m->scale, scores + (j0 - start)));
    float best = -INFINITY;
    for (int64_t j = 0; j < end - start; j++) best = scores[j] > best ? scores[j] : best;
    float total = 0.0f;
    for (int64_t j = 0; j < end - start; j++) {
        scores[j] = expf(scores[j] - best);
        total += scores[j];
    }
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    FOR_EACH_RUN(pass, table, start, end, m->kv_heads, kv_head, d,
                 add_values(out, scores + (j0 - start), L->values, dtype, offset, stride, count, d));
    const float inv = 1.0f / total;
    for (int i = 0; i < d; i++) out[i] = round_to(out[i] * inv, dtype);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

typedef struct {  /* one call's arguments and scratch, shared by the pool's threads */
    const dims_t *m;
    const layer_t *layers;
    int num_layers, has_update;
    const pass_t *pass;
    float *x, *h, *wide, *narrow, *dx, *sx, *scores;
    int16_t *xq;
    size_t scores_per_thread;
} job_t;

/* Rows lo..hi-1: x += narrow (each value rounded; skipped when !add), h = rms_norm(x) with `weight`,
 * and h's rows as int16 blocks for the next product */
static void add_norm_quantize(const job_t *job, int lo, int hi, const void *weight, int add) {
    const int H = job->m->hidden, dt = job->m->dtype;
    for (int r = lo; r < hi; r++) {
        float *xr = job->x + (size_t)r * H;
        if (add)
            for (int i = 0; i < H; i++) xr[i] = round_to(xr[i] + job->narrow[(size_t)r * H + i], dt);
        rms_norm_row(xr, weight, H, job->m->eps, dt, job->h + (size_t)r * H);
    }
    quantize_rows(job->h, DT_F32, H, lo, hi, job->xq, job->dx, job->sx);
}

/* One thread's part of every layer: each phase splits its rows, heads or outputs by thread, then
 * all wait at a barrier for the next phase's inputs. */
static void run_layers(void *arg, pool_t *pool, int thread) {
    const int threads = pool->threads;
    const job_t *job = arg;
    const dims_t *m = job->m;
    const pass_t *pass = job->pass;
    const int R = pass->rows, D = m->head_dim, I = m->intermediate, dt = m->dtype;
    const int q_size = m->heads * D, kv_size = m->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    float *h = job->h, *wide = job->wide, *narrow = job->narrow;
    int rows_lo, rows_hi;
    pool_share(R, thread, threads, &rows_lo, &rows_hi);
    for (int l = 0; l < job->num_layers; l++) {
        const layer_t *L = &job->layers[l];
        /* the residual add (the previous layer's MLP output), the input norm, its int16 rows */
        add_norm_quantize(job, rows_lo, rows_hi, L->input_norm, job->has_update || l > 0);
        pool_barrier(pool);
        product(&L->qkv, R, job->xq, job->dx, job->sx, wide, dt, thread, threads);
        pool_barrier(pool);
        /* q/k norms, RoPE, and the keys and values into the pools */
        for (int r = rows_lo; r < rows_hi; r++) {
            float *row = wide + (size_t)r * qkv_size, normed[512];
            const size_t rope_offset = (size_t)r * D;
            for (int head = 0; head < m->heads + m->kv_heads; head++) {
                float *vec = row + (size_t)head * D;
                const void *norm = head < m->heads ? L->q_norm : L->k_norm;
                if (norm) {
                    rms_norm_row(vec, norm, D, m->eps, dt, normed);
                    memcpy(vec, normed, sizeof(float) * D);
                }
                rope_head(vec, pass->cos, pass->sin, rope_offset, D, dt);
            }
            const size_t slot = (size_t)pass->write_slots[r] * m->kv_heads * D;
            for (int i = 0; i < kv_size; i++) {
                store_y(L->keys, dt, slot + i, row[q_size + i]);
                store_y(L->values, dt, slot + i, row[q_size + kv_size + i]);
            }
        }
        pool_barrier(pool);
        /* attention: every (row, head) over its own keys, into h as o_proj's input; interleaved,
         * as a prompt chunk's later rows have more keys */
        for (int task = thread; task < R * m->heads; task += threads) {
            const int r = task / m->heads, head = task % m->heads;
            attend_row(m, L, pass, r, head, wide + (size_t)r * qkv_size + (size_t)head * D,
                       job->scores + (size_t)thread * job->scores_per_thread, h + (size_t)r * q_size + (size_t)head * D);
        }
        pool_barrier(pool);
        quantize_rows(h, DT_F32, q_size, rows_lo, rows_hi, job->xq, job->dx, job->sx);
        pool_barrier(pool);
        product(&L->o, R, job->xq, job->dx, job->sx, narrow, dt, thread, threads);
        pool_barrier(pool);
        add_norm_quantize(job, rows_lo, rows_hi, L->post_norm, 1);  /* the attention's output added */
        pool_barrier(pool);
        product(&L->gate_up, R, job->xq, job->dx, job->sx, wide, dt, thread, threads);
        pool_barrier(pool);
        for (int r = rows_lo; r < rows_hi; r++) {
            const float *gate = wide + (size_t)r * 2 * I, *up = gate + I;
            float *act = h + (size_t)r * I;
            for (int i = 0; i < I; i++) act[i] = round_to(round_to(silu(gate[i]), dt) * up[i], dt);
        }
        quantize_rows(h, DT_F32, I, rows_lo, rows_hi, job->xq, job->dx, job->sx);
        pool_barrier(pool);
        product(&L->down, R, job->xq, job->dx, job->sx, narrow, dt, thread, threads);
        pool_barrier(pool);
    }
}

/* Layers [0, num_layers) of `layers` on the pass's rows. x [R, hidden]: the residual stream, read
 * and written; update [R, hidden]: the previous layer's MLP output not yet added (has_update = 0:
 * none, the first layer), on return the last layer's. Both in the model's dtype.
 * Returns 0, -1 when scratch memory could not be had, -2 for a shape it does not take. */
int decoder_layers(const dims_t *m, const layer_t *layers, int num_layers, const pass_t *pass, void *x_io,
                   void *update_io, int has_update, int64_t max_keys, int threads) {
    const int R = pass->rows, H = m->hidden, D = m->head_dim, I = m->intermediate, dt = m->dtype;
    const int q_size = m->heads * D, kv_size = m->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    int max_k = H > q_size ? H : q_size;
    max_k = max_k > I ? max_k : I;
    const int widest = qkv_size > 2 * I ? qkv_size : 2 * I;
    if (D > 512 || max_k % QK || H % QK || q_size % QK || I % QK) return -2;
    threads = threads < 1 ? 1 : (threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads);
    job_t job = {.m = m, .layers = layers, .num_layers = num_layers, .has_update = has_update, .pass = pass};
    job.scores_per_thread = (size_t)(max_keys > 1 ? max_keys : 1);
    job.x = malloc(sizeof(float) * (size_t)R * H);
    job.h = malloc(sizeof(float) * (size_t)R * max_k);
    job.wide = malloc(sizeof(float) * (size_t)R * widest);
    job.narrow = malloc(sizeof(float) * (size_t)R * H);
    job.xq = malloc(sizeof(int16_t) * (size_t)R * max_k);
    job.dx = malloc(sizeof(float) * (size_t)R * (max_k / QK));
    job.sx = malloc(sizeof(float) * (size_t)R * (max_k / QK));
    job.scores = malloc(sizeof(float) * (size_t)threads * job.scores_per_thread);
    int status = 0;
    if (!job.x || !job.h || !job.wide || !job.narrow || !job.xq || !job.dx || !job.sx || !job.scores) {
        status = -1;
        goto done;
    }
    for (size_t i = 0; i < (size_t)R * H; i++) {
        job.x[i] = load_x(x_io, dt, i);
        job.narrow[i] = has_update ? load_x(update_io, dt, i) : 0.0f;
    }
    pool_run(run_layers, &job, threads);
    for (size_t i = 0; i < (size_t)R * H; i++) {
        store_y(x_io, dt, i, job.x[i]);
        store_y(update_io, dt, i, job.narrow[i]);
    }
done:
    free(job.x); free(job.h); free(job.wide); free(job.narrow); free(job.xq); free(job.dx); free(job.sx);
    free(job.scores);
    return status;
}
