/* How the CPU kernels (qdot.c, cpu_layers.c) run on several threads: one OpenMP parallel region a
 * call, on torch's own OpenMP threads (the library links the runtime torch loaded), each thread
 * taking its share of every phase by index, with our spinning barrier between phases.
 *
 * Why not OpenMP's barriers: a decoder pass has about ten phases a layer, and in a process where
 * the OpenMP runtime manages more threads than there are CPUs (the engine's worker thread and the
 * caller's each keep a pool), libgomp stops spinning at a barrier after ~100 iterations and sleeps
 * in the kernel, tens of microseconds a barrier: a third of a SmolLM2 decode step on a 2-core
 * machine. Why not threads of our own: between passes torch's OpenMP threads spin after its own
 * small ops, and two sets of spinning threads on two cores take the cores from each other.
 */
#include <sched.h>
#include <stdatomic.h>
#include <omp.h>
#ifdef __x86_64__
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define POOL_MAX_THREADS 256
#define POOL_SPINS_BEFORE_YIELD 4096  /* a busy host: let a descheduled peer run */

typedef struct {         /* one call's threads */
    int threads;
    atomic_int arrived;  /* the barrier's count */
    atomic_int sense;    /* the barrier's phase */
} pool_t;

typedef void (*pool_task)(void *arg, pool_t *pool, int thread);

/* Every thread of the call waits here until all have arrived (a sense-reversing barrier). */
static void pool_barrier(pool_t *pool) {
    if (pool->threads == 1) return;
    const int sense = atomic_load_explicit(&pool->sense, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&pool->arrived, 1, memory_order_acq_rel) == pool->threads - 1) {
        atomic_store_explicit(&pool->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&pool->sense, !sense, memory_order_release);
        return;
    }
    for (int spins = 1; atomic_load_explicit(&pool->sense, memory_order_acquire) == sense; spins++) {
        CPU_RELAX();
        if (spins % POOL_SPINS_BEFORE_YIELD == 0) sched_yield();
    }
}

/* Runs task(arg, pool, i) on threads i = 0 .. pool->threads - 1 (`threads`, or fewer if the
 * runtime gives fewer) and returns when all have finished. */
static void pool_run(pool_task task, void *arg, int threads) {
    pool_t pool = {.threads = 1};
    threads = threads < 1 ? 1 : (threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads);
    if (threads == 1) {
        task(arg, &pool, 0);
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        pool.threads = omp_get_num_threads();  /* its implicit barrier: every thread sees the count */
        task(arg, &pool, omp_get_thread_num());
    }
}

/* The share [*lo, *hi) of `total` items that thread `thread` of `threads` takes (contiguous). */
static inline void pool_share(int total, int thread, int threads, int *lo, int *hi) {
    *lo = (int)((long)total * thread / threads);
    *hi = (int)((long)total * (thread + 1) / threads);
}
