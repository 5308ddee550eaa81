// Causal self-attention of the training forward over packed rows, and its backward (the policy update of GRPO).
//
// Layouts (bf16 as bits, row-major; T rows = the tokens of several sequences one after another):
//   qkv:    [T, (n_heads + 2 n_kv) hd]   per row: n_heads query heads, n_kv key heads, n_kv value heads (RoPE done)
//   o, d_o: [T, n_heads, hd]
//   lse, delta: [T, n_heads] f32
//   d_qkv:  [T, (n_heads + 2 n_kv) hd] f32 (q columns from the dq kernel, k and v columns from the dkv kernel)
// seq_start[r]: the row where row r's sequence starts (non-decreasing, seq_start[r] <= r; a sequence's rows are
// contiguous); row r attends to rows seq_start[r] ..= r. Query head h reads KV head h / (n_heads / n_kv).
//
// Determinism: no atomics; every sum runs in a fixed order (a warp's dot product: lane-strided partial sums then
// the xor butterfly of tlt_warp_sum; keys and (row, head) items in increasing order, one thread per output
// element), so the results are the same bits whatever the interleaving of blocks and warps. Every kernel computes
// a score the same way (ta_dot(...) * scale), so the backward's probabilities are the forward's.
// Blocks of TA_THREADS threads; hd even, at most TA_MAX_HD.

#define TA_THREADS 128
#define TA_WARPS (TA_THREADS / 32)
#define TA_TILE 32
#define TA_MAX_HD 256
#define TA_PER_THREAD (TA_MAX_HD / TA_THREADS)

// The dot product of a (shared, f32) and b (global, bf16) over hd elements, by one warp: lane l sums elements
// l, l + 32, ... in order, then the warp's butterfly. Every lane returns the same value.
__device__ __forceinline__ float ta_dot(const float* a, const bf16_t* b, int hd, int lane) {
    float s = 0.f;
    for (int d = lane; d < hd; d += 32) s += a[d] * tlt_bf2f(b[d]);
    return tlt_warp_sum(s);
}

// The first key row of query row i (seq_start[i], clamped into 0 ..= i so a bad value cannot read out of bounds).
__device__ __forceinline__ int ta_first_key(const int* seq_start, int i) {
    const int s = seq_start[i];
    return s < 0 ? 0 : (s > i ? i : s);
}

// One past the last query row that sees key row j: the first row e > j with seq_start[e] > j (a later sequence),
// or rows. Binary search over the non-decreasing seq_start.
__device__ __forceinline__ int ta_query_end(const int* seq_start, int j, int rows) {
    int lo = j + 1, hi = rows;
    while (lo < hi) {
        const int mid = lo + ((hi - lo) >> 1);
        if (seq_start[mid] > j) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// o[i, h] = softmax_j(scale q_i . k_j) v_j over j in seq_start[i] ..= i, and lse[i, h] = the natural log-sum-exp of
// those scaled scores. An online softmax over tiles of TA_TILE keys: the warps score the tile's keys (warp w: keys
// w, w + TA_WARPS, ...), warp 0 rescales the running max and sum, and thread t accumulates output elements t and
// t + TA_THREADS in f32.
// Grid: (T, n_heads); block: TA_THREADS.
extern "C" __global__ void __launch_bounds__(TA_THREADS) train_attention_fwd_bf16(
    const bf16_t* qkv, const int* seq_start, bf16_t* o, float* lse, int rows, int n_heads, int n_kv, int hd,
    float scale)
{
    const int i = blockIdx.x, h = blockIdx.y;
    if (i >= rows || h >= n_heads) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t width = (size_t)(n_heads + 2 * n_kv) * hd;
    const int g = h / (n_heads / n_kv);
    const int first = ta_first_key(seq_start, i);
    const bf16_t* keys = qkv + (size_t)(n_heads + g) * hd;
    const bf16_t* values = qkv + (size_t)(n_heads + n_kv + g) * hd;

    __shared__ float sq[TA_MAX_HD];
    __shared__ float sp[TA_TILE];
    __shared__ float s_corr, s_sum;
    for (int d = tid; d < hd; d += TA_THREADS) sq[d] = tlt_bf2f(qkv[(size_t)i * width + (size_t)h * hd + d]);

    float acc[TA_PER_THREAD];
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) acc[u] = 0.f;
    // Warp 0's running max and sum (every lane holds the same values).
    float m_run = TLT_NEG_INF, l_run = 0.f;
    for (int t0 = first; t0 <= i; t0 += TA_TILE) {
        const int n = min(TA_TILE, i + 1 - t0);
        __syncthreads();
        for (int jj = warp; jj < n; jj += TA_WARPS) {
            const float s = ta_dot(sq, keys + (size_t)(t0 + jj) * width, hd, lane) * scale;
            if (lane == 0) sp[jj] = s;
        }
        __syncthreads();
        if (warp == 0) {
            const float s = lane < n ? sp[lane] : TLT_NEG_INF;
            const float m_new = fmaxf(m_run, tlt_warp_max(s));
            const float p = lane < n ? expf(s - m_new) : 0.f;
            const float corr = expf(m_run - m_new);
            l_run = l_run * corr + tlt_warp_sum(p);
            m_run = m_new;
            sp[lane] = p;
            if (lane == 0) s_corr = corr;
        }
        __syncthreads();
        const float corr = s_corr;
#pragma unroll
        for (int u = 0; u < TA_PER_THREAD; u++) {
            const int d = tid + u * TA_THREADS;
            if (d < hd) {
                float a = acc[u] * corr;
                for (int jj = 0; jj < n; jj++) a += sp[jj] * tlt_bf2f(values[(size_t)(t0 + jj) * width + d]);
                acc[u] = a;
            }
        }
    }
    if (tid == 0) {
        s_sum = l_run;
        lse[(size_t)i * n_heads + h] = m_run + logf(l_run);
    }
    __syncthreads();
    const float l = s_sum;
    const size_t out = ((size_t)i * n_heads + h) * hd;
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) {
        const int d = tid + u * TA_THREADS;
        if (d < hd) o[out + d] = tlt_f2bf(acc[u] / l);
    }
}

// The backward to q. Per (row i, head h): delta[i, h] = sum_d dO[i, h, d] O[i, h, d] (written, for the dkv kernel);
// for j in seq_start[i] ..= i: P = exp(scale q_i . k_j - lse[i, h]), dP = dO_i . v_j, dS = P (dP - delta);
// d_qkv[i, q columns of h] = scale sum_j dS_j k_j (f32). Tiles of TA_TILE keys as the forward.
// Grid: (T, n_heads); block: TA_THREADS.
extern "C" __global__ void __launch_bounds__(TA_THREADS) train_attention_back_dq_bf16(
    const bf16_t* qkv, const int* seq_start, const bf16_t* o, const bf16_t* d_o, const float* lse, float* delta,
    float* d_qkv, int rows, int n_heads, int n_kv, int hd, float scale)
{
    const int i = blockIdx.x, h = blockIdx.y;
    if (i >= rows || h >= n_heads) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t width = (size_t)(n_heads + 2 * n_kv) * hd;
    const int g = h / (n_heads / n_kv);
    const int first = ta_first_key(seq_start, i);
    const bf16_t* keys = qkv + (size_t)(n_heads + g) * hd;
    const bf16_t* values = qkv + (size_t)(n_heads + n_kv + g) * hd;
    const size_t ih = (size_t)i * n_heads + h;

    __shared__ float sq[TA_MAX_HD];
    __shared__ float sdo[TA_MAX_HD];
    __shared__ float sds[TA_TILE];
    __shared__ float s_part[TA_WARPS];
    float part = 0.f;
    for (int d = tid; d < hd; d += TA_THREADS) {
        sq[d] = tlt_bf2f(qkv[(size_t)i * width + (size_t)h * hd + d]);
        const float go = tlt_bf2f(d_o[ih * hd + d]);
        sdo[d] = go;
        part += go * tlt_bf2f(o[ih * hd + d]);
    }
    part = tlt_warp_sum(part);
    if (lane == 0) s_part[warp] = part;
    __syncthreads();
    float dl = 0.f;
    for (int w = 0; w < TA_WARPS; w++) dl += s_part[w];
    if (tid == 0) delta[ih] = dl;
    const float l = lse[ih];

    float acc[TA_PER_THREAD];
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) acc[u] = 0.f;
    for (int t0 = first; t0 <= i; t0 += TA_TILE) {
        const int n = min(TA_TILE, i + 1 - t0);
        __syncthreads();
        for (int jj = warp; jj < n; jj += TA_WARPS) {
            const size_t row = (size_t)(t0 + jj) * width;
            const float s = ta_dot(sq, keys + row, hd, lane) * scale;
            const float dp = ta_dot(sdo, values + row, hd, lane);
            if (lane == 0) sds[jj] = expf(s - l) * (dp - dl);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < TA_PER_THREAD; u++) {
            const int d = tid + u * TA_THREADS;
            if (d < hd) {
                float a = acc[u];
                for (int jj = 0; jj < n; jj++) a += sds[jj] * tlt_bf2f(keys[(size_t)(t0 + jj) * width + d]);
                acc[u] = a;
            }
        }
    }
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) {
        const int d = tid + u * TA_THREADS;
        if (d < hd) d_qkv[(size_t)i * width + (size_t)h * hd + d] = acc[u] * scale;
    }
}

// The backward to k and v (after train_attention_back_dq_bf16, whose delta it reads). Per (key row j, KV head g):
// over the query rows i that see j (j ..< the end of j's sequence) and the query heads h of g's group, items in
// (i, h) order: P = exp(scale q_i . k_j - lse[i, h]), dS = P (dO_i . v_j - delta[i, h]); dV_j = sum P dO_i,
// dK_j = scale sum dS q_i, written (f32) into the k and v columns of d_qkv. Tiles of TA_TILE items: the warps score
// them (warp w: items w, w + TA_WARPS, ...), thread t accumulates elements t and t + TA_THREADS.
// Grid: (T, n_kv); block: TA_THREADS.
extern "C" __global__ void __launch_bounds__(TA_THREADS) train_attention_back_dkv_bf16(
    const bf16_t* qkv, const int* seq_start, const bf16_t* d_o, const float* lse, const float* delta, float* d_qkv,
    int rows, int n_heads, int n_kv, int hd, float scale)
{
    const int j = blockIdx.x, g = blockIdx.y;
    if (j >= rows || g >= n_kv) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t width = (size_t)(n_heads + 2 * n_kv) * hd;
    const int group = n_heads / n_kv;
    const int items = (ta_query_end(seq_start, j, rows) - j) * group;

    __shared__ float sk[TA_MAX_HD];
    __shared__ float sv[TA_MAX_HD];
    __shared__ float sp[TA_TILE];
    __shared__ float sds[TA_TILE];
    for (int d = tid; d < hd; d += TA_THREADS) {
        sk[d] = tlt_bf2f(qkv[(size_t)j * width + (size_t)(n_heads + g) * hd + d]);
        sv[d] = tlt_bf2f(qkv[(size_t)j * width + (size_t)(n_heads + n_kv + g) * hd + d]);
    }

    float dk[TA_PER_THREAD], dv[TA_PER_THREAD];
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) dk[u] = dv[u] = 0.f;
    for (int t0 = 0; t0 < items; t0 += TA_TILE) {
        const int n = min(TA_TILE, items - t0);
        __syncthreads();
        for (int e = warp; e < n; e += TA_WARPS) {
            const int it = t0 + e;
            const int qi = j + it / group, h = g * group + it % group;
            const size_t ih = (size_t)qi * n_heads + h;
            const float s = ta_dot(sk, qkv + (size_t)qi * width + (size_t)h * hd, hd, lane) * scale;
            const float dp = ta_dot(sv, d_o + ih * hd, hd, lane);
            if (lane == 0) {
                const float p = expf(s - lse[ih]);
                sp[e] = p;
                sds[e] = p * (dp - delta[ih]);
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < TA_PER_THREAD; u++) {
            const int d = tid + u * TA_THREADS;
            if (d < hd) {
                float a = dk[u], b = dv[u];
                for (int e = 0; e < n; e++) {
                    const int it = t0 + e;
                    const int qi = j + it / group, h = g * group + it % group;
                    const size_t ih = (size_t)qi * n_heads + h;
                    a += sds[e] * tlt_bf2f(qkv[(size_t)qi * width + (size_t)h * hd + d]);
                    b += sp[e] * tlt_bf2f(d_o[ih * hd + d]);
                }
                dk[u] = a;
                dv[u] = b;
            }
        }
    }
#pragma unroll
    for (int u = 0; u < TA_PER_THREAD; u++) {
        const int d = tid + u * TA_THREADS;
        if (d < hd) {
            d_qkv[(size_t)j * width + (size_t)(n_heads + g) * hd + d] = dk[u] * scale;
            d_qkv[(size_t)j * width + (size_t)(n_heads + n_kv + g) * hd + d] = dv[u];
        }
    }
}
