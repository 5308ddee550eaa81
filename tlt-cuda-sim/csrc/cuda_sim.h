// CUDA's device-side built-ins for our kernels compiled as host C++ (tlt-cuda-sim): the thread and block indices,
// __shared__ memory, __syncthreads, warp shuffles and votes, atomics and the math intrinsics our sources use.
//
// Execution model (runtime.cc): a launch runs up to 4 blocks at once, interleaved, each on its own OS thread of a
// persistent pool, with a baton so that exactly one OS thread runs at any time. Blocks start in a seeded random
// order, and whenever the running block reaches a scheduling point (each of its ready threads has run to its next
// synchronisation point, or the block has finished) the baton passes to a seeded-random block in flight; the same
// seed gives the same execution. So a kernel whose blocks communicate without synchronisation (none exists within a
// launch) gives other results under other seeds. The `sequential` schedule runs blocks one after another in grid
// order on the launching thread. A block's threads are fibers (their own stacks), run one at a time until each
// reaches a synchronisation point (a barrier, a warp exchange) or returns. __syncthreads releases when every live
// thread of the block has arrived; a warp exchange when every live lane of the warp has arrived. Between
// synchronisation points a thread runs alone, so a kernel whose threads communicate through memory without a
// barrier reads stale values here, as it may on a GPU. Misuse that is undefined on a GPU (a barrier or an exchange
// some threads never reach, a shuffle from an exited lane, a misaligned 16-byte access) is reported as an error of
// the launch; the first error ends the whole launch.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

#define TLT_SIM 1

namespace tlt_sim {

// The indices of the running CUDA thread.
struct ThreadCtx {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

// The running CUDA thread (set by the scheduler before switching to a fiber).
extern thread_local ThreadCtx* current;

// __syncthreads(): waits for every live thread of the block.
void sync_block();
// A warp exchange: lane `lane` offers `value` and receives the value offered by lane `src` (of its warp) in the
// same exchange; every live lane of the warp must take part. `mask` is the participation mask the kernel passed.
uint64_t warp_exchange(unsigned mask, uint64_t value, int src_lane);
// A warp vote: every live lane offers `pred`; returns the ballot of the warp (bit l: lane l's predicate).
unsigned warp_ballot(unsigned mask, bool pred);
// __syncwarp(): waits for every live lane of the warp.
void sync_warp(unsigned mask);
// A 16-byte vector access at `p`: an error of the launch unless `p` is 16-byte aligned (as on a GPU).
void check_align16(const void* p);

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}

template <class T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

inline int lane_id() { return (int)(current->thread_idx.x + current->block_dim.x * (current->thread_idx.y + current->block_dim.y * current->thread_idx.z)) & 31; }

}  // namespace tlt_sim

#define threadIdx (::tlt_sim::current->thread_idx)
#define blockIdx (::tlt_sim::current->block_idx)
#define blockDim (::tlt_sim::current->block_dim)
#define gridDim (::tlt_sim::current->grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
// A block runs on one OS thread, and an OS thread runs one block at a time, so a function-local thread_local is
// exactly one block's shared memory (not cleared between blocks, like shared memory).
#define __shared__ static thread_local

inline void __syncthreads() { ::tlt_sim::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::tlt_sim::sync_warp(mask); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = ::tlt_sim::lane_id();
    const int base = lane & ~(width - 1);
    return ::tlt_sim::from_bits<T>(::tlt_sim::warp_exchange(mask, ::tlt_sim::to_bits(v), base + (src & (width - 1))));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = ::tlt_sim::lane_id();
    const int base = lane & ~(width - 1);
    const int src = base + ((lane ^ lane_mask) & (width - 1));
    return ::tlt_sim::from_bits<T>(::tlt_sim::warp_exchange(mask, ::tlt_sim::to_bits(v), src));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = ::tlt_sim::lane_id();
    const int sub = lane & (width - 1);
    const int src = sub + (int)delta < width ? lane + (int)delta : lane;
    return ::tlt_sim::from_bits<T>(::tlt_sim::warp_exchange(mask, ::tlt_sim::to_bits(v), src));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = ::tlt_sim::lane_id();
    const int sub = lane & (width - 1);
    const int src = sub >= (int)delta ? lane - (int)delta : lane;
    return ::tlt_sim::from_bits<T>(::tlt_sim::warp_exchange(mask, ::tlt_sim::to_bits(v), src));
}
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the warp (every lane must take part, as on a GPU):
// d += A (16x16 bf16, row-major) * B (16x8 bf16, column-major), with A, B, C and D spread over the lanes in the
// fragment layout of the PTX ISA (groupID = lane / 4, threadID_in_group = lane % 4): a[0] holds A[g][2t, 2t+1],
// a[1] A[g+8][2t, 2t+1], a[2] A[g][2t+8, 2t+9], a[3] A[g+8][2t+8, 2t+9] (lower element in the low 16 bits);
// b0 B[2t, 2t+1][g], b1 B[2t+8, 2t+9][g]; d[0..1] D[g][2t, 2t+1], d[2..3] D[g+8][2t, 2t+1]. Products of bf16 are
// exact in f32; they are summed in k order onto d. The lanes' operands meet in a per-warp scratch, double-buffered
// so one warp sync per product suffices (a lane can refill a buffer only after every lane has passed the next sync).
namespace tlt_sim {
inline void mma_m16n8k16_bf16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    static thread_local unsigned scratch[32][2][32][6];
    static thread_local unsigned phase[32][32];
    const unsigned tid = current->thread_idx.x + current->block_dim.x *
                                                     (current->thread_idx.y + current->block_dim.y * current->thread_idx.z);
    const unsigned warp = (tid >> 5) & 31, lane = tid & 31;
    const unsigned ph = phase[warp][lane] & 1u;
    phase[warp][lane]++;
    unsigned* mine = scratch[warp][ph][lane];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    sync_warp(0xffffffffu);
    auto half = [](unsigned reg, int hi) { return from_bits<float>((uint64_t)((hi ? reg >> 16 : reg & 0xffffu) << 16)); };
    const int g = (int)lane >> 2, t = (int)lane & 3;
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; k++) {
            const unsigned* al = scratch[warp][ph][(row & 7) * 4 + (k & 7) / 2];
            const float av = half(al[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k & 1);
            const unsigned* bl = scratch[warp][ph][col * 4 + (k & 7) / 2];
            const float bv = half(bl[4 + (k >= 8 ? 1 : 0)], k & 1);
            acc += av * bv;
        }
        d[i] = acc;
    }
}
}  // namespace tlt_sim

inline unsigned __ballot_sync(unsigned mask, int pred) { return ::tlt_sim::warp_ballot(mask, pred != 0); }
inline int __any_sync(unsigned mask, int pred) { return ::tlt_sim::warp_ballot(mask, pred != 0) != 0; }
inline int __all_sync(unsigned mask, int pred) {
    return ::tlt_sim::warp_ballot(mask, pred != 0) == ::tlt_sim::warp_ballot(mask, true);
}

// Atomics: threads never run at the same time here (one fiber of one block at a time, whichever OS thread it is
// on), so a read-modify-write is atomic by construction.
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    T old = *p;
    *p = v;
    return old;
}
inline void __threadfence() {}
// A load that bypasses L1 on a GPU (another block's writes after its __threadfence); plain here.
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
inline void __threadfence_block() {}

// Bit casts and math intrinsics.
inline float __int_as_float(int x) { return ::tlt_sim::from_bits<float>((uint32_t)x); }
inline int __float_as_int(float x) { return (int)(uint32_t)::tlt_sim::to_bits(x); }
inline float __uint_as_float(unsigned x) { return ::tlt_sim::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return (unsigned)::tlt_sim::to_bits(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline double __longlong_as_double(long long x) { return ::tlt_sim::from_bits<double>((uint64_t)x); }
inline long long __double_as_longlong(double x) { return (long long)::tlt_sim::to_bits(x); }
// The f64 intrinsics a GPU never contracts into a fused multiply-add (build.rs compiles with -ffp-contract=off).
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
