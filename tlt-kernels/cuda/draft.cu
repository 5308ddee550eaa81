// Pieces of the EAGLE drafter's device forward (tlt-drafter's `CudaDrafter`) that the decoder layer lacks: building
// the layer input from two row sources, and the k most probable draft tokens per row, so that only k candidates per
// row cross to the host instead of the draft vocabulary's logits.

#define TOPK_THREADS 256
#define TOPK_MAX 16

// out[r, :] = [a[r, 0 .. wa); b[r, 0 .. wb)] as bf16, where each source is f32 (a32 / b32) or bf16 (a16 / b16):
// exactly one pointer of each pair is non-null, except that b may be absent altogether (wb == 0: a conversion).
// Grid: rows blocks; any block size.
extern "C" __global__ void concat_rows_bf16(
    const float* a32, const bf16_t* a16, const float* b32, const bf16_t* b16, bf16_t* out, int rows, int wa, int wb)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int w = wa + wb;
    bf16_t* o = out + (size_t)r * w;
    for (int e = threadIdx.x; e < w; e += blockDim.x) {
        if (e < wa) {
            const size_t i = (size_t)r * wa + e;
            o[e] = a32 ? tlt_f2bf(a32[i]) : a16[i];
        } else {
            const size_t i = (size_t)r * wb + (e - wa);
            o[e] = b32 ? tlt_f2bf(b32[i]) : b16[i];
        }
    }
}

// The k (<= TOPK_MAX, <= V) largest logits of every row of logits [rows, V] f32, in decreasing order with ties to
// the smaller index (the order of the host drafter's top_k), and their log-probabilities under softmax(row).
// out_idx, out_lp: [rows, k]. k passes of a block argmax that skips the entries already chosen, then one pass for
// the log-sum-exp. Grid: rows blocks; block: TOPK_THREADS.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) top_k_rows_f32(
    const float* logits, int* out_idx, float* out_lp, int rows, int V, int k)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __shared__ float w_val[TOPK_THREADS / 32];
    __shared__ int w_idx[TOPK_THREADS / 32];
    __shared__ int chosen[TOPK_MAX];
    __shared__ float s_max, s_lse;
    for (int pass = 0; pass < k; pass++) {
        float best = TLT_NEG_INF;
        int arg = 0x7fffffff;
        for (int j = tid; j < V; j += TOPK_THREADS) {
            bool taken = false;
            for (int c = 0; c < pass; c++) taken = taken || chosen[c] == j;
            if (!taken) tlt_argmax_merge(best, arg, x[j], j);
        }
        tlt_block_argmax(best, arg, w_val, w_idx);
        if (tid == 0) {
            chosen[pass] = arg < V ? arg : 0;
            if (pass == 0) s_max = best;
        }
        __syncthreads();
    }
    const float mx = s_max;
    float sum = 0.f;
    for (int j = tid; j < V; j += TOPK_THREADS) sum += expf(x[j] - mx);
    sum = tlt_warp_sum(sum);
    if (lane == 0) w_val[warp] = sum;
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < TOPK_THREADS / 32; w++) t += w_val[w];
        s_lse = mx + logf(t);
    }
    __syncthreads();
    if (tid < k) {
        const int c = chosen[tid];
        out_idx[(size_t)r * k + tid] = c;
        out_lp[(size_t)r * k + tid] = x[c] - s_lse;
    }
}
