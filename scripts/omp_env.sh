# OpenMP wait policy for every entry point (sourced by env.sh and single_run.sh).
# libgomp's idle threads spin 300k iterations at each barrier by default; on a
# core another process uses, that spinning steals the time slice the awaited
# thread needs (mobilenet_v3_large, batch 8, 2 threads, one core busy: 6.5x
# slower). A spin of 10k keeps workers awake across the short gaps between
# parallel regions (waking a sleeping one cost ~90 us on a KVM Xeon) and, with
# the workers pinned, loses less than OpenVINO does under load; 30k collapsed
# once (scripts/bench_load.py, cpu_layout/threads.py, docs/DESIGN.md).
# Set OMP_WAIT_POLICY or GOMP_SPINCOUNT yourself to override.
if [ -z "${OMP_WAIT_POLICY:-}" ] && [ -z "${GOMP_SPINCOUNT:-}" ]; then
    export GOMP_SPINCOUNT=10000
fi
