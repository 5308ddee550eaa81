// Batch-invariant GEMMs for the decode and verify shapes, with the layer's element-wise work fused in:
// y[r, c] = sum_k a[r, k] * w[c, k] on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulation).
//
// Batch invariance: every output element's reduction over K has one order whatever the number of rows M. The K
// axis is cut into steps of 32; warp w of the block's 8 sums the steps s with s % k_groups == w, in increasing s,
// each step as two mma products (the lane's 8 consecutive elements of k give both products' fragments, the same
// permutation for A and B); then the warps' sums are added in warp order (((w0 + w1) + w2) + ...). A row's
// fragments never meet another row's, the tile shapes (rows per block, blocks per grid) only decide which rows a
// block serves. k_groups is 8 in every plan (`SKINNY_K_GROUPS`); another value is the negative control of the
// tests (an M-dependent split must fail them).
//
// Prologue (x given): the rows are RMS-normalised on the fly, a[r, k] = bf16(x[r, k] * inv_r * norm[k]) with
// inv_r = rsqrt(mean(x[r, :]^2) + eps), each row's sum of squares taken by one warp in a fixed order (the lane's
// 8-element groups in increasing k, then the warp's xor butterfly). With a_out, the blocks of the first column
// tile also store the normalised rows (the final norm's rows, which the drafter reads).
// Epilogues (mode):
//   0 y bf16 [M, N] = bf16(acc), with a bias bf16(bf16(acc) + b[c]);
//   1 y f32 [M, N] += bf16(acc): the residual add (y must not be x: other blocks read x);
//   2 y bf16 [M, N / 2] = silu(g) * u with g = bf16(acc) of weight row c and u = bf16(acc) of row N / 2 + c: the
//     MLP's packed gate/up projection and its SwiGLU (f32 math, as silu_mul_packed_bf16);
//   3 y f32 [M, N] = acc: the LM head's logits.
// Requirements (checked by the plan): K % 8 == 0 (16-byte loads), N even for mode 2.
// Grid: (column tiles, ceil(M / 64)); a column tile is 32 weight rows (mode 2: 16 gate rows and their 16 up
// rows); block: 256 threads.

#define SKINNY_THREADS 256
#define SKINNY_WARPS 8
#define SKINNY_NT 32
#define SKINNY_MT 64

__device__ __forceinline__ uint4 skinny_ld16_f32(const float* p) {
    TLT_ALIGN16(p);
    return *reinterpret_cast<const uint4*>(p);
}

// The 8 elements a[r, kk .. kk + 8) as packed bf16 pairs: from bf16 rows, or normalised from f32 rows.
__device__ __forceinline__ uint4 skinny_row8(
    const bf16_t* a, const float* x, const bf16_t* norm, float inv, int r, int kk, int k)
{
    if (a != nullptr) return tlt_ld16(a + (size_t)r * k + kk);
    const float* xr = x + (size_t)r * k + kk;
    const uint4 lo = skinny_ld16_f32(xr), hi = skinny_ld16_f32(xr + 4);
    const uint4 g = tlt_ld16(norm + kk);
    const unsigned xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const unsigned gs[4] = {g.x, g.y, g.z, g.w};
    unsigned out[4];
    for (int i = 0; i < 4; i++) {
        const float g0 = tlt_bf2f((bf16_t)(gs[i] & 0xffffu)), g1 = tlt_bf2f((bf16_t)(gs[i] >> 16));
        const bf16_t v0 = tlt_f2bf(__uint_as_float(xs[2 * i]) * inv * g0);
        const bf16_t v1 = tlt_f2bf(__uint_as_float(xs[2 * i + 1]) * inv * g1);
        out[i] = tlt_pack_bf16x2(v0, v1);
    }
    uint4 v;
    v.x = out[0];
    v.y = out[1];
    v.z = out[2];
    v.w = out[3];
    return v;
}

extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) skinny_gemm_bf16(
    const bf16_t* a, const float* x, const bf16_t* norm, bf16_t* a_out, const bf16_t* w, const bf16_t* bias,
    void* y, int m, int n, int k, float eps, int mode, int k_groups)
{
    __shared__ float inv_s[SKINNY_MT];
    __shared__ float acc_s[SKINNY_MT][SKINNY_NT + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * SKINNY_MT;
    const int rows = min(SKINNY_MT, m - row0);
    if (rows <= 0) return;
    const int mt = (rows + 15) / 16;
    const int half_n = n / 2;

    // The prologue's row norms: warp w takes rows w, w + 8, ...
    if (x != nullptr) {
        for (int r = warp; r < rows; r += SKINNY_WARPS) {
            const float* xr = x + (size_t)(row0 + r) * k;
            float ss = 0.f;
            for (int e = lane * 8; e < k; e += 256) {
                const uint4 lo = skinny_ld16_f32(xr + e), hi = skinny_ld16_f32(xr + e + 4);
                const unsigned xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                for (int i = 0; i < 8; i++) {
                    const float v = __uint_as_float(xs[i]);
                    ss += v * v;
                }
            }
            ss = tlt_warp_sum(ss);
            if (lane == 0) inv_s[r] = rsqrtf(ss / (float)k + eps);
        }
    }
    __syncthreads();

    // The weight row behind tile column j (0..31), or -1 past the matrix.
    auto weight_row = [&](int j) -> int {
        if (mode == 2) {
            const int c = blockIdx.x * (SKINNY_NT / 2) + (j & 15);
            if (c >= half_n) return -1;
            return j < 16 ? c : half_n + c;
        }
        const int c = blockIdx.x * SKINNY_NT + j;
        return c < n ? c : -1;
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    int wrow[4];
    for (int nt = 0; nt < 4; nt++) wrow[nt] = weight_row(nt * 8 + g);
    const uint4 zero = {0u, 0u, 0u, 0u};
    const int steps = (k + 31) / 32;
    const bool norm_rows = x != nullptr;
    const bool store_rows = a_out != nullptr && blockIdx.x == 0;
    if (warp < k_groups) {
        for (int s = warp; s < steps; s += k_groups) {
            const int kk = s * 32 + t * 8;
            const bool in_k = kk < k;
            uint4 b[4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) b[nt] = (in_k && wrow[nt] >= 0) ? tlt_ld16(w + (size_t)wrow[nt] * k + kk) : zero;
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                if (mi >= mt) continue;
                const int r_lo = mi * 16 + g, r_hi = r_lo + 8;
                const uint4 lo = (in_k && r_lo < rows)
                    ? skinny_row8(a, x, norm, norm_rows ? inv_s[r_lo] : 0.f, row0 + r_lo, kk, k) : zero;
                const uint4 hi = (in_k && r_hi < rows)
                    ? skinny_row8(a, x, norm, norm_rows ? inv_s[r_hi] : 0.f, row0 + r_hi, kk, k) : zero;
                if (store_rows && in_k) {
                    if (r_lo < rows) tlt_st16(a_out + (size_t)(row0 + r_lo) * k + kk, lo);
                    if (r_hi < rows) tlt_st16(a_out + (size_t)(row0 + r_hi) * k + kk, hi);
                }
                const unsigned fa[4] = {lo.x, hi.x, lo.y, hi.y};
                const unsigned fb[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    tlt_mma_bf16(acc[mi][nt], fa, b[nt].x, b[nt].y);
                    tlt_mma_bf16(acc[mi][nt], fb, b[nt].z, b[nt].w);
                }
            }
        }
    }

    // The warps' sums in warp order.
    for (int wg = 0; wg < k_groups; wg++) {
        if (warp == wg) {
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = mi * 16 + g + (e >= 2 ? 8 : 0), c = nt * 8 + 2 * t + (e & 1);
                        if (mi < mt && r < rows) acc_s[r][c] = wg == 0 ? acc[mi][nt][e] : acc_s[r][c] + acc[mi][nt][e];
                    }
        }
        __syncthreads();
    }

    // The epilogue.
    const int cols = mode == 2 ? SKINNY_NT / 2 : SKINNY_NT;
    for (int i = threadIdx.x; i < rows * cols; i += SKINNY_THREADS) {
        const int r = i / cols, j = i - r * cols;
        const size_t gr = (size_t)(row0 + r);
        if (mode == 2) {
            const int c = blockIdx.x * (SKINNY_NT / 2) + j;
            if (c >= half_n) continue;
            const float gv = tlt_bf2f(tlt_f2bf(acc_s[r][j])), uv = tlt_bf2f(tlt_f2bf(acc_s[r][16 + j]));
            static_cast<bf16_t*>(y)[gr * half_n + c] = tlt_f2bf(gv / (1.f + expf(-gv)) * uv);
            continue;
        }
        const int c = blockIdx.x * SKINNY_NT + j;
        if (c >= n) continue;
        const float v = acc_s[r][j];
        if (mode == 0) {
            bf16_t o = tlt_f2bf(v);
            if (bias != nullptr) o = tlt_f2bf(tlt_bf2f(o) + tlt_bf2f(bias[c]));
            static_cast<bf16_t*>(y)[gr * n + c] = o;
        } else if (mode == 1) {
            static_cast<float*>(y)[gr * n + c] += tlt_bf2f(tlt_f2bf(v));
        } else {
            static_cast<float*>(y)[gr * n + c] = v;
        }
    }
}
