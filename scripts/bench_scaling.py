#!/usr/bin/env python3
"""Thread scaling: latency at 1 thread and at all cores, per model and backend.

Runs scripts/bench_models.py twice (--threads 1, then --threads <cores>; each run
times its variants interleaved in one process) and prints, per model, each
variant's latency at both thread counts and its speedup from 1 to all threads,
next to eager's and OpenVINO's.

    python scripts/bench_scaling.py [--suite torchvision] [--models all] [--batch 8]
                                    [--backends eager,cplcpp,ov] [--quick]
    python scripts/bench_scaling.py --from-csv one_thread.csv,all_threads.csv
"""
from __future__ import annotations

import argparse
import math
import os

from _bench_models_csv import read_latencies, run_bench_models



def measure(args, threads):
    return run_bench_models(["--suite", args.suite, "--models", args.models, "--batch", str(args.batch),
                             "--threads", str(threads), "--dtypes", args.dtype, "--shapes", "static",
                             "--backends", args.backends] + (["--quick"] if args.quick else []))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="torchvision")
    ap.add_argument("--models", default="all")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backends", default="eager,cplcpp,ov")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else os.cpu_count())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--from-csv", help="two bench_models.py CSVs: 1 thread, all threads")
    args = ap.parse_args(argv)
    if args.from_csv:
        one, many = (read_latencies(p) for p in args.from_csv.split(","))
    else:
        one, many = measure(args, 1), measure(args, args.threads)
    variants = [v for v in args.backends.split(",") if any(k[1] == v for k in one)]
    print(f"batch {args.batch}: ms per forward at 1 and {args.threads} threads, and the speedup "
          f"(1 thread / {args.threads} threads)")
    print(f"{'model':20s} " + " ".join(f"{v + ' 1t':>10s} {v + ' Nt':>10s} {'x':>5s}" for v in variants))
    logs = {v: [] for v in variants}
    for model in dict.fromkeys(m for m, _ in one):
        cells = []
        for v in variants:
            a, b = one.get((model, v)), many.get((model, v))
            if a and b:
                cells.append(f"{a:10.2f} {b:10.2f} {a / b:5.2f}")
                logs[v].append(math.log(a / b))
            else:
                cells.append(f"{'-':>10s} {'-':>10s} {'-':>5s}")
        print(f"{model:20s} " + " ".join(cells))
    print(f"{'geomean speedup':20s} " + " ".join(
        f"{'':10s} {'':10s} {math.exp(sum(x) / len(x)):5.2f}" if x else f"{'':27s}" for x in logs.values()))


if __name__ == "__main__":
    main()
