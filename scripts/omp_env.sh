# OpenMP wait policy for every entry point (sourced by env.sh and single_run.sh).
# libgomp's idle threads spin 300k iterations at each barrier by default; on a
# core another process uses, that spinning steals the time slice the awaited
# thread needs (mobilenet_v3_large, batch 8, 2 threads, one core busy: 6.5x
# slower). A short spin keeps nearly all of the idle-machine speed and loses no
# more than OpenVINO does under load (scripts/bench_load.py, docs/DESIGN.md).
# Set OMP_WAIT_POLICY or GOMP_SPINCOUNT yourself to override.
if [ -z "${OMP_WAIT_POLICY:-}" ] && [ -z "${GOMP_SPINCOUNT:-}" ]; then
    export GOMP_SPINCOUNT=1000
fi
