// Detector controls: deliberately faulty kernels (named ctl_*) compiled into the simulated device next to our
// kernels, so that tests prove each of the simulation's detectors fires (tests/controls.rs). Never part of
// tlt-kernels; written in the same CUDA C as our sources, after the prelude.

// A barrier inside a branch only half of warp 0 takes: those lanes wait at __syncthreads while the others wait
// at a shuffle that needs them. Launch with one block of 32 threads; out: 32 floats.
extern "C" __global__ void ctl_deadlock(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16) __syncthreads();
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// A 16-byte vector load one bf16 past an aligned address (the prelude's tlt_ld16, which checks alignment under
// TLT_SIM). Launch with one block of n threads; buf: 8 * (n + 1) bf16, out: 8 * n bf16.
extern "C" __global__ void ctl_misaligned(const bf16_t* buf, bf16_t* out) {
    const uint4 v = tlt_ld16(buf + 1 + 8 * threadIdx.x);
    tlt_st16(out + 8 * threadIdx.x, v);
}

// An off-by-one bound: the thread of index n writes x[n], one element past a buffer of n floats.
extern "C" __global__ void ctl_overrun(float* x, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i <= n) x[i] = 1.0f;
}

// Lane 31 returns early; lane 30 then shuffles down from it. Launch with one block of 32 threads; out: 32 floats.
extern "C" __global__ void ctl_shuffle_exited(float* out) {
    if (threadIdx.x == 31) return;
    out[threadIdx.x] = __shfl_down_sync(0x7fffffffu, (float)threadIdx.x, 1);
}

// Block 0 publishes a value that block 1 reads, with nothing ordering the two blocks (no such synchronisation
// exists within a launch): right only when block 0 happens to run first. Launch with 2 blocks; flag, seen: 1 int.
extern "C" __global__ void ctl_block_race(int* flag, int* seen) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) flag[0] = 42;
    else seen[0] = flag[0];
}
