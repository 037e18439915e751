// Pins OpenMP's worker threads, one per CPU, leaving the calling thread free.
//
// On a core another process also uses, unpinned workers get moved around
// and stacked on one core, and every barrier then waits for the one that
// lost its slice: with one nice-10 process spinning on one of 2 cores,
// mobilenet_v3 at batch 8 on 2 threads took 53.9 ms unpinned, 29.6 ms
// pinned (26.7 ms idle either way; EPYC Zen 4, interleaved in one process).
// libgomp's own OMP_PROC_BIND pins the calling thread as well, and every
// thread pool that thread starts later inherits its single CPU (OpenVINO's
// then ran on one core), so this pins the workers only.
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <vector>

extern "C" {
#include "cl_api.h"
}

extern "C" int cl_pin_omp_workers(int threads, int pin) {
    if (threads <= 1) return 0;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
    // Pinned, workers take the allowed CPUs other than the one the caller runs on, in
    // order; unpinned, each gets the caller's whole set back.
    std::vector<int> cpus;
    if (pin) {
        const int here = sched_getcpu();
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &allowed) && c != here) cpus.push_back(c);
        if (static_cast<int>(cpus.size()) < threads - 1) return 0;  // more threads than CPUs: the OS places them
    }
    std::atomic<int> done{0};
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        if (t > 0) {
            cpu_set_t set = allowed;
            if (pin) {
                CPU_ZERO(&set);
                CPU_SET(cpus[t - 1], &set);
            }
            if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) done++;
        }
    }
    return done.load();
}
