// Attention-side kernels of the CUDA rollout path: RoPE fused with the KV-cache write, and softmax attention of
// tree nodes (speculative verification), a causal chunk (prefill) or one token (decode) over a sequence's cache.
//
// Layouts (bf16 as bits, row-major):
//   q, out:             [B, n_max, n_heads, hd]   (rope_kv_write: [rows, n_heads, hd])
//   k, v (new rows):    [rows, n_kv, hd]
//   k_cache, v_cache:   one layer, [slots, max_len, n_kv, hd]
// Everything that changes between steps (positions, lengths, node counts, masks) is read from device buffers, so a
// captured CUDA graph replays with new values.

// Rotates q in place and k on its way into the cache at per-row positions (rotate-half convention of HF Llama and
// Qwen2: pairs (i, i + hd/2)), and writes v beside it. Row r belongs to cache slot row_slot[r] (negative: a padded
// row, only q is rotated), has RoPE position row_pos[r] and lands at cache position row_dst[r].
// inv_freq: [hd/2] f64. Grid: rows blocks; any block size.
extern "C" __global__ void rope_kv_write_bf16(
    bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* k_cache, bf16_t* v_cache,
    const int* row_slot, const int* row_pos, const int* row_dst, const double* inv_freq,
    int rows, int n_heads, int n_kv, int hd, int max_len)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = hd / 2;
    const int slot = row_slot[r];
    const int dst = row_dst[r];
    const bool write = slot >= 0 && dst >= 0 && dst < max_len;
    const double pos = (double)row_pos[r];
    for (int idx = threadIdx.x; idx < (n_heads + n_kv) * half; idx += blockDim.x) {
        const int h = idx / half;
        const int i = idx - h * half;
        double sd, cd;
        sincos(pos * inv_freq[i], &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        if (h < n_heads) {
            bf16_t* x = q + ((size_t)r * n_heads + h) * hd;
            const float x0 = tlt_bf2f(x[i]), x1 = tlt_bf2f(x[i + half]);
            x[i] = tlt_f2bf(x0 * c - x1 * s);
            x[i + half] = tlt_f2bf(x1 * c + x0 * s);
        } else if (write) {
            const int kh = h - n_heads;
            const size_t src = ((size_t)r * n_kv + kh) * hd;
            const size_t out = (((size_t)slot * max_len + dst) * n_kv + kh) * hd;
            const float x0 = tlt_bf2f(k[src + i]), x1 = tlt_bf2f(k[src + i + half]);
            k_cache[out + i] = tlt_f2bf(x0 * c - x1 * s);
            k_cache[out + i + half] = tlt_f2bf(x1 * c + x0 * s);
            v_cache[out + i] = v[src + i];
            v_cache[out + i + half] = v[src + i + half];
        }
    }
}

#define ATT_TILE 32
#define ATT_THREADS 128
#define ATT_MAX_GROUP 8
#define ATT_MAX_HD 128
#define ATT_PER_THREAD (ATT_MAX_GROUP * ATT_MAX_HD / ATT_THREADS)

// Softmax attention of node i of sequence b over the committed prefix (cache positions 0 .. prefix_len[b]) and over
// the sequence's new nodes (node j at cache position prefix_len[b] + j, already written by rope_kv_write_bf16).
// Node i sees node j when bit j of anc[b * n_max + i] is set (j is i or an ancestor of i; n_max <= 64); with
// anc == null the nodes are a causal chunk (node i sees nodes 0..i; any n_max). seq_slot[b]: the cache slot of
// sequence b; n_nodes[b] <= n_max: its nodes (blocks past it return at once). scale: 1/sqrt(hd), applied to q.
// One block handles one KV head's query group (n_heads / n_kv <= 8, hd <= 128) for one node, with an online
// softmax over tiles of 32 keys staged in shared memory.
// Grid: (n_kv, n_max, B); block: ATT_THREADS.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) tree_attention_bf16(
    const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, bf16_t* out,
    const int* seq_slot, const int* prefix_len, const int* n_nodes, const u64_t* anc,
    int n_max, int n_heads, int n_kv, int hd, int max_len, float scale)
{
    const int kvh = blockIdx.x, i = blockIdx.y, b = blockIdx.z;
    const int nn = n_nodes[b];
    if (i >= nn) return;
    const int group = n_heads / n_kv;
    const int slot = seq_slot[b];
    const int prefix = prefix_len[b];
    const int total = prefix + (anc ? nn : i + 1);
    const u64_t mask = anc ? anc[(size_t)b * n_max + i] : 0ull;

    __shared__ float sq[ATT_MAX_GROUP][ATT_MAX_HD];
    __shared__ float sk[ATT_TILE][ATT_MAX_HD + 1];
    __shared__ float sv[ATT_TILE][ATT_MAX_HD];
    __shared__ float sp[ATT_MAX_GROUP][ATT_TILE];
    __shared__ float s_max[ATT_MAX_GROUP], s_sum[ATT_MAX_GROUP], s_corr[ATT_MAX_GROUP];

    const int tid = threadIdx.x;
    const size_t qoff = (((size_t)b * n_max + i) * n_heads + (size_t)kvh * group) * hd;
    for (int e = tid; e < group * hd; e += ATT_THREADS) sq[e / hd][e % hd] = tlt_bf2f(q[qoff + e]) * scale;
    if (tid < group) { s_max[tid] = TLT_NEG_INF; s_sum[tid] = 0.f; }

    float acc[ATT_PER_THREAD];
#pragma unroll
    for (int a = 0; a < ATT_PER_THREAD; a++) acc[a] = 0.f;

    const size_t row = (size_t)n_kv * hd;
    const size_t base = (size_t)slot * max_len * row + (size_t)kvh * hd;
    for (int t0 = 0; t0 < total; t0 += ATT_TILE) {
        __syncthreads();
        for (int e = tid; e < ATT_TILE * hd; e += ATT_THREADS) {
            const int j = e / hd, d = e - j * hd;
            const int t = t0 + j;
            float kx = 0.f, vx = 0.f;
            if (t < total) {
                kx = tlt_bf2f(k_cache[base + (size_t)t * row + d]);
                vx = tlt_bf2f(v_cache[base + (size_t)t * row + d]);
            }
            sk[j][d] = kx;
            sv[j][d] = vx;
        }
        __syncthreads();
        for (int p = tid; p < group * ATT_TILE; p += ATT_THREADS) {
            const int g = p / ATT_TILE, j = p - g * ATT_TILE;
            const int t = t0 + j;
            const bool visible = t < total && (t < prefix || anc == 0 || ((mask >> (t - prefix)) & 1ull));
            float s = TLT_NEG_INF;
            if (visible) {
                float dot = 0.f;
                for (int d = 0; d < hd; d++) dot += sq[g][d] * sk[j][d];
                s = dot;
            }
            sp[g][j] = s;
        }
        __syncthreads();
        if (tid < group) {
            const float old = s_max[tid];
            float mx = old;
            for (int j = 0; j < ATT_TILE; j++) mx = fmaxf(mx, sp[tid][j]);
            float corr = 1.f, sum = 0.f;
            if (mx != TLT_NEG_INF) {
                corr = expf(old - mx);
                for (int j = 0; j < ATT_TILE; j++) {
                    const float e = sp[tid][j] == TLT_NEG_INF ? 0.f : expf(sp[tid][j] - mx);
                    sp[tid][j] = e;
                    sum += e;
                }
            } else {
                for (int j = 0; j < ATT_TILE; j++) sp[tid][j] = 0.f;
            }
            s_sum[tid] = s_sum[tid] * corr + sum;
            s_max[tid] = mx;
            s_corr[tid] = corr;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < ATT_PER_THREAD; a++) {
            const int e = tid + a * ATT_THREADS;
            if (e < group * hd) {
                const int g = e / hd, d = e - g * hd;
                float o = acc[a] * s_corr[g];
                for (int j = 0; j < ATT_TILE; j++) o += sp[g][j] * sv[j][d];
                acc[a] = o;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < ATT_PER_THREAD; a++) {
        const int e = tid + a * ATT_THREADS;
        if (e < group * hd) {
            const float l = s_sum[e / hd];
            out[qoff + e] = tlt_f2bf(l > 0.f ? acc[a] / l : 0.f);
        }
    }
}

#define SPLIT_TILE 32
#define SPLIT_MAX_GROUP 8
#define SPLIT_MAX_HD 128
#define SPLIT_KPAD 8

// Split-K (flash-decoding) attention: the keys a node sees are cut into chunks of split_len, one block per
// (KV head, chunk); a block has one warp per query head of the KV head's group, which scores the tile's 32 keys one
// key per lane and keeps its own online softmax, and the K/V tiles are staged in shared memory with 16-byte loads.
// Visibility, layouts and metadata as tree_attention_bf16. With out != null (a single chunk, n_splits == 1) the
// block writes the normalised bf16 output; otherwise it writes its chunk's unnormalised f32 output and (max, sum)
// to part_o [B, n_max, n_heads, n_splits, hd] and part_ml [B, n_max, n_heads, n_splits, 2] for
// attention_combine_bf16 (a chunk without visible keys writes sum 0). head_dim: a multiple of 8, at most 128.
// Grid: (n_kv * n_splits, n_max, B); block: (n_heads / n_kv) * 32.
extern "C" __global__ void __launch_bounds__(SPLIT_MAX_GROUP * 32) attention_split_bf16(
    const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, bf16_t* out, float* part_o, float* part_ml,
    const int* seq_slot, const int* prefix_len, const int* n_nodes, const u64_t* anc,
    int n_max, int n_heads, int n_kv, int hd, int max_len, int split_len, int n_splits, float scale)
{
    const int kvh = blockIdx.x / n_splits, split = blockIdx.x - kvh * n_splits;
    const int i = blockIdx.y, b = blockIdx.z;
    const int nn = n_nodes[b];
    if (i >= nn) return;
    const int group = n_heads / n_kv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = kvh * group + warp;
    const int slot = seq_slot[b];
    const int prefix = prefix_len[b];
    const int total = prefix + (anc ? nn : i + 1);
    const u64_t mask = anc ? anc[(size_t)b * n_max + i] : 0ull;
    const int t_begin = split * split_len;
    const int t_end = min(total, t_begin + split_len);
    const size_t node_head = ((size_t)b * n_max + i) * n_heads + h;
    const size_t part = node_head * n_splits + split;

    __shared__ float sq[SPLIT_MAX_GROUP][SPLIT_MAX_HD];
    __shared__ __align__(16) bf16_t sk[SPLIT_TILE][SPLIT_MAX_HD + SPLIT_KPAD];
    __shared__ __align__(16) bf16_t sv[SPLIT_TILE][SPLIT_MAX_HD];
    __shared__ float sp[SPLIT_MAX_GROUP][SPLIT_TILE];

    const size_t qoff = (((size_t)b * n_max + i) * n_heads + (size_t)kvh * group) * hd;
    for (int e = threadIdx.x; e < group * hd; e += blockDim.x) sq[e / hd][e % hd] = tlt_bf2f(q[qoff + e]) * scale;

    float m = TLT_NEG_INF, l = 0.f;
    float acc[SPLIT_MAX_HD / 32];
#pragma unroll
    for (int a = 0; a < SPLIT_MAX_HD / 32; a++) acc[a] = 0.f;

    const size_t row = (size_t)n_kv * hd;
    const size_t base = (size_t)slot * max_len * row + (size_t)kvh * hd;
    const int vecs = hd / 8;
    for (int t0 = t_begin; t0 < t_end; t0 += SPLIT_TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < SPLIT_TILE * vecs; e += blockDim.x) {
            const int j = e / vecs, c = e - j * vecs;
            const int t = t0 + j;
            uint4 kx = {0u, 0u, 0u, 0u}, vx = {0u, 0u, 0u, 0u};
            if (t < t_end) {
                kx = tlt_ld16(k_cache + base + (size_t)t * row + c * 8);
                vx = tlt_ld16(v_cache + base + (size_t)t * row + c * 8);
            }
            tlt_st16(&sk[j][c * 8], kx);
            tlt_st16(&sv[j][c * 8], vx);
        }
        __syncthreads();
        const int t = t0 + lane;
        const bool visible = t < t_end && (t < prefix || anc == 0 || ((mask >> (t - prefix)) & 1ull));
        float s = TLT_NEG_INF;
        if (visible) {
            float dot = 0.f;
            for (int d = 0; d < hd; d++) dot += sq[warp][d] * tlt_bf2f(sk[lane][d]);
            s = dot;
        }
        const float m_new = fmaxf(m, tlt_warp_max(s));
        const float p = s == TLT_NEG_INF ? 0.f : expf(s - m_new);
        const float corr = m == TLT_NEG_INF ? 0.f : expf(m - m_new);
        l = l * corr + tlt_warp_sum(p);
        m = m_new;
        sp[warp][lane] = p;
        __syncwarp();
#pragma unroll
        for (int a = 0; a < SPLIT_MAX_HD / 32; a++) {
            const int d = lane + a * 32;
            if (d < hd) {
                float o = acc[a] * corr;
                for (int j = 0; j < SPLIT_TILE; j++) o += sp[warp][j] * tlt_bf2f(sv[j][d]);
                acc[a] = o;
            }
        }
        __syncwarp();
    }
    if (out != 0) {
#pragma unroll
        for (int a = 0; a < SPLIT_MAX_HD / 32; a++) {
            const int d = lane + a * 32;
            if (d < hd) out[node_head * hd + d] = tlt_f2bf(l > 0.f ? acc[a] / l : 0.f);
        }
        return;
    }
#pragma unroll
    for (int a = 0; a < SPLIT_MAX_HD / 32; a++) {
        const int d = lane + a * 32;
        if (d < hd) part_o[part * hd + d] = acc[a];
    }
    if (lane == 0) {
        part_ml[2 * part] = m;
        part_ml[2 * part + 1] = l;
    }
}

// Combines the chunks of attention_split_bf16: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s over the
// chunks with l_s > 0 (M: their largest m_s). Grid: (n_heads, n_max, B); block: 128.
extern "C" __global__ void attention_combine_bf16(
    const float* part_o, const float* part_ml, bf16_t* out, const int* n_nodes, int n_max, int n_heads, int hd,
    int n_splits)
{
    const int h = blockIdx.x, i = blockIdx.y, b = blockIdx.z;
    if (i >= n_nodes[b]) return;
    const size_t node_head = ((size_t)b * n_max + i) * n_heads + h;
    const size_t base = node_head * n_splits;
    float mx = TLT_NEG_INF;
    for (int s = 0; s < n_splits; s++)
        if (part_ml[2 * (base + s) + 1] > 0.f) mx = fmaxf(mx, part_ml[2 * (base + s)]);
    float sum = 0.f;
    for (int s = 0; s < n_splits; s++) {
        const float l = part_ml[2 * (base + s) + 1];
        if (l > 0.f) sum += expf(part_ml[2 * (base + s)] - mx) * l;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < n_splits; s++) {
            if (part_ml[2 * (base + s) + 1] > 0.f) o += expf(part_ml[2 * (base + s)] - mx) * part_o[(base + s) * hd + d];
        }
        out[node_head * hd + d] = tlt_f2bf(sum > 0.f ? o / sum : 0.f);
    }
}

#define QKV_THREADS 256
#define QKV_MAX_QK 10240

// The epilogue of the fused q/k/v projection, one block per row of qkv ([rows, q_dim + 2 * kv_dim] bf16, one GEMM's
// output): the bias added (bias: [q_dim + 2 * kv_dim] or null, Qwen2), every head's q and k RMS-normalised (q_norm,
// k_norm: [hd] or null, Qwen3), RoPE at the row's position (as rope_kv_write_bf16) on q, written to q_out
// ([rows, n_heads, hd]), and on k, written with v into layer `layer`'s caches at the row's slot and position
// (k_cache, v_cache: that layer, [slots, max_len, n_kv, hd]). A padded row (slot < 0) or one past max_len writes only
// q_out. q_dim + kv_dim <= QKV_MAX_QK. Grid: rows blocks; block: QKV_THREADS.
extern "C" __global__ void __launch_bounds__(QKV_THREADS) qkv_rope_kv_write_bf16(
    const bf16_t* qkv, const bf16_t* bias, const bf16_t* q_norm, const bf16_t* k_norm, bf16_t* q_out,
    bf16_t* k_cache, bf16_t* v_cache, const int* row_slot, const int* row_pos, const int* row_dst,
    const double* inv_freq, int rows, int n_heads, int n_kv, int hd, int max_len, float eps)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int qd = n_heads * hd, kvd = n_kv * hd, width = qd + 2 * kvd;
    const int slot = row_slot[r];
    const int dst = row_dst[r];
    const bool write = slot >= 0 && dst >= 0 && dst < max_len;
    const bf16_t* in = qkv + (size_t)r * width;
    const size_t cache_row = ((size_t)slot * max_len + dst) * kvd;
    __shared__ float sx[QKV_MAX_QK];
    for (int e = threadIdx.x; e < qd + 2 * kvd; e += QKV_THREADS) {
        const float v = tlt_bf2f(in[e]) + (bias ? tlt_bf2f(bias[e]) : 0.f);
        if (e < qd + kvd) sx[e] = v;
        else if (write) v_cache[cache_row + (e - qd - kvd)] = tlt_f2bf(v);
    }
    __syncthreads();
    if (q_norm != 0) {
        // One warp per head vector (q heads, then k heads).
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        for (int hh = warp; hh < n_heads + n_kv; hh += QKV_THREADS / 32) {
            float* xv = sx + hh * hd;
            float ss = 0.f;
            for (int e = lane; e < hd; e += 32) ss += xv[e] * xv[e];
            ss = tlt_warp_sum(ss);
            const float inv = rsqrtf(ss / (float)hd + eps);
            const bf16_t* w = hh < n_heads ? q_norm : k_norm;
            for (int e = lane; e < hd; e += 32) xv[e] = xv[e] * inv * tlt_bf2f(w[e]);
        }
        __syncthreads();
    }
    const int half = hd / 2;
    const double pos = (double)row_pos[r];
    for (int idx = threadIdx.x; idx < (n_heads + n_kv) * half; idx += QKV_THREADS) {
        const int h = idx / half;
        const int i = idx - h * half;
        double sd, cd;
        sincos(pos * inv_freq[i], &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        const float x0 = sx[h * hd + i], x1 = sx[h * hd + i + half];
        const bf16_t y0 = tlt_f2bf(x0 * c - x1 * s), y1 = tlt_f2bf(x1 * c + x0 * s);
        if (h < n_heads) {
            q_out[((size_t)r * n_heads + h) * hd + i] = y0;
            q_out[((size_t)r * n_heads + h) * hd + i + half] = y1;
        } else if (write) {
            const size_t o = cache_row + (size_t)(h - n_heads) * hd;
            k_cache[o + i] = y0;
            k_cache[o + i + half] = y1;
        }
    }
}
