// Sampling and tree acceptance on the device, so that only accepted tokens, their log-probs and the requested
// hidden rows cross to the host. Same rule as tlt_spec_decode::verify_coupled on the CPU: the target's token at
// every node is the inverse-CDF draw of softmax(logits / T) in vocabulary order with the coin of the node's output
// position (argmax at temperature 0), and the walk from the root descends into the child drafting that token.
// Every committed token is then an exact draw from the target's distribution, and speculative decoding commits
// the same tokens as plain decoding with the same coins.

#define SAMPLE_THREADS 256

// Per row of logits [rows, V] f32: target token (argmax when coins == null, else the inverse-CDF draw with coin
// coins[row] in [0, 1)), its log-probability under softmax(logits * inv_temp), and that distribution's largest
// probability. A row the CPU sampler rejects (a NaN or +inf logit, or none above -inf) gets token -1 and NaN
// log-probability and p_max, for the host to report. Grid: rows blocks; block: SAMPLE_THREADS. Each thread owns a
// contiguous chunk of the vocabulary so that the cumulative sums follow vocabulary order.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows_f32(
    const float* logits, const double* coins, int* out_tok, float* out_logprob, float* out_pmax,
    int rows, int V, float inv_temp)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * V;
    const int tid = threadIdx.x;
    const int chunk = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = min(V, tid * chunk), hi = min(V, lo + chunk);
    __shared__ float w_val[SAMPLE_THREADS / 32];
    __shared__ int w_idx[SAMPLE_THREADS / 32];
    __shared__ double c_sum[SAMPLE_THREADS];
    __shared__ float s_max;
    __shared__ int s_arg;
    __shared__ int s_bad;
    if (tid == 0) s_bad = 0;
    __syncthreads();

    // 1. max and first argmax, and whether the row is one the CPU sampler rejects.
    float best = TLT_NEG_INF;
    int arg = 0x7fffffff;
    bool bad = false;
    for (int j = lo; j < hi; j++) {
        const float v = x[j];
        bad = bad || v != v || v == TLT_POS_INF;
        tlt_argmax_merge(best, arg, v, j);
    }
    if (bad) s_bad = 1;
    tlt_block_argmax(best, arg, w_val, w_idx);
    if (tid == 0) {
        s_max = best;
        s_arg = arg;
        if (best == TLT_NEG_INF) s_bad = 1;
    }
    __syncthreads();
    if (s_bad) {
        if (tid == 0) { out_tok[r] = -1; out_logprob[r] = TLT_NAN; out_pmax[r] = TLT_NAN; }
        return;
    }
    const float mx = s_max;

    // 2. the chunk's share of the normaliser.
    double sum = 0.0;
    for (int j = lo; j < hi; j++) sum += (double)expf((x[j] - mx) * inv_temp);
    c_sum[tid] = sum;
    __syncthreads();

    // 3. the target token: argmax, or the chunk holding coin * total, walked in vocabulary order.
    if (tid == 0) {
        double total = 0.0;
        for (int t = 0; t < SAMPLE_THREADS; t++) total += c_sum[t];
        int tok = s_arg;
        if (coins != 0) {
            const double target = coins[r] * total;
            double acc = 0.0;
            int owner = -1;
            for (int t = 0; t < SAMPLE_THREADS; t++) {
                if (c_sum[t] > 0.0) owner = t;
                if (c_sum[t] > 0.0 && acc + c_sum[t] > target) break;
                acc += c_sum[t];
            }
            if (owner >= 0) {
                const int a = owner * chunk, z = min(V, a + chunk);
                int last = -1;
                for (int j = a; j < z; j++) {
                    const double e = (double)expf((x[j] - mx) * inv_temp);
                    if (e > 0.0) last = j;
                    acc += e;
                    if (e > 0.0 && acc > target) break;
                }
                tok = last >= 0 ? last : s_arg;
            }
        }
        out_tok[r] = tok;
        const double lse = log(total);
        out_logprob[r] = (float)((double)((x[tok] - mx) * inv_temp) - lse);
        out_pmax[r] = (float)(1.0 / total);
    }
}

// The walk over each sequence's draft tree. Node 0 is the root (the last committed token, fed again); parent[c] <
// c for every other node (topological order); draft_tok[c] is node c's drafted token; target_tok / target_lp come
// from sample_rows_f32 over the tree's rows (target_pm: each row's largest probability). From the root, the walk moves to the first child whose drafted token is
// the target's token at the current node, and stops where none is.
// Out per sequence: path[b][0 .. n_acc) the nodes walked (path[0] = 0), and tokens / logprobs[b][0 .. n_acc) the
// committed tokens: the accepted drafts, then the target's token after the last accepted node, and pmax[b] the
// largest probability of the distribution each was drawn from. All arrays [B, n_max]. One thread per sequence.
extern "C" __global__ void tree_accept(
    const int* parent, const int* draft_tok, const int* target_tok, const float* target_lp, const float* target_pm,
    const int* n_nodes, int* path, int* n_acc, int* tokens, float* logprobs, float* pmax, int B, int n_max)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const size_t o = (size_t)b * n_max;
    const int nn = min(n_nodes[b], n_max);
    int cur = 0, len = 1;
    path[o] = 0;
    for (;;) {
        const int want = target_tok[o + cur];
        tokens[o + len - 1] = want;
        logprobs[o + len - 1] = target_lp[o + cur];
        pmax[o + len - 1] = target_pm[o + cur];
        int next = -1;
        for (int c = cur + 1; c < nn; c++) {
            if (parent[o + c] == cur && draft_tok[o + c] == want) { next = c; break; }
        }
        if (next < 0 || len >= n_max) break;
        path[o + len] = next;
        len++;
        cur = next;
    }
    n_acc[b] = len;
}
