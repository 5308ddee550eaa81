// The simulated device: launches run block after block; a block's threads are ucontext fibers scheduled
// cooperatively (see cuda_sim.h for the model), and buffers are host memory with a guard page right after their
// last byte, so a kernel that reads or writes past a buffer's end faults instead of touching other data.

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_sim.h"

namespace tlt_sim {

thread_local ThreadCtx* current = nullptr;

namespace {

enum class State { Ready, WaitBlock, WaitWarp, Done };
enum class Sync { Shuffle, Ballot, Warp };

constexpr size_t kStack = 64 * 1024;

struct Fiber {
    ucontext_t ctx;
    ThreadCtx tc;
    State state = State::Ready;
    Sync sync = Sync::Warp;
    unsigned mask = 0;
    uint64_t offer = 0;
    int src = 0;
    uint64_t got = 0;
    int lane = 0, warp = 0;
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t sched;
    Fiber* running = nullptr;
    std::string error;
    void (*call)(void**) = nullptr;
    void** params = nullptr;
    bool drop_barriers = false;
    unsigned long long switches = 0;
};

thread_local Block* block = nullptr;
// Fiber stacks, reused across blocks and launches of this OS thread.
thread_local std::vector<std::vector<char>> stacks;

void fiber_entry(unsigned lo, unsigned hi) {
    Fiber* f = reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo);
    block->call(block->params);
    f->state = State::Done;
    swapcontext(&f->ctx, &block->sched);
}

// Leaves the running fiber in `s` and returns to the scheduler; returns when the scheduler resumes it.
void park(State s) {
    Fiber* f = block->running;
    f->state = s;
    swapcontext(&f->ctx, &block->sched);
}

const char* name(State s) {
    switch (s) {
        case State::Ready: return "ready";
        case State::WaitBlock: return "at __syncthreads";
        case State::WaitWarp: return "at a warp exchange";
        case State::Done: return "returned";
    }
    return "?";
}

std::string where(const Fiber& f) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", f.tc.block_idx.x, f.tc.block_idx.y,
                  f.tc.block_idx.z, f.tc.thread_idx.x, f.tc.thread_idx.y, f.tc.thread_idx.z);
    return buf;
}

// Releases warp `w` when every live lane waits at a warp exchange; false when it cannot. Sets the block's error for
// undefined behaviour (lanes at different kinds of exchange, a shuffle from a lane that is not live).
bool release_warp(int w, int first, int last) {
    std::vector<Fiber>& fs = block->fibers;
    int live = 0;
    for (int i = first; i < last; i++) {
        if (fs[i].state == State::Done) continue;
        if (fs[i].state != State::WaitWarp) return false;
        live++;
    }
    if (live == 0) return false;
    Sync kind = Sync::Warp;
    unsigned ballot = 0;
    bool have = false;
    for (int i = first; i < last; i++) {
        const Fiber& f = fs[i];
        if (f.state == State::Done) continue;
        if (have && f.sync != kind) {
            block->error = where(f) + ": lanes of warp " + std::to_string(w) + " wait at different warp exchanges";
            return false;
        }
        kind = f.sync;
        have = true;
        if (f.offer) ballot |= 1u << f.lane;
    }
    for (int i = first; i < last; i++) {
        Fiber& f = fs[i];
        if (f.state == State::Done) continue;
        if (kind == Sync::Shuffle) {
            const int s = first + f.src;
            const bool ok = s < last && fs[s].state != State::Done;
            if (!ok) {
                block->error = where(f) + ": shuffle from lane " + std::to_string(f.src) +
                               ", which has returned or does not exist (undefined on a GPU)";
                return false;
            }
            f.got = fs[s].offer;
        } else if (kind == Sync::Ballot) {
            f.got = ballot;
        }
        f.state = State::Ready;
    }
    return true;
}

void run_block(const uint3& bidx, const dim3& grid, const dim3& bdim, bool reverse) {
    const int n = (int)(bdim.x * bdim.y * bdim.z);
    std::vector<Fiber>& fs = block->fibers;
    fs.assign(n, Fiber{});
    if ((int)stacks.size() < n) stacks.resize(n);
    for (int i = 0; i < n; i++) {
        Fiber& f = fs[i];
        f.tc.thread_idx = uint3{(unsigned)i % bdim.x, ((unsigned)i / bdim.x) % bdim.y, (unsigned)i / (bdim.x * bdim.y)};
        f.tc.block_idx = bidx;
        f.tc.block_dim = bdim;
        f.tc.grid_dim = grid;
        f.lane = i & 31;
        f.warp = i >> 5;
        if (stacks[i].size() < kStack) stacks[i].resize(kStack);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks[i].data();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
        makecontext(&f.ctx, reinterpret_cast<void (*)()>(fiber_entry), 2, (unsigned)(p & 0xffffffffu),
                    (unsigned)(p >> 32));
    }
    const int warps = (n + 31) / 32;
    for (;;) {
        for (int k = 0; k < n; k++) {
            Fiber& f = fs[reverse ? n - 1 - k : k];
            if (f.state != State::Ready) continue;
            current = &f.tc;
            block->running = &f;
            block->switches++;
            swapcontext(&block->sched, &f.ctx);
            if (!block->error.empty()) return;
        }
        bool done = true;
        for (const Fiber& f : fs) done = done && f.state == State::Done;
        if (done) return;
        bool released = false;
        for (int w = 0; w < warps; w++) {
            released = release_warp(w, w * 32, w * 32 + 32 < n ? w * 32 + 32 : n) || released;
            if (!block->error.empty()) return;
        }
        if (released) continue;
        bool all_block = true;
        for (const Fiber& f : fs) all_block = all_block && (f.state == State::Done || f.state == State::WaitBlock);
        if (all_block) {
            for (Fiber& f : fs)
                if (f.state == State::WaitBlock) f.state = State::Ready;
            continue;
        }
        // Nobody can go on: some threads wait where others never arrive.
        std::string msg = "deadlock (a barrier or warp exchange that not every live thread reaches):";
        int shown = 0;
        for (const Fiber& f : fs) {
            if (f.state == State::Done || shown >= 4) continue;
            msg += " " + where(f) + " " + name(f.state) + ";";
            shown++;
        }
        block->error = msg;
        return;
    }
}

}  // namespace

void sync_block() {
    if (block->drop_barriers) return;
    park(State::WaitBlock);
}

uint64_t warp_exchange(unsigned mask, uint64_t value, int src_lane) {
    Fiber* f = block->running;
    f->sync = Sync::Shuffle;
    f->mask = mask;
    f->offer = value;
    f->src = src_lane & 31;
    park(State::WaitWarp);
    return f->got;
}

unsigned warp_ballot(unsigned mask, bool pred) {
    Fiber* f = block->running;
    f->sync = Sync::Ballot;
    f->mask = mask;
    f->offer = pred ? 1 : 0;
    park(State::WaitWarp);
    return (unsigned)f->got;
}

void check_align16(const void* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0 || !block->error.empty()) return;
    char buf[96];
    std::snprintf(buf, sizeof buf, ": a 16-byte access at %p, which is not 16-byte aligned", p);
    block->error = where(*block->running) + buf;
    // The launch ends here: this thread is never resumed, so the access itself never happens.
    park(State::Done);
}

void sync_warp(unsigned mask) {
    Fiber* f = block->running;
    f->sync = Sync::Warp;
    f->mask = mask;
    park(State::WaitWarp);
}

}  // namespace tlt_sim

extern "C" {

// Runs `call(params)` as a kernel over `grid` blocks of `block_dim` threads. `reverse`: run each block's ready
// threads in decreasing index order (a second interleaving); `drop_barriers`: make __syncthreads a no-op (a
// deliberately broken execution, for negative controls). Returns 0, or 1 with a message in `err`.
int tlt_sim_run(void (*call)(void**), void** params, const unsigned grid[3], const unsigned block_dim[3],
                int reverse, int drop_barriers, unsigned long long* switches, char* err, size_t err_len) {
    using namespace tlt_sim;
    const dim3 g{grid[0], grid[1], grid[2]};
    const dim3 b{block_dim[0], block_dim[1], block_dim[2]};
    if (b.x * b.y * b.z == 0 || b.x * b.y * b.z > 1024 || g.x * g.y * g.z == 0) {
        std::snprintf(err, err_len, "invalid launch: grid (%u,%u,%u), block (%u,%u,%u)", g.x, g.y, g.z, b.x, b.y, b.z);
        return 1;
    }
    Block blk;
    blk.call = call;
    blk.params = params;
    blk.drop_barriers = drop_barriers != 0;
    Block* saved = block;
    block = &blk;
    int rc = 0;
    for (unsigned z = 0; z < g.z && rc == 0; z++)
        for (unsigned y = 0; y < g.y && rc == 0; y++)
            for (unsigned x = 0; x < g.x && rc == 0; x++) {
                run_block(uint3{x, y, z}, g, b, reverse != 0);
                if (!blk.error.empty()) {
                    std::snprintf(err, err_len, "%s", blk.error.c_str());
                    rc = 1;
                }
            }
    *switches += blk.switches;
    block = saved;
    current = nullptr;
    return rc;
}

// `bytes` of zeroed memory aligned to `align` whose last byte is followed by an inaccessible page.
void* tlt_sim_alloc(size_t bytes, size_t align) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t rounded = (bytes + align - 1) / align * align;
    const size_t data_pages = (rounded + page - 1) / page;
    const size_t total = (data_pages + 1) * page;
    void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    char* guard = static_cast<char*>(base) + data_pages * page;
    if (mprotect(guard, page, PROT_NONE) != 0) {
        munmap(base, total);
        return nullptr;
    }
    return guard - rounded;
}

void tlt_sim_free(void* p, size_t bytes, size_t align) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t rounded = (bytes + align - 1) / align * align;
    const size_t data_pages = (rounded + page - 1) / page;
    char* guard = static_cast<char*>(p) + rounded;
    munmap(guard - data_pages * page, (data_pages + 1) * page);
}

}  // extern "C"
