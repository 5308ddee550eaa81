// The element-wise and row-wise pieces of a Llama/Qwen2/Qwen3 decoder layer around the cuBLAS GEMMs. The residual
// stream stays in f32 (x), the GEMM inputs and outputs are bf16.

#define ROW_THREADS 256

// x[r, :] = table[tokens[r], :] (bf16 -> f32). Grid: rows blocks.
extern "C" __global__ void embed_rows_bf16(const bf16_t* table, const int* tokens, float* x, int rows, int width)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const bf16_t* src = table + (size_t)tokens[r] * width;
    float* dst = x + (size_t)r * width;
    for (int e = threadIdx.x; e < width; e += blockDim.x) dst[e] = tlt_bf2f(src[e]);
}

// Row r's RMSNorm once each thread holds its partial sum of squares `ss`: the block's sum, then
// o[e] = xr[e] / sqrt(sum / width + eps) * w[e]. Every thread of the block calls it (it holds barriers).
__device__ __forceinline__ void tlt_rms_store(
    float ss, const float* xr, const bf16_t* w, bf16_t* o, int width, float eps)
{
    ss = tlt_warp_sum(ss);
    __shared__ float part[ROW_THREADS / 32];
    __shared__ float inv;
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int i = 0; i < ROW_THREADS / 32; i++) t += part[i];
        inv = rsqrtf(t / (float)width + eps);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < width; e += ROW_THREADS) o[e] = tlt_f2bf(xr[e] * inv * tlt_bf2f(w[e]));
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w (f32 in, bf16 out). Grid: rows blocks; block: ROW_THREADS.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) rms_norm_bf16(
    const float* x, const bf16_t* w, bf16_t* out, int rows, int width, float eps)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * width;
    float ss = 0.f;
    for (int e = threadIdx.x; e < width; e += ROW_THREADS) ss += xr[e] * xr[e];
    tlt_rms_store(ss, xr, w, out + (size_t)r * width, width, eps);
}

// Qwen3's q/k norms: each of `vectors` head vectors of x (bf16, [vectors, head_dim], in place) becomes
// x / sqrt(mean(x^2) + eps) * w, f32 math. One warp per vector (the whole warp returns together, so the shuffles
// see every lane); grid: ceil(vectors / (ROW_THREADS / 32)) blocks of ROW_THREADS.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) head_rms_norm_bf16(
    bf16_t* x, const bf16_t* w, int vectors, int head_dim, float eps)
{
    const int v = blockIdx.x * (ROW_THREADS / 32) + (threadIdx.x >> 5);
    if (v >= vectors) return;
    const int lane = threadIdx.x & 31;
    bf16_t* xv = x + (size_t)v * head_dim;
    float ss = 0.f;
    for (int e = lane; e < head_dim; e += 32) {
        const float f = tlt_bf2f(xv[e]);
        ss += f * f;
    }
    ss = tlt_warp_sum(ss);
    const float inv = rsqrtf(ss / (float)head_dim + eps);
    for (int e = lane; e < head_dim; e += 32) xv[e] = tlt_f2bf(tlt_bf2f(xv[e]) * inv * tlt_bf2f(w[e]));
}

// x[i] += y[i] (f32 += bf16): the residual adds. Grid-stride.
extern "C" __global__ void add_bf16_to_f32(float* x, const bf16_t* y, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        x[i] += tlt_bf2f(y[i]);
}

// gate[i] = silu(gate[i]) * up[i] (bf16, f32 math). Grid-stride.
extern "C" __global__ void silu_mul_bf16(bf16_t* gate, const bf16_t* up, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float g = tlt_bf2f(gate[i]);
        gate[i] = tlt_f2bf(g / (1.f + expf(-g)) * tlt_bf2f(up[i]));
    }
}

// y[r, c] += b[c] (bf16): the q/k/v biases of Qwen2. Grid-stride over rows * cols.
extern "C" __global__ void bias_add_bf16(bf16_t* y, const bf16_t* b, int rows, int cols)
{
    const unsigned long long n = (unsigned long long)rows * cols;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = tlt_f2bf(tlt_bf2f(y[i]) + tlt_bf2f(b[i % cols]));
}

// out[i] = lo + (hi - lo) * u_i with u_i a SplitMix64 hash of (seed, i): seeded synthetic weights generated on the
// device (no upload). Grid-stride.
extern "C" __global__ void fill_uniform_bf16(bf16_t* out, unsigned long long n, unsigned long long seed, float lo, float hi)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        out[i] = tlt_f2bf(lo + (hi - lo) * u);
    }
}

// x[r, :] += y[r, :] (f32 += bf16), then out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w: the residual add
// fused with the next RMSNorm. Grid: rows blocks; block: ROW_THREADS.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) add_rms_norm_bf16(
    float* x, const bf16_t* y, const bf16_t* w, bf16_t* out, int rows, int width, float eps)
{
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* xr = x + (size_t)r * width;
    const bf16_t* yr = y + (size_t)r * width;
    float ss = 0.f;
    for (int e = threadIdx.x; e < width; e += ROW_THREADS) {
        const float v = xr[e] + tlt_bf2f(yr[e]);
        xr[e] = v;
        ss += v * v;
    }
    tlt_rms_store(ss, xr, w, out + (size_t)r * width, width, eps);
}

// out[r, j] = silu(gu[r, j]) * gu[r, inter + j] for the packed gate/up rows of one GEMM (gu: [rows, 2 * inter]
// bf16, out: [rows, inter] bf16, f32 math). Grid-stride over rows * inter.
extern "C" __global__ void silu_mul_packed_bf16(const bf16_t* gu, bf16_t* out, int rows, int inter)
{
    const unsigned long long n = (unsigned long long)rows * inter;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = i / inter, j = i - r * inter;
        const float g = tlt_bf2f(gu[r * 2 * inter + j]);
        out[i] = tlt_f2bf(g / (1.f + expf(-g)) * tlt_bf2f(gu[r * 2 * inter + inter + j]));
    }
}
