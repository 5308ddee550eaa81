// Kernels of the GRPO policy update on the device (forward pieces, backward, AdamW) around the cuBLAS GEMMs and the
// attention kernels of train_attention.cu. Activations are row-major [rows, width], rows being the tokens of several
// sequences packed one after another.
//
// Every result is deterministic: no atomics, each output element is written by one thread, and every reduction
// runs in a fixed order (a thread's strided partial in index order, the warp's xor butterfly, whose lanes all end
// with the same bits, then the warps' sums in warp order), so the same inputs give the same bits whatever the
// order the blocks run in.

#define TRAIN_THREADS 256
#define TRAIN_WARPS (TRAIN_THREADS / 32)

// A double passed as its bit pattern (launch arguments are int, float, u64 or pointers).
__device__ __forceinline__ double train_f64(u64_t bits) { return __longlong_as_double((long long)bits); }

// RoPE in place on bf16 rows (x: [rows, stride]): the `heads` vectors of hd starting at column col0 of row r are
// rotated at position pos[r], rotate-half convention (pairs (i, i + hd/2)), angle pos * inv_freq[i] in f64, its sine
// and cosine rounded to f32, the rotation in f32: exactly rope_kv_write_bf16's arithmetic. Grid: rows blocks.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) rope_rows_bf16(
    bf16_t* x, const int* pos, const double* inv_freq, int rows, int stride, int col0, int heads, int hd)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = hd / 2;
    const double p = (double)pos[r];
    bf16_t* xr = x + (size_t)r * stride + col0;
    for (int idx = threadIdx.x; idx < heads * half; idx += TRAIN_THREADS) {
        const int h = idx / half;
        const int i = idx - h * half;
        double sd, cd;
        sincos(p * inv_freq[i], &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        bf16_t* v = xr + (size_t)h * hd;
        const float x0 = tlt_bf2f(v[i]), x1 = tlt_bf2f(v[i + half]);
        v[i] = tlt_f2bf(x0 * c - x1 * s);
        v[i + half] = tlt_f2bf(x1 * c + x0 * s);
    }
}

// The backward of rope_rows_bf16 in place on f32 gradients (dx: [rows, stride]): each pair rotated by the negative
// angle (the rotation's transpose), with the same f32 sine and cosine. Grid: rows blocks.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) rope_rows_back_f32(
    float* dx, const int* pos, const double* inv_freq, int rows, int stride, int col0, int heads, int hd)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = hd / 2;
    const double p = (double)pos[r];
    float* xr = dx + (size_t)r * stride + col0;
    for (int idx = threadIdx.x; idx < heads * half; idx += TRAIN_THREADS) {
        const int h = idx / half;
        const int i = idx - h * half;
        double sd, cd;
        sincos(p * inv_freq[i], &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        float* v = xr + (size_t)h * hd;
        const float g0 = v[i], g1 = v[i + half];
        v[i] = g0 * c + g1 * s;
        v[i + half] = g1 * c - g0 * s;
    }
}

// The backward of rms_norm_bf16 (y = x * rstd * w, rstd = rsqrt(mean(x^2) + eps), computed exactly as the forward
// does): dx[r, :] += rstd * g - x * rstd^3 * sum(g * x) / width with g = dy * w (added: dx is the residual stream's
// gradient), and dw_rows[r, :] = dy * (x * rstd), the row's contribution to the weight's gradient (col_sum_f32
// reduces it). f32 math, fixed-order block sums. Grid: rows blocks; block: TRAIN_THREADS.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) rms_norm_back_f32(
    const float* x, const bf16_t* w, const float* dy, float* dx, float* dw_rows, int rows, int width, float eps)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    __shared__ float part[TRAIN_WARPS];
    const size_t o = (size_t)r * width;
    const float* xr = x + o;
    const float* dyr = dy + o;
    float ss = 0.f, dot = 0.f;
    for (int e = threadIdx.x; e < width; e += TRAIN_THREADS) {
        const float v = xr[e];
        ss += v * v;
        dot += dyr[e] * tlt_bf2f(w[e]) * v;
    }
    ss = tlt_block_sum(ss, part);
    dot = tlt_block_sum(dot, part);
    const float rs = rsqrtf(ss / (float)width + eps);
    const float k = rs * rs * rs * dot / (float)width;
    for (int e = threadIdx.x; e < width; e += TRAIN_THREADS) {
        const float v = xr[e], d = dyr[e];
        dx[o + e] += rs * (d * tlt_bf2f(w[e])) - v * k;
        dw_rows[o + e] = d * (v * rs);
    }
}

#define COLSUM_COLS 32
#define COLSUM_SLICES (TRAIN_THREADS / COLSUM_COLS)

// dst[c] = (accumulate ? dst[c] : 0) + sum_r src[r, c] (src: [rows, cols] f32). A block owns 32 columns; its warp w
// sums rows w, w + 8, w + 16, ... of its lane's column in f64 in row order, then one thread adds the 8 partials in
// warp order to the previous value (in f64) and rounds to f32 once. Grid: ceil(cols / 32) blocks; block:
// TRAIN_THREADS.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) col_sum_f32(
    const float* src, float* dst, int rows, int cols, int accumulate)
{
    const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
    const int c = blockIdx.x * COLSUM_COLS + lane;
    __shared__ double part[COLSUM_SLICES][COLSUM_COLS];
    double s = 0.0;
    if (c < cols)
        for (int r = slice; r < rows; r += COLSUM_SLICES) s += (double)src[(size_t)r * cols + c];
    part[slice][lane] = s;
    __syncthreads();
    if (slice == 0 && c < cols) {
        double t = accumulate ? (double)dst[c] : 0.0;
        for (int k = 0; k < COLSUM_SLICES; k++) t += part[k][lane];
        dst[c] = (float)t;
    }
}

// The backward of silu_mul_packed_bf16 (act = silu(gate) * up, gu: [rows, 2 * inter] bf16 with the gate in columns
// 0..inter and up in inter..2 * inter): d_gu in the same packed layout, d_gate = d * up * s * (1 + g * (1 - s)) with
// s = sigmoid(g), d_up = d * silu(g) (silu as the forward computes it), f32 math rounded to bf16 (d_act: [rows,
// inter] f32). Grid-stride over rows * inter.
extern "C" __global__ void silu_mul_back_bf16(const bf16_t* gu, const float* d_act, bf16_t* d_gu, int rows, int inter)
{
    const unsigned long long n = (unsigned long long)rows * inter;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = i / inter, j = i - r * inter;
        const unsigned long long gi = r * 2 * inter + j, ui = gi + inter;
        const float g = tlt_bf2f(gu[gi]), u = tlt_bf2f(gu[ui]), d = d_act[i];
        const float e = 1.f + expf(-g);
        const float s = 1.f / e;
        d_gu[gi] = tlt_f2bf(d * u * s * (1.f + g * (1.f - s)));
        d_gu[ui] = tlt_f2bf(d * (g / e));
    }
}

// Per row of logits ([rows, vocab] f32) with z = logits * inv_temp: lse[r] = logsumexp(z) (max-subtracted, the sum
// of exponentials in f64), logp[r] = z[targets[r]] - lse[r] (0 when targets[r] < 0, NaN when >= vocab), and with
// entropy (may be null) entropy[r] = -sum p log p = log S - sum(e * (z - max)) / S. Grid: rows blocks; block:
// TRAIN_THREADS.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) token_logprobs_f32(
    const float* logits, const int* targets, float* logp, float* lse, float* entropy, int rows, int vocab,
    float inv_temp)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    __shared__ float part[TRAIN_WARPS];
    __shared__ double part_d[TRAIN_WARPS];
    const float* zr = logits + (size_t)r * vocab;
    float m = TLT_NEG_INF;
    for (int e = threadIdx.x; e < vocab; e += TRAIN_THREADS) m = fmaxf(m, zr[e] * inv_temp);
    m = tlt_block_max(m, part);
    double s = 0.0, t = 0.0;
    for (int e = threadIdx.x; e < vocab; e += TRAIN_THREADS) {
        const float d = zr[e] * inv_temp - m;
        const float x = expf(d);
        s += (double)x;
        if (x > 0.f) t += (double)x * (double)d;
    }
    s = tlt_block_sum_d(s, part_d);
    if (entropy != 0) t = tlt_block_sum_d(t, part_d);
    if (threadIdx.x == 0) {
        const double ls = log(s);
        const double l = (double)m + ls;
        lse[r] = (float)l;
        const int tgt = targets[r];
        logp[r] = tgt < 0 ? 0.f : tgt >= vocab ? TLT_NAN : (float)((double)(zr[tgt] * inv_temp) - l);
        if (entropy != 0) entropy[r] = (float)(ls - t / s);
    }
}

// The gradient with respect to the logits of sum_r g_logp[r] * logp[r] (+ sum_r g_ent[r] * entropy[r] when g_ent is
// given; entropy then holds token_logprobs_f32's entropies), for every element: with z = logits * inv_temp,
// p = exp(z - lse[r]), dz_j = g_logp[r] * ([j == target] - p_j) (nothing for a row with target < 0)
// + g_ent[r] * (-p_j * (log p_j + H_r)), dlogits_j = dz_j * inv_temp rounded to bf16. Grid: (rows, chunks): block
// (r, y) strides over row r's vocabulary from y * TRAIN_THREADS.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) token_logprobs_back_f32(
    const float* logits, const int* targets, const float* lse, const float* entropy, const float* g_logp,
    const float* g_ent, bf16_t* dlogits, int rows, int vocab, float inv_temp)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const size_t o = (size_t)r * vocab;
    const int tgt = targets[r];
    const float gl = tgt >= 0 ? g_logp[r] : 0.f;
    const float ge = g_ent != 0 ? g_ent[r] : 0.f;
    const float h = g_ent != 0 ? entropy[r] : 0.f;
    const float l = lse[r];
    for (int j = blockIdx.y * TRAIN_THREADS + threadIdx.x; j < vocab; j += gridDim.y * TRAIN_THREADS) {
        const float lp = logits[o + j] * inv_temp - l;
        const float p = expf(lp);
        float dz = gl * ((j == tgt ? 1.f : 0.f) - p);
        if (p > 0.f) dz += ge * (-p * (lp + h));
        dlogits[o + j] = tlt_f2bf(dz * inv_temp);
    }
}

// The backward of the embedding gather without atomics: segment s (one block) is token seg_token[s] and covers
// rows order[seg_start[s] .. seg_start[s + 1]] of dx ([rows, width] f32); d_table[seg_token[s], :] += the sum of
// those rows, added in order in f32. Segments must name distinct tokens (each table row has one writer). Indices
// out of range (a row outside 0..rows, a token outside 0..vocab, a segment bound outside 0..n_order) are skipped.
// Grid: max(segments, 1) blocks.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) embed_back_f32(
    const int* order, const int* seg_start, const int* seg_token, const float* dx, float* d_table, int segments,
    int width, int rows, int vocab, int n_order)
{
    const int s = blockIdx.x;
    if (s >= segments) return;
    const int a = max(seg_start[s], 0), b = min(seg_start[s + 1], n_order);
    const int tok = seg_token[s];
    if (tok < 0 || tok >= vocab) return;
    float* dst = d_table + (size_t)tok * width;
    for (int c = threadIdx.x; c < width; c += TRAIN_THREADS) {
        float acc = 0.f;
        for (int k = a; k < b; k++) {
            const int row = order[k];
            if (row >= 0 && row < rows) acc += dx[(size_t)row * width + c];
        }
        dst[c] += acc;
    }
}

// partials[b] = the sum of x[i]^2 (f64) over block b's fixed grid-stride share (i = b * TRAIN_THREADS + t + k *
// gridDim * TRAIN_THREADS), for a fixed grid; the host adds the partials in order. Grid: SUM_SQUARES_BLOCKS.
extern "C" __global__ void __launch_bounds__(TRAIN_THREADS) sum_squares_f32(
    const float* x, double* partials, unsigned long long n)
{
    __shared__ double part[TRAIN_WARPS];
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)TRAIN_THREADS + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * TRAIN_THREADS) {
        const double v = (double)x[i];
        s += v * v;
    }
    s = tlt_block_sum_d(s, part);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// AdamW on f32 parameters, element by element, as the host optimizer (tlt-model's AdamW::update) computes it, bit
// for bit: f64 arithmetic with no contraction (the __d*_rn intrinsics), g scaled by coef only when coef < 1, the
// moments rounded to f32, w = w * decay - step_size * m / (sqrt(v) / bc2_sqrt + eps) rounded to f32, and out = w
// rounded to bf16. The doubles come as bit patterns, computed on the host (step_size = lr / bc1, decay =
// 1 - lr * weight_decay). Grid-stride.
extern "C" __global__ void adamw_f32(
    float* w, float* m, float* v, const float* g, bf16_t* out, unsigned long long n, u64_t beta1_bits,
    u64_t beta2_bits, u64_t eps_bits, u64_t step_size_bits, u64_t decay_bits, u64_t bc2_sqrt_bits, u64_t coef_bits)
{
    const double beta1 = train_f64(beta1_bits), beta2 = train_f64(beta2_bits), eps = train_f64(eps_bits);
    const double step_size = train_f64(step_size_bits), decay = train_f64(decay_bits);
    const double bc2_sqrt = train_f64(bc2_sqrt_bits), coef = train_f64(coef_bits);
    const double omb1 = __dsub_rn(1.0, beta1), omb2 = __dsub_rn(1.0, beta2);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        double gk = (double)g[i];
        if (coef < 1.0) gk = __dmul_rn(gk, coef);
        const float mk = (float)__dadd_rn(__dmul_rn(beta1, (double)m[i]), __dmul_rn(omb1, gk));
        const float vk = (float)__dadd_rn(__dmul_rn(beta2, (double)v[i]), __dmul_rn(__dmul_rn(omb2, gk), gk));
        m[i] = mk;
        v[i] = vk;
        const double denom = __dadd_rn(__ddiv_rn(__dsqrt_rn((double)vk), bc2_sqrt), eps);
        const double p = __dsub_rn(__dmul_rn((double)w[i], decay), __ddiv_rn(__dmul_rn(step_size, (double)mk), denom));
        const float pw = (float)p;
        w[i] = pw;
        out[i] = tlt_f2bf(pw);
    }
}

// dst[i] = src[i] rounded to bf16 (nearest even). Grid-stride.
extern "C" __global__ void cast_f32_bf16(const float* src, bf16_t* dst, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = tlt_f2bf(src[i]);
}

// dst[i] += src[i] (f32). Grid-stride.
extern "C" __global__ void add_f32(float* dst, const float* src, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

// dst[i] *= s (f32; s given as an f32). Grid-stride.
extern "C" __global__ void scale_f32(float* dst, float s, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = dst[i] * s;
}

// out[i] = bf16(base[i] + s * delta[i]): a LoRA delta merged into a frozen bf16 weight, the sum in f32, rounded to
// bf16 nearest even. Grid-stride.
extern "C" __global__ void lora_merge_bf16(const bf16_t* base, const float* delta, float s, bf16_t* out,
                                           unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = tlt_f2bf(tlt_bf2f(base[i]) + s * delta[i]);
}
