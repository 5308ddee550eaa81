// Commit of an accepted speculative path: the K/V rows and hidden rows of the accepted nodes move to the positions
// right after the committed prefix, so the cache again holds one contiguous sequence.

// For every layer, node path[b][kk] (kk < n_acc[b]) of sequence b moves from cache position prefix_len[b] +
// path[b][kk] to prefix_len[b] + kk. Paths start at the root (path[b][0] == 0) and increase, so path[kk] >= kk:
// walking kk upwards never overwrites a row that a later step still reads. Rows past max_len are not touched.
// k_cache, v_cache: [layers, slots, max_len, n_kv * hd] bf16; path: [B, max_path]. Grid: (B, layers); any block.
extern "C" __global__ void commit_path_bf16(
    bf16_t* k_cache, bf16_t* v_cache, const int* seq_slot, const int* prefix_len, const int* path,
    const int* n_acc, int max_path, int slots, int max_len, int row)
{
    const int b = blockIdx.x, layer = blockIdx.y;
    const int n = min(n_acc[b], max_path);
    const int prefix = prefix_len[b];
    const size_t base = ((size_t)layer * slots + seq_slot[b]) * (size_t)max_len * row;
    for (int kk = 0; kk < n; kk++) {
        const int src = path[(size_t)b * max_path + kk];
        if (src == kk) continue;
        if (prefix + src >= max_len || src < kk) break;
        const size_t from = base + (size_t)(prefix + src) * row;
        const size_t to = base + (size_t)(prefix + kk) * row;
        for (int e = threadIdx.x; e < row; e += blockDim.x) {
            k_cache[to + e] = k_cache[from + e];
            v_cache[to + e] = v_cache[from + e];
        }
        __syncthreads();
    }
}

// dst[b][kk] = src[b][path[b][kk]] for kk < n_acc[b]: the hidden rows of the accepted nodes, packed for the host
// (the drafter's features). src: [B, n_max, width] bf16; dst: [B, max_path, width]. Grid: (max_path, B).
extern "C" __global__ void gather_path_rows_bf16(
    const bf16_t* src, bf16_t* dst, const int* path, const int* n_acc, int n_max, int max_path, int width)
{
    const int kk = blockIdx.x, b = blockIdx.y;
    if (kk >= n_acc[b] || kk >= max_path) return;
    const int node = path[(size_t)b * max_path + kk];
    if (node < 0 || node >= n_max) return;
    const bf16_t* from = src + ((size_t)b * n_max + node) * width;
    bf16_t* to = dst + ((size_t)b * max_path + kk) * width;
    for (int e = threadIdx.x; e < width; e += blockDim.x) to[e] = from[e];
}
