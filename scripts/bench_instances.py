#!/usr/bin/env python3
"""Multi-instance throughput through PyTorch's own launcher.

For each instance count N, runs

    python -m torch.backends.xeon.run_cpu --ninstances N --ncores-per-instance C/N -- \\
        scripts/bench_instances.py --worker ...

(C: the cores of this process's affinity set). run_cpu pins each instance to its
cores (numactl, else taskset), sets OMP_NUM_THREADS, and preloads tcmalloc/jemalloc
and Intel OpenMP when it finds them. Every instance compiles the model (they share
cpu_layout's on-disk cache, CPU_LAYOUT_CACHE_DIR, so the C++ is built once: the
build takes a file lock and the others load its result), warms up, waits for the
other instances at a file barrier, then runs forwards for --seconds. Images/s of
all instances are summed.

    python scripts/bench_instances.py [--suite torchvision] [--models resnet50,mobilenet_v3_large]
                                      [--batch 8] [--instances 1,2] [--backends eager,cplcpp,ov]
                                      [--seconds 5]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def worker(args) -> None:
    import torch

    from cpu_layout import zoo

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, x = zoo.model_and_input(args.suite, args.model, args.batch, args.size)
    if args.backend == "cplcpp":
        fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": True})
    elif args.backend == "cpl":
        fn = torch.compile(model, backend="cpu_layout")
    elif args.backend == "ov":  # OpenVINO's CPU plugin on this instance's threads (benchmark.OpenVINOCompiled)
        from cpu_layout import benchmark

        fn = benchmark._openvino(model, "float32", False)
        x = fn.prepare_input(x)
    else:
        fn = model
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
        first = time.perf_counter() - t0
        for _ in range(3):
            fn(x)
        # Barrier: every instance measures over the same wall-clock window.
        open(os.path.join(args.barrier, f"ready-{os.getpid()}"), "w").close()
        deadline = time.time() + 600
        while len(glob.glob(os.path.join(args.barrier, "ready-*"))) < args.count and time.time() < deadline:
            time.sleep(0.01)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            fn(x)
            n += 1
        dt = time.perf_counter() - t0
    with open(os.path.join(args.barrier, f"result-{os.getpid()}.json"), "w") as f:
        json.dump({"images_per_s": n * args.batch / dt, "ms": dt / n * 1e3, "first_call_s": first,
                   "threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}, f)


def launch(args, backend, model, n, cores):
    barrier = tempfile.mkdtemp(prefix="bench_instances_")
    cmd = [sys.executable, "-m", "torch.backends.xeon.run_cpu", "--ninstances", str(n),
           "--ncores-per-instance", str(cores // n), "--", os.path.abspath(__file__), "--worker",
           "--suite", args.suite, "--model", model, "--batch", str(args.batch), "--size", str(args.size),
           "--backend", backend, "--seconds", str(args.seconds), "--barrier", barrier, "--count", str(n)]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    results = []
    for p in glob.glob(os.path.join(barrier, "result-*.json")):
        with open(p) as f:
            results.append(json.load(f))
    for p in glob.glob(os.path.join(barrier, "*")):
        os.unlink(p)
    os.rmdir(barrier)
    if r.returncode != 0 or len(results) != n:
        tail = r.stderr.strip().splitlines()[-1:] if r.stderr else ["?"]
        raise RuntimeError(f"{backend} {model} x{n}: {len(results)} of {n} instances reported; {tail[0]}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--suite", default="torchvision")
    ap.add_argument("--models", default="resnet50,mobilenet_v3_large")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--instances", default=None, help="comma-separated instance counts [1,2,4,... up to the cores]")
    ap.add_argument("--backends", default="eager,cplcpp,ov", help="eager, cpl, cplcpp, ov (OpenVINO)")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    cores = len(os.sched_getaffinity(0))
    counts = ([int(c) for c in args.instances.split(",")] if args.instances
              else [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= cores])
    print(f"{args.suite} at batch {args.batch}, {args.size} px, fp32; {cores} cores split among N "
          f"instances by torch.backends.xeon.run_cpu; images/s summed over instances, {args.seconds:g} s "
          f"window after a barrier")
    print(f"{'model':20s} {'backend':8s} " + " ".join(f"{f'N={n} img/s':>12s} {'ms':>8s}" for n in counts))
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            cells = []
            for n in counts:
                try:
                    res = launch(args, backend, model, n, cores)
                    ips = sum(r["images_per_s"] for r in res)
                    ms = sum(r["ms"] for r in res) / len(res)
                    cells.append(f"{ips:12.1f} {ms:8.1f}")
                except RuntimeError as exc:
                    print(f"  {exc}", file=sys.stderr)
                    cells.append(f"{'failed':>12s} {'-':>8s}")
            print(f"{model:20s} {backend:8s} " + " ".join(cells), flush=True)
    print("ms: mean per-forward latency of an instance")


if __name__ == "__main__":
    main()
