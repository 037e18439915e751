#!/usr/bin/env python3
"""A/B of compile-time settings: one model compiled once per variant, all timed
interleaved in one process.

Each variant is `label:NAME=VALUE,NAME=VALUE` (or just `label:` for the
settings as they are); the environment variables are set while that variant's
graph compiles (CPU_LAYOUT_CONV_IMPL, CPU_LAYOUT_AUTOTUNE, ... are read
then), and each variant has a backend of its own, so Dynamo cannot hand one
variant's graph to another. Every output is checked against eager before
timing (PyTorch's benchmark accuracy check, as bench_models.py; strides). Prints
the median and fastest round of each, in ms per forward.

    python scripts/bench_ab.py --model mobilenet_v3_large [--suite torchvision] [--batch 8]
                               [--threads 2] [--dtype float32|amp] [--rounds 12] [--wrapper cpp|python]
                               "auto:" "onednn:CPU_LAYOUT_CONV_IMPL=onednn"

Use it for a decision that isolated timings cannot settle (a conv's
candidates timed alone ranked the other way round from the whole graph).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from cpu_layout import benchmark as B
from cpu_layout import zoo
from cpu_layout.backend import cpu_layout_backend


def parse_variant(spec: str):
    label, sep, envs = spec.partition(":")
    if not sep or not label:
        raise SystemExit(f"bench_ab: a variant is label:NAME=VALUE,... (got {spec!r})")
    env = {}
    for item in filter(None, envs.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"bench_ab: {item!r} in {spec!r} is not NAME=VALUE")
        env[name] = value
    return label, env


def backend_with(env: dict, cpp: bool = True):
    def backend(gm, example_inputs):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return cpu_layout_backend(gm, example_inputs, options={"cpp_wrapper": cpp})
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return backend


def check(y, ref, fp64_ref, dtype: str, label: str):
    """PyTorch's benchmark accuracy check and eager's strides (cpu_layout.benchmark)."""
    if not B.values_match(ref, y, fp64_ref, dtype):
        raise SystemExit(f"bench_ab: {label}: values differ from eager beyond the {dtype} tolerance")
    if not B.strides_match(ref, y):
        raise SystemExit(f"bench_ab: {label}: strides differ from eager: {B.stride_report(ref, y)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--suite", default="torchvision", choices=("builtin", "torchvision", "timm"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "amp"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--wrapper", default="cpp", choices=("cpp", "python"))
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    if len({label for label, _ in variants}) != len(variants):
        raise SystemExit("bench_ab: variant labels must differ")
    torch.set_num_threads(args.threads)
    model, x = zoo.model_and_input(args.suite, args.model, args.batch)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "amp")
    fns = {}
    fp64_ref = B.fp64_reference(model, x)
    with torch.no_grad(), amp:
        ref = model(x)
        for label, env in variants:
            fn = torch.compile(copy.deepcopy(model), backend=backend_with(env, args.wrapper == "cpp"))
            check(fn(x), ref, fp64_ref, args.dtype, label)
            fns[label] = fn
        first = next(iter(fns.values()))
        calls = max(2, round(0.3 / max(1e-4, min(_once(first, x) for _ in range(3)))))
        times = {label: [] for label in fns}
        for _ in range(args.rounds):
            for label, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(x)
                times[label].append((time.perf_counter() - t0) / calls * 1e3)
    print(f"{args.model} {args.dtype} batch {args.batch}, {args.threads} thread(s), {args.wrapper} wrapper, {args.rounds} "
          f"interleaved rounds of {calls} calls: ms per forward, median (fastest round)")
    base = statistics.median(times[variants[0][0]])
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"  {label:16s} {med:9.3f} ({min(ts):.3f})  x{base / med:.3f} vs {variants[0][0]}")


def _once(fn, x) -> float:
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
