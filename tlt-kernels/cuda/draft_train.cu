// The EAGLE-2 drafter's training losses on the device (tlt-drafter's CudaDrafterTrainer), around the cuBLAS GEMMs
// and the decoder layer's training kernels of train.cu: the soft cross-entropy between the target's and the draft's
// next-token distributions and the SmoothL1 regression of the predicted features, each forward (per row) and
// backward. Rows are row-major [rows, width].
//
// Deterministic as train.cu: no atomics, each output element written by one thread, every reduction in a fixed
// order (a thread's strided partial in index order, the warp's xor butterfly, then the warps' sums in warp order).

#define DT_THREADS 256
#define DT_WARPS (DT_THREADS / 32)

// The largest element of row x[0 .. n) and its first index (ties to the smaller index; -1 when no element is larger
// than -inf), returned to every thread. w_val, w_idx: shared scratch of DT_WARPS entries; s_val, s_idx: shared
// cells for the broadcast.
__device__ __forceinline__ void dt_row_argmax(
    const float* x, int n, float* w_val, int* w_idx, float* s_val, int* s_idx, float& best, int& arg)
{
    best = TLT_NEG_INF;
    arg = 0x7fffffff;
    for (int e = threadIdx.x; e < n; e += DT_THREADS) tlt_argmax_merge(best, arg, x[e], e);
    __syncthreads();
    tlt_block_argmax(best, arg, w_val, w_idx);
    if (threadIdx.x == 0) {
        *s_val = best;
        *s_idx = arg < n ? arg : -1;
    }
    __syncthreads();
    best = *s_val;
    arg = *s_idx;
}

// Per row r of the target's logits tgt and the draft's logits drf ([rows, vocab] f32): with p = softmax(tgt) and
// q = softmax(drf), loss[r] = -sum_v p_v log q_v (the soft cross-entropy), lse_t[r] and lse_d[r] the two
// log-sum-exps (what soft_ce_back_f32 reads), arg_t[r] and arg_d[r] the two argmaxes (ties to the smaller index).
// Max-subtracted: with S_t = sum exp(tgt - m_t), S_d = sum exp(drf - m_d) and C = sum exp(tgt - m_t) (drf - m_d)
// (the exponentials in f32, the sums in f64; entries with p_v == 0 add nothing to C), loss = log S_d - C / S_t.
// Grid: rows blocks; block: DT_THREADS.
extern "C" __global__ void __launch_bounds__(DT_THREADS) soft_ce_f32(
    const float* tgt, const float* drf, float* loss, float* lse_t, float* lse_d, int* arg_t, int* arg_d, int rows,
    int vocab)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    __shared__ float w_val[DT_WARPS];
    __shared__ int w_idx[DT_WARPS];
    __shared__ double part[DT_WARPS];
    __shared__ float s_val;
    __shared__ int s_idx;
    const float* tr = tgt + (size_t)r * vocab;
    const float* dr = drf + (size_t)r * vocab;
    float mt, md;
    int it, id;
    dt_row_argmax(tr, vocab, w_val, w_idx, &s_val, &s_idx, mt, it);
    dt_row_argmax(dr, vocab, w_val, w_idx, &s_val, &s_idx, md, id);
    double st = 0.0, sd = 0.0, c = 0.0;
    for (int e = threadIdx.x; e < vocab; e += DT_THREADS) {
        const float et = expf(tr[e] - mt);
        const float zd = dr[e] - md;
        st += (double)et;
        sd += (double)expf(zd);
        if (et > 0.f) c += (double)et * (double)zd;
    }
    st = tlt_block_sum_d(st, part);
    sd = tlt_block_sum_d(sd, part);
    c = tlt_block_sum_d(c, part);
    if (threadIdx.x == 0) {
        const double ls = log(sd);
        loss[r] = (float)(ls - c / st);
        lse_t[r] = (float)((double)mt + log(st));
        lse_d[r] = (float)((double)md + ls);
        arg_t[r] = it;
        arg_d[r] = id;
    }
}

// The gradient of sum_r w[r] * loss[r] (soft_ce_f32's loss) with respect to the draft's logits:
// d[r, v] = w[r] * (exp(drf - lse_d[r]) - exp(tgt - lse_t[r])) (f32 math) rounded to bf16; a row with w[r] == 0 gets
// zeros. Grid: (rows, chunks): block (r, y) strides over row r from y * DT_THREADS.
extern "C" __global__ void __launch_bounds__(DT_THREADS) soft_ce_back_f32(
    const float* tgt, const float* drf, const float* lse_t, const float* lse_d, const float* w, bf16_t* d, int rows,
    int vocab)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const size_t o = (size_t)r * vocab;
    const float wr = w[r], lt = lse_t[r], ld = lse_d[r];
    for (int j = blockIdx.y * DT_THREADS + threadIdx.x; j < vocab; j += gridDim.y * DT_THREADS) {
        const float g = wr == 0.f ? 0.f : wr * (expf(drf[o + j] - ld) - expf(tgt[o + j] - lt));
        d[o + j] = tlt_f2bf(g);
    }
}

// SmoothL1 (Huber, beta 1) of x - y elementwise: 0.5 d^2 for |d| < 1, else |d| - 0.5 (f32).
__device__ __forceinline__ float dt_smooth_l1(float d)
{
    const float a = fabsf(d);
    return a < 1.f ? 0.5f * d * d : a - 0.5f;
}

// loss[r] = mean_c smooth_l1(pred[r, c] - target[r, c]) ([rows, width] f32; the elements in f32, the row's sum in
// f64, divided by width once). Grid: rows blocks; block: DT_THREADS.
extern "C" __global__ void __launch_bounds__(DT_THREADS) smooth_l1_f32(
    const float* pred, const float* target, float* loss, int rows, int width)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    __shared__ double part[DT_WARPS];
    const size_t o = (size_t)r * width;
    double s = 0.0;
    for (int e = threadIdx.x; e < width; e += DT_THREADS) s += (double)dt_smooth_l1(pred[o + e] - target[o + e]);
    s = tlt_block_sum_d(s, part);
    if (threadIdx.x == 0) loss[r] = (float)(s / (double)width);
}

// The gradient of sum_r w[r] * loss[r] (smooth_l1_f32's loss) with respect to pred: dx[r, c] = w[r] * clamp(pred -
// target, -1, 1) / width (f32, written; a NaN difference stays NaN). Grid-stride over rows * width.
extern "C" __global__ void smooth_l1_back_f32(
    const float* pred, const float* target, const float* w, float* dx, int rows, int width)
{
    const unsigned long long n = (unsigned long long)rows * width;
    const float inv = 1.f / (float)width;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float d = pred[i] - target[i];
        const float c = d != d ? d : fminf(fmaxf(d, -1.f), 1.f);
        dx[i] = w[i / width] * c * inv;
    }
}
