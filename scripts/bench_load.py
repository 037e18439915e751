#!/usr/bin/env python3
"""Latency on a busy machine: cpu_layout, eager and OpenVINO with and without a
bounded background load, under each OpenMP wait policy.

For each wait policy (libgomp reads OMP_WAIT_POLICY once at start-up, so each
runs scripts/bench_models.py in its own process) the models are timed twice:
on the idle machine, and while one background process spins on one core for
the whole run (niced by --nice, as a co-tenant's batch job would be). Prints median
latency per variant and the slowdown loaded / unloaded.

    python scripts/bench_load.py [--suite torchvision] [--models mobilenet_v3_large,resnet50]
                                 [--batch 8] [--threads N (all cores)]
                                 [--policies PASSIVE,default] [--backends eager,cplcpp,ov]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os

from _bench_models_csv import run_bench_models



def _spin(core, nice):
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    os.nice(nice)
    while True:
        pass


def run(args, policy, loaded):
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin="):  # libgomp's own knob: spin this many iterations, then sleep
        env["GOMP_SPINCOUNT"] = policy[5:]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    argv = ["--suite", args.suite, "--models", args.models, "--batch", str(args.batch),
            "--threads", str(args.threads), "--dtypes", "float32", "--shapes", "static",
            "--backends", args.backends] + (["--quick"] if args.quick else [])
    spinner = None
    if loaded:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        spinner = multiprocessing.Process(target=_spin, args=(cores[-1], args.nice), daemon=True)
        spinner.start()
    try:
        return run_bench_models(argv, env)
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.join()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="torchvision")
    ap.add_argument("--models", default="mobilenet_v3_large,resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else os.cpu_count())
    ap.add_argument("--policies", default="PASSIVE,default",
                    help="OMP_WAIT_POLICY values; 'default' leaves it unset (libgomp spins, then "
                         "sleeps); spin=N sets GOMP_SPINCOUNT=N instead")
    ap.add_argument("--backends", default="eager,cplcpp,ov")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the background process [10]")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    variants = args.backends.split(",")
    print(f"{args.suite} models at batch {args.batch}, {args.threads} threads, fp32; load: one process "
          f"(nice {args.nice}) spinning on one core of {os.cpu_count()}")
    print(f"{'policy':9s} {'model':20s} " + " ".join(f"{v + ' idle':>11s} {v + ' load':>11s} {'x':>5s}"
                                                   for v in variants))
    for policy in args.policies.split(","):
        idle, load = run(args, policy, False), run(args, policy, True)
        for model in dict.fromkeys(m for m, _ in idle):
            cells = []
            for v in variants:
                a, b = idle.get((model, v)), load.get((model, v))
                cells.append(f"{a:11.2f} {b:11.2f} {b / a:5.2f}" if a and b else f"{'-':>11s} {'-':>11s} {'-':>5s}")
            print(f"{policy:9s} {model:20s} " + " ".join(cells), flush=True)
    print("ms per forward (median); x = loaded / idle")


if __name__ == "__main__":
    main()
