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

#define MMA_ROWS 16
#define MMA_TILE 16
#define MMA_WARPS 4
#define MMA_MAX_HD 128
#define MMA_MAX_TREE 64
#define MMA_STRIDE (MMA_MAX_HD + 8)
#define MMA_STAGE_BYTES (2 * MMA_WARPS * MMA_TILE * MMA_STRIDE * 2)
#define MMA_MERGE_BYTES ((MMA_WARPS * MMA_ROWS * MMA_MAX_HD + 2 * MMA_WARPS * MMA_ROWS) * 4)
#define MMA_SMEM_BYTES (MMA_STAGE_BYTES > MMA_MERGE_BYTES ? MMA_STAGE_BYTES : MMA_MERGE_BYTES)

// A warp's 16-key tile of K and V (keys t0 .. t0 + 15 of one KV head: k, v point at key 0 of it, keys `row` apart)
// into registers, 16 bytes at a time: the tile is 2 * hd vectors of each, hd / 16 per lane; keys at or past t_end
// are zeros.
__device__ __forceinline__ void mma_load_tile(uint4* pk, uint4* pv, const bf16_t* k, const bf16_t* v, size_t row,
                                              int t0, int t_end, int lane, int vecs, int nks)
{
#pragma unroll
    for (int a = 0; a < MMA_MAX_HD / 16; a++) {
        const int e = lane + 32 * a, j = e / vecs, c = e - j * vecs;
        const bool in = a < nks && t0 + j < t_end;
        const uint4 zero = {0u, 0u, 0u, 0u};
        pk[a] = in ? tlt_ld16(k + (size_t)(t0 + j) * row + c * 8) : zero;
        pv[a] = in ? tlt_ld16(v + (size_t)(t0 + j) * row + c * 8) : zero;
    }
}

// As mma_load_tile, key j of the tile read at cache position pos[j] (negative: zeros).
__device__ __forceinline__ void mma_gather_tile(uint4* pk, uint4* pv, const bf16_t* k, const bf16_t* v, size_t row,
                                                const int* pos, int lane, int vecs, int nks)
{
#pragma unroll
    for (int a = 0; a < MMA_MAX_HD / 16; a++) {
        const int e = lane + 32 * a, j = e / vecs, c = e - j * vecs;
        const int p = a < nks ? pos[j] : -1;
        const uint4 zero = {0u, 0u, 0u, 0u};
        pk[a] = p >= 0 ? tlt_ld16(k + (size_t)p * row + c * 8) : zero;
        pv[a] = p >= 0 ? tlt_ld16(v + (size_t)p * row + c * 8) : zero;
    }
}

// Split-K (flash-decoding) attention on the tensor cores, for decode, tree verification and causal chunks, cut so
// that a row's output bits never depend on the other rows of the launch (the batch, the tree around a node).
//
// A row's keys are its LOGICAL key sequence: the committed prefix (cache positions 0 .. prefix_len[b]), then, for a
// tree node, its ancestors by depth and itself (node j at cache position prefix_len[b] + j; with anc, the set bits
// of the node's mask in increasing order, parents having smaller indices than their children), for a causal row
// (anc == null) nodes 0 .. i. So a decode row after d committed tokens and the tree node at depth d over the same
// prefix see the same keys at the same logical positions. The keys are cut into chunks of chunk_len (a multiple of
// 64, fixed per cache and device by the plan, never by the batch) at logical positions 0, chunk_len, 2 chunk_len...;
// a chunk's 16-key tiles lie at fixed offsets from its start, warp w taking tiles w, w + 4, ... with its own online
// softmax, the warps merged in warp order, a row's chunks combined in chunk order: the same keys give the same
// bits. A block serves one KV head, one chunk and one row tile of a sequence: 16 query rows, (node, head) pairs of
// 16 / group consecutive nodes times the KV head's group of query heads. A tile of keys wholly inside the prefix is
// read once for all 16 rows (every query head of a group and every node of a tree share it); a tile reaching past
// the prefix is read and computed once per node of the row tile (in tree mode and for decode, n_max == 1), gathered
// by logical position, with zeros past the node's keys, and only that node's rows take the result, so a decode row
// and a verify row present the same keys (and zeros) in the same lanes of the tensor cores. Causal chunks of
// several rows (prefill) share every tile, masked per row (they need not agree with decode bit for bit).
// A warp loads its next shared tile into registers (16-byte loads) while it computes the current one from shared
// memory: S = Q K^T and O = O * corr + P V on mma.sync m16n8k16 (bf16 in, f32 accumulation), P V summed from zero
// per tile with P split into three bf16 parts so that the products keep f32 accuracy. A row whose keys fit one
// chunk is written (normalised bf16) by its chunk's block; otherwise every chunk's block writes its unnormalised f32
// output and (max, sum) to part_o [B, n_max, n_heads, n_splits, hd] and part_ml [B, n_max, n_heads, n_splits, 2],
// and the last block of the row tile's chunks to arrive (arrivals: one counter per (sequence, row tile, KV head),
// [B, row_tiles, n_kv], zero before the launch and left zero) combines them into out, a warp per row, its lanes
// over the head dim, the row's chunks 0 .. n - 1 in order: no second launch. Blocks of chunks past the row tile's
// keys return at once. part_o, part_ml and arrivals may be null when n_splits == 1. Visibility, layouts and
// metadata as tree_attention_bf16. head_dim: a multiple of 16, at most 128; n_heads / n_kv <= 16; n_splits *
// chunk_len >= max_len. Grid: (row_tiles * n_splits * n_kv, 1, B), the row tile fastest (tiles sharing a chunk run
// together, and meet its K/V in L2); block: 128.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) attention_split_bf16(
    const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache, bf16_t* out, float* part_o, float* part_ml,
    int* arrivals, const int* seq_slot, const int* prefix_len, const int* n_nodes, const u64_t* anc,
    int n_max, int n_heads, int n_kv, int hd, int max_len, int n_splits, int chunk_len, int row_tiles, float scale)
{
    const int rt = blockIdx.x % row_tiles;
    const int split = (blockIdx.x / row_tiles) % n_splits;
    const int kvh = blockIdx.x / (row_tiles * n_splits);
    const int b = blockIdx.z;
    const int group = n_heads / n_kv;
    const int per_tile = MMA_ROWS / group;
    const int nn = n_nodes[b];
    const int i0 = rt * per_tile;
    if (i0 >= nn) return;
    const int i_end = min(nn, i0 + per_tile);
    const int tile_nodes = i_end - i0;
    const int prefix = prefix_len[b];
    const int slot = seq_slot[b];
    // Whether tiles past the prefix are read per node (trees, decode) or shared by the rows (causal chunks).
    const bool per_node = anc != 0 || n_max == 1;

    // Per node of the row tile: its logical length and (trees) its ancestors by depth, as node indices.
    __shared__ int slen[MMA_ROWS];
    __shared__ unsigned char spath[MMA_ROWS][MMA_MAX_TREE];
    __shared__ int spos[MMA_WARPS][MMA_TILE];
    if ((int)threadIdx.x < tile_nodes) {
        const int n = threadIdx.x, i = i0 + n;
        int len = prefix + i + 1;
        if (anc) {
            const u64_t mask = anc[(size_t)b * n_max + i];
            int depth = 0;
            for (int j = 0; j < MMA_MAX_TREE; j++)
                if ((mask >> j) & 1ull) spath[n][depth++] = (unsigned char)j;
            len = prefix + depth;
        }
        slen[n] = len;
    }
    __syncthreads();
    int tile_len = 0;
    for (int n = 0; n < tile_nodes; n++) tile_len = max(tile_len, slen[n]);
    const int tile_chunks = (tile_len + chunk_len - 1) / chunk_len;
    if (split >= tile_chunks) return;
    const int t_begin = split * chunk_len;
    const int t_end = min(tile_len, t_begin + chunk_len);

    __shared__ __align__(16) unsigned char smem[MMA_SMEM_BYTES];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    bf16_t* sk = reinterpret_cast<bf16_t*>(smem) + warp * MMA_TILE * MMA_STRIDE;
    bf16_t* sv = reinterpret_cast<bf16_t*>(smem) + (MMA_WARPS + warp) * MMA_TILE * MMA_STRIDE;

    // This lane's two rows (g and g + 8): node, whether the row exists, and its logical length.
    int node[2], rlen[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = g + 8 * h;
        node[h] = i0 + r / group;
        live[h] = r < per_tile * group && node[h] < i_end;
        rlen[h] = live[h] ? slen[node[h] - i0] : 0;
    }
    // The tile's 16 query rows (bf16 as stored, zero for rows that do not exist; the scale is applied to the
    // scores), read as A fragments from shared memory at every tile (in registers they would spill).
    __shared__ __align__(16) bf16_t sq[MMA_ROWS][MMA_STRIDE];
    for (int e = threadIdx.x; e < MMA_ROWS * hd; e += MMA_WARPS * 32) {
        const int r = e / hd, d = e - r * hd, i = i0 + r / group;
        const bool exists = r < per_tile * group && i < i_end;
        sq[r][d] = exists ? q[(((size_t)b * n_max + i) * n_heads + kvh * group + r % group) * hd + d] : (bf16_t)0;
    }
    __syncthreads();
    const int nks = hd / 16;

    float o[MMA_MAX_HD / 8][4];
#pragma unroll
    for (int n = 0; n < MMA_MAX_HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {TLT_NEG_INF, TLT_NEG_INF}, l[2] = {0.f, 0.f};

    const size_t row = (size_t)n_kv * hd;
    const size_t base = (size_t)slot * max_len * row + (size_t)kvh * hd;
    const int vecs = hd / 8;
    // A warp's 16 x hd tile is 2 * hd 16-byte vectors of K (and as many of V): hd / 16 per lane.
    uint4 pk[MMA_MAX_HD / 16], pv[MMA_MAX_HD / 16];
    int t0 = t_begin + warp * MMA_TILE;
    if (t0 < t_end && (!per_node || t0 + MMA_TILE <= prefix))
        mma_load_tile(pk, pv, k_cache + base, v_cache + base, row, t0, t_end, lane, vecs, nks);
    for (; t0 < t_end; t0 += MMA_WARPS * MMA_TILE) {
        const bool shared = !per_node || t0 + MMA_TILE <= prefix;
        const int passes = shared ? 1 : tile_nodes;
        for (int ps = 0; ps < passes; ps++) {
            if (!shared) {
                // Node i0 + ps alone: its keys t0 .. t0 + 15 by logical position (warp-uniform skip).
                const int len = slen[ps];
                if (len <= t0) continue;
                if (lane < MMA_TILE) {
                    const int t = t0 + lane;
                    int p = -1;
                    if (t < len) p = t < prefix ? t : prefix + (anc ? (int)spath[ps][t - prefix] : t - prefix);
                    spos[warp][lane] = p;
                }
                __syncwarp();
                mma_gather_tile(pk, pv, k_cache + base, v_cache + base, row, spos[warp], lane, vecs, nks);
            }
            __syncwarp();
#pragma unroll
            for (int a = 0; a < MMA_MAX_HD / 16; a++) {
                const int e = lane + 32 * a, j = e / vecs, c = e - j * vecs;
                if (a < nks) {
                    tlt_st16(sk + j * MMA_STRIDE + c * 8, pk[a]);
                    tlt_st16(sv + j * MMA_STRIDE + c * 8, pv[a]);
                }
            }
            __syncwarp();
            if (shared) {
                const int nt = t0 + MMA_WARPS * MMA_TILE;
                if (nt < t_end && (!per_node || nt + MMA_TILE <= prefix))
                    mma_load_tile(pk, pv, k_cache + base, v_cache + base, row, nt, t_end, lane, vecs, nks);
            }
            // The rows this pass updates: every row on a shared tile, the pass's node's rows otherwise.
            bool act[2];
#pragma unroll
            for (int h = 0; h < 2; h++) act[h] = live[h] && (shared || node[h] == i0 + ps);
            // S = Q K^T over the tile's 16 keys: two 8-key column blocks.
            float s[2][4];
#pragma unroll
            for (int n = 0; n < 2; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
                const bf16_t* kr = sk + (n * 8 + g) * MMA_STRIDE + 2 * t4;
#pragma unroll
                for (int ks = 0; ks < MMA_MAX_HD / 16; ks++) {
                    if (ks < nks) {
                        const unsigned* q0 = reinterpret_cast<const unsigned*>(&sq[g][ks * 16 + 2 * t4]);
                        const unsigned* q1 = reinterpret_cast<const unsigned*>(&sq[g + 8][ks * 16 + 2 * t4]);
                        const unsigned qa[4] = {q0[0], q1[0], q0[4], q1[4]};
                        const unsigned b0 = *reinterpret_cast<const unsigned*>(kr + ks * 16);
                        const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + ks * 16 + 8);
                        tlt_mma_bf16(s[n], qa, b0, b1);
                    }
                }
            }
            // Scale, mask (a row sees its keys below its logical length), and the online softmax of each of the
            // lane's rows (a row's 16 scores lie in the 4 lanes of its quad).
            float mx[2] = {TLT_NEG_INF, TLT_NEG_INF};
#pragma unroll
            for (int n = 0; n < 2; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1, t = t0 + n * 8 + 2 * t4 + (e & 1);
                    const bool visible = act[h] && t < rlen[h] && t < t_end;
                    s[n][e] = visible ? s[n][e] * scale : TLT_NEG_INF;
                    mx[h] = fmaxf(mx[h], s[n][e]);
                }
            }
            float corr[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                const float m_new = fmaxf(m[h], mx[h]);
                corr[h] = m[h] == TLT_NEG_INF ? 0.f : expf(m[h] - m_new);
                if (act[h]) {
                    m[h] = m_new;
                    l[h] *= corr[h];
                }
            }
            // P as three bf16 A fragments (high, middle and low parts: p = hi + mid + lo within 2^-24 relative).
            unsigned pa[3][4];
#pragma unroll
            for (int n = 0; n < 2; n++) {
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int h = e >> 1;
                    float p0 = s[n][e] == TLT_NEG_INF ? 0.f : expf(s[n][e] - m[h]);
                    float p1 = s[n][e + 1] == TLT_NEG_INF ? 0.f : expf(s[n][e + 1] - m[h]);
                    if (act[h]) l[h] += p0 + p1;
                    // A fragment of P (16 rows x 16 keys): register 2n + h holds row g + 8h, keys 8n + 2t, + 1.
#pragma unroll
                    for (int part = 0; part < 3; part++) {
                        const bf16_t b0 = tlt_f2bf(p0), b1 = tlt_f2bf(p1);
                        pa[part][2 * n + h] = tlt_pack_bf16x2(b0, b1);
                        p0 -= tlt_bf2f(b0);
                        p1 -= tlt_bf2f(b1);
                    }
                }
            }
            // O = O * corr + P V, one 8-dim column block at a time (P V from zero, so that a row's result does not
            // depend on what the tile's other rows hold); rows outside the pass keep their O.
            const bf16_t* v0 = sv + (2 * t4) * MMA_STRIDE + g;
#pragma unroll
            for (int n = 0; n < MMA_MAX_HD / 8; n++) {
                if (n < hd / 8) {
                    const bf16_t* vc = v0 + n * 8;
                    const unsigned b0 = tlt_pack_bf16x2(vc[0], vc[MMA_STRIDE]);
                    const unsigned b1 = tlt_pack_bf16x2(vc[8 * MMA_STRIDE], vc[9 * MMA_STRIDE]);
                    float pv_acc[4] = {0.f, 0.f, 0.f, 0.f};
                    tlt_mma_bf16(pv_acc, pa[0], b0, b1);
                    tlt_mma_bf16(pv_acc, pa[1], b0, b1);
                    tlt_mma_bf16(pv_acc, pa[2], b0, b1);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1;
                        o[n][e] = act[h] ? fmaf(o[n][e], corr[h], pv_acc[e]) : o[n][e];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }

    // Merge the warps' states: the staging area becomes wo [warps][16][hd], wm and wl [warps][16].
    __syncthreads();
    float* wo = reinterpret_cast<float*>(smem);
    float* wm = wo + MMA_WARPS * MMA_ROWS * MMA_MAX_HD;
    float* wl = wm + MMA_WARPS * MMA_ROWS;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = g + 8 * h;
        if (t4 == 0) {
            wm[warp * MMA_ROWS + r] = m[h];
            wl[warp * MMA_ROWS + r] = l[h];
        }
#pragma unroll
        for (int n = 0; n < MMA_MAX_HD / 8; n++) {
            if (n < hd / 8) {
                float* dst = wo + (warp * MMA_ROWS + r) * MMA_MAX_HD + n * 8 + 2 * t4;
                dst[0] = o[n][2 * h];
                dst[1] = o[n][2 * h + 1];
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < MMA_ROWS * hd; e += MMA_WARPS * 32) {
        const int r = e / hd, d = e - r * hd;
        const int i = i0 + r / group;
        if (r >= per_tile * group || i >= i_end) continue;
        // This row's chunks: its own keys alone decide them.
        const int row_chunks = (slen[r / group] + chunk_len - 1) / chunk_len;
        if (split >= row_chunks) continue;
        float mm = TLT_NEG_INF;
        for (int w = 0; w < MMA_WARPS; w++)
            if (wl[w * MMA_ROWS + r] > 0.f) mm = fmaxf(mm, wm[w * MMA_ROWS + r]);
        float ll = 0.f, oo = 0.f;
        for (int w = 0; w < MMA_WARPS; w++) {
            const float lw = wl[w * MMA_ROWS + r];
            if (lw > 0.f) {
                const float f = expf(wm[w * MMA_ROWS + r] - mm);
                ll = fmaf(f, lw, ll);
                oo = fmaf(f, wo[(w * MMA_ROWS + r) * MMA_MAX_HD + d], oo);
            }
        }
        const size_t node_head = ((size_t)b * n_max + i) * n_heads + kvh * group + r % group;
        if (row_chunks == 1) {
            out[node_head * hd + d] = tlt_f2bf(ll > 0.f ? oo / ll : 0.f);
        } else {
            const size_t part = node_head * n_splits + split;
            part_o[part * hd + d] = oo;
            if (d == 0) {
                part_ml[2 * part] = mm;
                part_ml[2 * part + 1] = ll;
            }
        }
    }
    if (tile_chunks == 1) return;

    // The last of the row tile's tile_chunks blocks to arrive combines every row of more than one chunk, a warp per
    // row, its lanes over the head dim: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s over the row's chunks
    // s = 0 .. n - 1 in order (M: their largest m_s, a maximum in any order), whichever block that is; it resets the
    // counter for the next launch (a replayed graph).
    __shared__ int s_last;
    const int arrival = (b * row_tiles + rt) * n_kv + kvh;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(arrivals + arrival, 1) == tile_chunks - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int r = warp; r < per_tile * group; r += MMA_WARPS) {
        const int i = i0 + r / group;
        const int row_chunks = i < i_end ? (slen[r / group] + chunk_len - 1) / chunk_len : 0;
        if (row_chunks <= 1) continue;
        const size_t node_head = ((size_t)b * n_max + i) * n_heads + kvh * group + r % group;
        const size_t pbase = node_head * n_splits;
        float mx = TLT_NEG_INF;
        for (int sp = lane; sp < row_chunks; sp += 32)
            if (__ldcg(part_ml + 2 * (pbase + sp) + 1) > 0.f) mx = fmaxf(mx, __ldcg(part_ml + 2 * (pbase + sp)));
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float sum = 0.f, acc[MMA_MAX_HD / 32];
#pragma unroll
        for (int a = 0; a < MMA_MAX_HD / 32; a++) acc[a] = 0.f;
        // Unrolled so that the loads of several chunks are in flight at once; the sums stay in chunk order.
#pragma unroll 4
        for (int sp = 0; sp < row_chunks; sp++) {
            const float ls = __ldcg(part_ml + 2 * (pbase + sp) + 1);
            if (ls > 0.f) {
                const float f = expf(__ldcg(part_ml + 2 * (pbase + sp)) - mx);
                sum = fmaf(f, ls, sum);
                const float* po = part_o + (pbase + sp) * hd;
#pragma unroll
                for (int a = 0; a < MMA_MAX_HD / 32; a++)
                    if (lane + 32 * a < hd) acc[a] = fmaf(f, __ldcg(po + lane + 32 * a), acc[a]);
            }
        }
#pragma unroll
        for (int a = 0; a < MMA_MAX_HD / 32; a++)
            if (lane + 32 * a < hd) out[node_head * hd + lane + 32 * a] = tlt_f2bf(sum > 0.f ? acc[a] / sum : 0.f);
    }
    if (threadIdx.x == 0) arrivals[arrival] = 0;
}

#define QKV_MAX_THREADS 128

// The epilogue of the fused q/k/v projection (qkv: [rows, q_dim + 2 * kv_dim] bf16, one GEMM's output; per row its
// n_heads q heads, n_kv k heads and n_kv v heads, each hd wide), one block per head vector of a row, one thread per
// RoPE pair (i, i + hd/2), so a batch-1 step spreads over n_heads + 2 n_kv blocks and every thread loads its two
// elements at once: the bias added (bias: [q_dim + 2 * kv_dim] or null, Qwen2), a q or k head RMS-normalised
// (q_norm, k_norm: [hd] or null, Qwen3), RoPE at the row's position (as rope_kv_write_bf16) on q, written to q_out
// ([rows, n_heads, hd]), and on k, written with v into layer `layer`'s caches at the row's slot and position
// (k_cache, v_cache: that layer, [slots, max_len, n_kv, hd]). A padded row (slot < 0) or one past max_len writes only
// q_out. hd even, hd / 2 <= QKV_MAX_THREADS. Grid: (rows, n_heads + 2 * n_kv) (rows in x: a grid's y is at most
// 65,535); block: hd / 2 rounded up to a warp.
extern "C" __global__ void __launch_bounds__(QKV_MAX_THREADS) qkv_rope_kv_write_bf16(
    const bf16_t* qkv, const bf16_t* bias, const bf16_t* q_norm, const bf16_t* k_norm, bf16_t* q_out,
    bf16_t* k_cache, bf16_t* v_cache, const int* row_slot, const int* row_pos, const int* row_dst,
    const double* inv_freq, int rows, int n_heads, int n_kv, int hd, int max_len, float eps)
{
    const int r = blockIdx.x, hh = blockIdx.y;
    if (r >= rows) return;
    const int kvd = n_kv * hd, width = n_heads * hd + 2 * kvd;
    const int slot = row_slot[r];
    const int dst = row_dst[r];
    const bool write = slot >= 0 && dst >= 0 && dst < max_len;
    const size_t cache_row = ((size_t)slot * max_len + dst) * kvd;
    const bf16_t* in = qkv + (size_t)r * width + (size_t)hh * hd;
    const int half = hd / 2, i = threadIdx.x;
    const bool mine = i < half;
    float x0 = 0.f, x1 = 0.f;
    if (mine) {
        x0 = tlt_bf2f(in[i]) + (bias ? tlt_bf2f(bias[hh * hd + i]) : 0.f);
        x1 = tlt_bf2f(in[i + half]) + (bias ? tlt_bf2f(bias[hh * hd + i + half]) : 0.f);
    }
    if (hh >= n_heads + n_kv) {
        if (mine && write) {
            const size_t o = cache_row + (size_t)(hh - n_heads - n_kv) * hd;
            v_cache[o + i] = tlt_f2bf(x0);
            v_cache[o + i + half] = tlt_f2bf(x1);
        }
        return;
    }
    if (q_norm != 0) {
        __shared__ float part[QKV_MAX_THREADS / 32];
        const float ss = tlt_block_sum(x0 * x0 + x1 * x1, part);
        const float inv = rsqrtf(ss / (float)hd + eps);
        const bf16_t* w = hh < n_heads ? q_norm : k_norm;
        if (mine) {
            x0 = x0 * inv * tlt_bf2f(w[i]);
            x1 = x1 * inv * tlt_bf2f(w[i + half]);
        }
    }
    if (!mine) return;
    double sd, cd;
    sincos((double)row_pos[r] * inv_freq[i], &sd, &cd);
    const float sn = (float)sd, cs = (float)cd;
    const bf16_t y0 = tlt_f2bf(x0 * cs - x1 * sn), y1 = tlt_f2bf(x1 * cs + x0 * sn);
    if (hh < n_heads) {
        q_out[((size_t)r * n_heads + hh) * hd + i] = y0;
        q_out[((size_t)r * n_heads + hh) * hd + i + half] = y1;
    } else if (write) {
        const size_t o = cache_row + (size_t)(hh - n_heads) * hd;
        k_cache[o + i] = y0;
        k_cache[o + i + half] = y1;
    }
}

// The tensor-core product as attention_split_bf16 uses it, for a test against a CPU product: D = A B for one warp,
// A (16x16) and B (16x8) bf16 row-major in memory, loaded into fragments by tlt_mma_bf16's layout, D (16x8) f32
// row-major. A wrong reading of the PTX fragment layout shows here, on a GPU, before it shows as wrong attention.
// Grid: 1; block: 32.
extern "C" __global__ void mma_bf16_probe(const bf16_t* a, const bf16_t* b, float* d)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned fa[4];
    fa[0] = tlt_pack_bf16x2(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
    fa[1] = tlt_pack_bf16x2(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
    fa[2] = tlt_pack_bf16x2(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
    fa[3] = tlt_pack_bf16x2(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
    const unsigned b0 = tlt_pack_bf16x2(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);
    const unsigned b1 = tlt_pack_bf16x2(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    tlt_mma_bf16(acc, fa, b0, b1);
    d[g * 8 + 2 * t] = acc[0];
    d[g * 8 + 2 * t + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t] = acc[2];
    d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
