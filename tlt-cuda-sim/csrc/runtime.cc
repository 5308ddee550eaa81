// The simulated device. A launch runs up to kWorkers blocks at once, interleaved: each block on its own OS thread
// of a persistent pool (so its __shared__ statics and fiber stacks are that thread's), with a baton so that
// exactly one thread runs at any time. A block's threads are fibers scheduled cooperatively (see
// cuda_sim.h for the model). Buffers are host memory with a guard page right after their last byte, so a kernel
// that reads or writes past a buffer's end faults instead of touching other data.

#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cuda_sim.h"

namespace tlt_sim {

thread_local ThreadCtx* current = nullptr;

namespace {

enum class State { Ready, WaitBlock, WaitWarp, Done };
enum class Sync { Shuffle, Ballot, Warp };

constexpr size_t kStack = 64 * 1024;
constexpr int kMaxThreads = 1024;

// A fiber's saved execution context. On x86-64, a stack pointer: the switch (below) saves the callee-saved
// registers on the fiber's own stack, as a function call would. Elsewhere, a ucontext (whose switch also saves the
// signal mask, a system call each time).
#if defined(__x86_64__)
#define TLT_SIM_FAST_SWITCH 1
struct Context {
    void* sp = nullptr;
};
#else
#define TLT_SIM_FAST_SWITCH 0
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context ctx;
    ThreadCtx tc;
    State state = State::Ready;
    Sync sync = Sync::Warp;
    unsigned mask = 0;
    uint64_t offer = 0;
    int src = 0;
    uint64_t got = 0;
    int lane = 0, warp = 0;
};

// One block in flight on an OS thread.
struct Block {
    std::vector<Fiber> fibers;
    Context sched;
    Fiber* running = nullptr;
    std::string error;
    void (*call)(void**) = nullptr;
    void** params = nullptr;
    bool drop_barriers = false;
    bool reverse = false;
    unsigned long long switches = 0;
};

thread_local Block* block = nullptr;

// Fiber stacks of one OS thread, reused across blocks and launches: one reservation for the largest block, whose
// pages are committed only as fibers touch them.
struct Stacks {
    char* base = nullptr;
    ~Stacks() {
        if (base) munmap(base, kStack * kMaxThreads);
    }
    char* get(int i) {
        if (!base) {
            void* p = mmap(nullptr, kStack * kMaxThreads, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return nullptr;
            base = static_cast<char*>(p);
        }
        return base + kStack * (size_t)i;
    }
};
thread_local Stacks stacks;

#if TLT_SIM_FAST_SWITCH
}  // namespace
}  // namespace tlt_sim

// tlt_sim_switch(save, to): saves the callee-saved registers on the current stack and the stack pointer in *save,
// then resumes the context whose stack pointer is `to`. tlt_sim_fiber_start: where a new fiber's first switch
// returns to; calls r13(r12) with the stack 16-byte aligned and never returns.
extern "C" void tlt_sim_switch(void** save, void* to);
extern "C" void tlt_sim_fiber_start();
__asm__(
    ".pushsection .text\n"
    ".globl tlt_sim_switch\n"
    ".hidden tlt_sim_switch\n"
    ".type tlt_sim_switch,@function\n"
    "tlt_sim_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size tlt_sim_switch, .-tlt_sim_switch\n"
    ".globl tlt_sim_fiber_start\n"
    ".hidden tlt_sim_fiber_start\n"
    ".type tlt_sim_fiber_start,@function\n"
    "tlt_sim_fiber_start:\n"
    "    movq %r12, %rdi\n"
    "    callq *%r13\n"
    "    ud2\n"
    ".size tlt_sim_fiber_start, .-tlt_sim_fiber_start\n"
    ".popsection\n");

namespace tlt_sim {
namespace {
#endif

void fiber_main(Fiber* f);

// Switches from the context saved into `from` to `to`.
inline void switch_to(Context& from, Context& to) {
#if TLT_SIM_FAST_SWITCH
    tlt_sim_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

#if !TLT_SIM_FAST_SWITCH
void fiber_entry(unsigned lo, unsigned hi) { fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo)); }
#endif

// Makes `f.ctx` start fiber_main(&f) on `stack` at its first switch.
void make_context(Fiber& f, char* stack) {
#if TLT_SIM_FAST_SWITCH
    // The frame tlt_sim_switch pops: r15, r14, r13 (the function), r12 (its argument), rbx, rbp, the return address.
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStack) & ~(uintptr_t)15;
    void** sp = reinterpret_cast<void**>(top) - 7;
    sp[0] = sp[1] = sp[4] = sp[5] = nullptr;
    sp[2] = reinterpret_cast<void*>(&fiber_main);
    sp[3] = &f;
    sp[6] = reinterpret_cast<void*>(&tlt_sim_fiber_start);
    f.ctx.sp = sp;
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = stack;
    f.ctx.uc.uc_stack.ss_size = kStack;
    f.ctx.uc.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.ctx.uc, reinterpret_cast<void (*)()>(fiber_entry), 2, (unsigned)(p & 0xffffffffu),
                (unsigned)(p >> 32));
#endif
}

// A CUDA thread: the kernel, then back to the scheduler for good.
void fiber_main(Fiber* f) {
    block->call(block->params);
    f->state = State::Done;
    switch_to(f->ctx, block->sched);
}

// Leaves the running fiber in `s` and returns to the scheduler; returns when the scheduler resumes it.
void park(State s) {
    Fiber* f = block->running;
    f->state = s;
    switch_to(f->ctx, block->sched);
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

// Sets up block `bidx` of a launch in `*block` (on this OS thread's fiber stacks); false (with the block's error)
// when the stacks cannot be mapped.
bool start_block(const uint3& bidx, const dim3& grid, const dim3& bdim) {
    const int n = (int)(bdim.x * bdim.y * bdim.z);
    std::vector<Fiber>& fs = block->fibers;
    fs.assign(n, Fiber{});
    block->error.clear();
    block->running = nullptr;
    for (int i = 0; i < n; i++) {
        Fiber& f = fs[i];
        f.tc.thread_idx = uint3{(unsigned)i % bdim.x, ((unsigned)i / bdim.x) % bdim.y, (unsigned)i / (bdim.x * bdim.y)};
        f.tc.block_idx = bidx;
        f.tc.block_dim = bdim;
        f.tc.grid_dim = grid;
        f.lane = i & 31;
        f.warp = i >> 5;
        char* stack = stacks.get(i);
        if (!stack) {
            block->error = "the simulated device could not map fiber stacks";
            return false;
        }
        make_context(f, stack);
    }
    return true;
}

enum class Step { Running, Finished, Failed };

// Runs every ready fiber of `*block` to its next synchronisation point (or return), then releases what can be
// released: a scheduling point. Failed: the block's error says why (a detector fired).
Step step_block() {
    std::vector<Fiber>& fs = block->fibers;
    const int n = (int)fs.size();
    for (int k = 0; k < n; k++) {
        Fiber& f = fs[block->reverse ? n - 1 - k : k];
        if (f.state != State::Ready) continue;
        current = &f.tc;
        block->running = &f;
        block->switches++;
        switch_to(block->sched, f.ctx);
        if (!block->error.empty()) return Step::Failed;
    }
    bool done = true;
    for (const Fiber& f : fs) done = done && f.state == State::Done;
    if (done) return Step::Finished;
    bool released = false;
    const int warps = (n + 31) / 32;
    for (int w = 0; w < warps; w++) {
        released = release_warp(w, w * 32, w * 32 + 32 < n ? w * 32 + 32 : n) || released;
        if (!block->error.empty()) return Step::Failed;
    }
    if (released) return Step::Running;
    bool all_block = true;
    for (const Fiber& f : fs) all_block = all_block && (f.state == State::Done || f.state == State::WaitBlock);
    if (all_block) {
        for (Fiber& f : fs)
            if (f.state == State::WaitBlock) f.state = State::Ready;
        return Step::Running;
    }
    // Nobody can go on: some threads wait where others never arrive.
    int at_block = 0, at_warp = 0;
    const Fiber* first_block = nullptr;
    const Fiber* first_warp = nullptr;
    for (const Fiber& f : fs) {
        if (f.state == State::WaitBlock && at_block++ == 0) first_block = &f;
        if (f.state == State::WaitWarp && at_warp++ == 0) first_warp = &f;
    }
    std::string msg = "deadlock (a barrier or warp exchange that not every live thread reaches): " +
                      std::to_string(at_block) + " threads at __syncthreads, " + std::to_string(at_warp) +
                      " at a warp exchange;";
    for (const Fiber* f : {first_block, first_warp})
        if (f) msg += " " + where(*f) + " " + name(f->state) + ";";
    block->error = msg;
    return Step::Failed;
}

// Runs one block to its end on this OS thread; false with the block's error when a detector fired.
bool run_block(const uint3& bidx, const dim3& grid, const dim3& bdim) {
    if (!start_block(bidx, grid, bdim)) return false;
    for (;;) {
        const Step s = step_block();
        if (s == Step::Finished) return true;
        if (s == Step::Failed) return false;
    }
}

// ---- Interleaved launches: a pool of worker threads passing a baton. ----

constexpr int kWorkers = 4;
// The most blocks an interleaved launch may have (its permuted order is a table).
constexpr unsigned kMaxBlocks = 1u << 26;

// A binary semaphore for one waiter (a futex word): 0 empty, 1 posted, 2 the waiter sleeps.
struct Gate {
    std::atomic<int> s{0};
    void post() {
        if (s.exchange(1, std::memory_order_release) == 2)
            syscall(SYS_futex, reinterpret_cast<int*>(&s), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    }
    void wait() {
        for (;;) {
            int e = 0;
            if (s.compare_exchange_strong(e, 2, std::memory_order_acquire, std::memory_order_acquire) || e == 2) {
                syscall(SYS_futex, reinterpret_cast<int*>(&s), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
                continue;
            }
            // e == 1: posted.
            s.store(0, std::memory_order_relaxed);
            return;
        }
    }
};

// SplitMix64: the schedule's random source.
uint64_t next_random(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// One interleaved launch, shared by the pool's workers; only the baton's holder touches it.
struct Run {
    void (*call)(void**) = nullptr;
    void** params = nullptr;
    dim3 grid{}, bdim{};
    bool reverse = false, drop_barriers = false;
    std::vector<unsigned> order;  // the blocks' linear indices, permuted
    size_t next = 0;              // the next block of `order` to start
    int slot[kWorkers];           // the block (index into `order`) worker w runs; -1: none
    bool fresh[kWorkers];         // worker w's block is yet to be set up
    uint64_t rng = 0;
    std::string error;
    unsigned long long switches = 0;
    Gate done;

    // A seeded-random worker that holds a block; -1 when every block has finished.
    int pick() {
        int active[kWorkers];
        int count = 0;
        for (int w = 0; w < kWorkers; w++)
            if (slot[w] >= 0) active[count++] = w;
        return count == 0 ? -1 : active[next_random(rng) % (uint64_t)count];
    }
};

struct Pool {
    Gate go[kWorkers];
    Run* run = nullptr;
};

// A worker: waits for the baton, then steps its block until the baton passes to another worker or the launch ends.
void worker_main(Pool* pool, int w) {
    Block blk;
    block = &blk;
    for (;;) {
        pool->go[w].wait();
        Run* r = pool->run;
        for (;;) {
            Step s = Step::Running;
            if (r->fresh[w]) {
                r->fresh[w] = false;
                blk.call = r->call;
                blk.params = r->params;
                blk.drop_barriers = r->drop_barriers;
                blk.reverse = r->reverse;
                const unsigned i = r->order[(size_t)r->slot[w]];
                const uint3 bidx{i % r->grid.x, (i / r->grid.x) % r->grid.y, i / (r->grid.x * r->grid.y)};
                if (!start_block(bidx, r->grid, r->bdim)) s = Step::Failed;
            }
            if (s == Step::Running) s = step_block();
            r->switches += blk.switches;
            blk.switches = 0;
            if (s == Step::Failed) {
                // The first error ends the launch: the other workers' blocks are abandoned where they stand.
                r->error = blk.error;
                r->done.post();
                break;
            }
            if (s == Step::Finished) {
                if (r->next < r->order.size()) {
                    r->slot[w] = (int)r->next++;
                    r->fresh[w] = true;
                } else {
                    r->slot[w] = -1;
                }
            }
            const int n = r->pick();
            if (n < 0) {
                r->done.post();
                break;
            }
            if (n != w) {
                pool->go[n].post();
                break;
            }
        }
        current = nullptr;
    }
}

// Pools not in use. A launch takes one (or makes one: its threads live as long as the process), so launches from
// several caller threads run at once, each on its own pool.
std::mutex pools_mu;
std::vector<Pool*>* idle_pools = new std::vector<Pool*>;

// A child made by fork() has none of the pools' threads: it starts with no pools (and an unlocked mutex).
void forget_pools_in_child() {
    new (&pools_mu) std::mutex;
    idle_pools = new std::vector<Pool*>;
}
const int atfork_registered = pthread_atfork(nullptr, nullptr, forget_pools_in_child);

Pool* take_pool() {
    (void)atfork_registered;
    {
        std::lock_guard<std::mutex> lock(pools_mu);
        if (!idle_pools->empty()) {
            Pool* p = idle_pools->back();
            idle_pools->pop_back();
            return p;
        }
    }
    Pool* p = new Pool;
    for (int w = 0; w < kWorkers; w++) std::thread(worker_main, p, w).detach();
    return p;
}

void give_pool(Pool* p) {
    std::lock_guard<std::mutex> lock(pools_mu);
    idle_pools->push_back(p);
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
// deliberately broken execution, for negative controls). `interleave` 0: blocks one after another in grid order on
// the calling thread; otherwise up to 4 blocks at once, started in an order and switched at scheduling points as
// `seed` draws (the same seed, the same execution). Returns 0, or 1 with a message in `err`.
int tlt_sim_run(void (*call)(void**), void** params, const unsigned grid[3], const unsigned block_dim[3],
                int reverse, int drop_barriers, unsigned long long seed, int interleave,
                unsigned long long* switches, char* err, size_t err_len) {
    using namespace tlt_sim;
    const dim3 g{grid[0], grid[1], grid[2]};
    const dim3 b{block_dim[0], block_dim[1], block_dim[2]};
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    const unsigned long long blocks = (unsigned long long)g.x * g.y * g.z;
    if (threads == 0 || threads > kMaxThreads || blocks == 0) {
        std::snprintf(err, err_len, "invalid launch: grid (%u,%u,%u), block (%u,%u,%u)", g.x, g.y, g.z, b.x, b.y, b.z);
        return 1;
    }
    if (interleave == 0 || blocks == 1) {
        // One block after another on this thread (a single block's schedule is the same either way).
        Block blk;
        blk.call = call;
        blk.params = params;
        blk.drop_barriers = drop_barriers != 0;
        blk.reverse = reverse != 0;
        Block* saved = block;
        block = &blk;
        int rc = 0;
        for (unsigned z = 0; z < g.z && rc == 0; z++)
            for (unsigned y = 0; y < g.y && rc == 0; y++)
                for (unsigned x = 0; x < g.x && rc == 0; x++)
                    if (!run_block(uint3{x, y, z}, g, b)) {
                        std::snprintf(err, err_len, "%s", blk.error.c_str());
                        rc = 1;
                    }
        *switches += blk.switches;
        block = saved;
        current = nullptr;
        return rc;
    }
    if (blocks > kMaxBlocks) {
        std::snprintf(err, err_len, "grid (%u,%u,%u): more than %u blocks, beyond the simulation", g.x, g.y, g.z,
                      kMaxBlocks);
        return 1;
    }
    Run r;
    r.call = call;
    r.params = params;
    r.grid = g;
    r.bdim = b;
    r.reverse = reverse != 0;
    r.drop_barriers = drop_barriers != 0;
    r.rng = seed;
    r.order.resize(blocks);
    for (unsigned i = 0; i < (unsigned)blocks; i++) r.order[i] = i;
    for (size_t i = r.order.size() - 1; i > 0; i--) std::swap(r.order[i], r.order[next_random(r.rng) % (i + 1)]);
    for (int w = 0; w < kWorkers; w++) {
        const bool has = r.next < r.order.size();
        r.slot[w] = has ? (int)r.next++ : -1;
        r.fresh[w] = has;
    }
    Pool* pool = nullptr;
    try {
        pool = take_pool();
    } catch (...) {
        std::snprintf(err, err_len, "the simulated device could not start its worker threads");
        return 1;
    }
    pool->run = &r;
    pool->go[r.pick()].post();
    r.done.wait();
    pool->run = nullptr;
    give_pool(pool);
    *switches += r.switches;
    if (!r.error.empty()) {
        std::snprintf(err, err_len, "%s", r.error.c_str());
        return 1;
    }
    return 0;
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
