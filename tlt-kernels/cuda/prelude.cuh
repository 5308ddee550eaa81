// Shared by every kernel file of tlt-kernels (prepended by `tlt_kernels::cuda::KernelSource::full_source`).
// NVRTC bundles no standard headers: no includes here, bf16 is handled as its bit pattern.

typedef unsigned short bf16_t;
typedef unsigned long long u64_t;

#define TLT_NEG_INF (__int_as_float(0xff800000))
#define TLT_POS_INF (__int_as_float(0x7f800000))
#define TLT_NAN (__int_as_float(0x7fffffff))

// bf16 bits -> f32 (exact).
__device__ __forceinline__ float tlt_bf2f(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }

// f32 -> bf16 bits, rounded to nearest even (NaN stays NaN).
__device__ __forceinline__ bf16_t tlt_f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// 16-byte vector access (8 bf16) at a 16-byte aligned address. The simulated device (TLT_SIM) checks the
// alignment, which a GPU requires and a CPU does not.
#ifdef TLT_SIM
#define TLT_ALIGN16(p) ::tlt_sim::check_align16(p)
#else
#define TLT_ALIGN16(p)
#endif
__device__ __forceinline__ uint4 tlt_ld16(const bf16_t* p) {
    TLT_ALIGN16(p);
    return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void tlt_st16(bf16_t* p, uint4 v) {
    TLT_ALIGN16(p);
    *reinterpret_cast<uint4*>(p) = v;
}

// Two bf16 (as bits) in one 32-bit register, `lo` in the low half (the order of mma fragments).
__device__ __forceinline__ unsigned tlt_pack_bf16x2(bf16_t lo, bf16_t hi) { return (unsigned)lo | ((unsigned)hi << 16); }

// d += A * B on the tensor cores for the whole warp (mma.sync m16n8k16, bf16 inputs, f32 accumulation; sm_80+):
// A 16x16 row-major in a[4], B 16x8 column-major in (b0, b1), C = D 16x8 in d[4], in the PTX ISA's fragment layout
// (g = lane / 4, t = lane % 4): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]. Every lane
// must take part. The simulated device computes the same product from the same layout.
__device__ __forceinline__ void tlt_mma_bf16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
#ifdef TLT_SIM
    ::tlt_sim::mma_m16n8k16_bf16(d, a, b0, b1);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ float tlt_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float tlt_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A block-wide reduction by `op` for blocks of whole warps, in a fixed order (each warp's xor butterfly, then the
// warps' results in warp order), the result returned to every thread. part: shared scratch, one entry per warp (the
// leading barrier lets a caller reuse it at once).
template <class T, class Op>
__device__ __forceinline__ T tlt_block_reduce(T v, T* part, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    T t = part[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) t = op(t, part[w]);
    return t;
}

// The block's sum (tlt_block_reduce).
__device__ __forceinline__ float tlt_block_sum(float v, float* part) {
    return tlt_block_reduce(v, part, [](float a, float b) { return a + b; });
}

// tlt_block_sum in f64.
__device__ __forceinline__ double tlt_block_sum_d(double v, double* part) {
    return tlt_block_reduce(v, part, [](double a, double b) { return a + b; });
}

// The largest v of the block (tlt_block_reduce).
__device__ __forceinline__ float tlt_block_max(float v, float* part) {
    return tlt_block_reduce(v, part, [](float a, float b) { return fmaxf(a, b); });
}

// The larger of two (value, index) pairs; ties go to the smaller index (as tlt_kernels::argmax on the CPU).
__device__ __forceinline__ void tlt_argmax_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ __forceinline__ void tlt_warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        tlt_argmax_merge(v, i, v2, i2);
    }
}

// Block-wide argmax of every thread's (v, i) for blocks of whole warps (ties to the smaller index): the result is
// left in thread 0's v and i. w_val, w_idx: shared scratch, one entry per warp; the caller syncs before reusing it.
__device__ __forceinline__ void tlt_block_argmax(float& v, int& i, float* w_val, int* w_idx) {
    tlt_warp_argmax(v, i);
    if ((threadIdx.x & 31) == 0) { w_val[threadIdx.x >> 5] = v; w_idx[threadIdx.x >> 5] = i; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) tlt_argmax_merge(v, i, w_val[w], w_idx[w]);
}
