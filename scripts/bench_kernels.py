"""Benchmark: one fused generated kernel against eager's separate ops (not a test).

Times relu(x * scale + bias) with per-channel scale/bias (a folded batch norm) on a
[32, 64, 56, 56] tensor, and a channels-last global average pool, in float32 and bfloat16.
Prints median times per call and eager/ours (>1: the fused kernel is faster).

    python scripts/bench_kernels.py [--threads 1,2] [--shape 32,64,56,56] [--reps 30]
"""
import argparse
import statistics
import time

import torch

from cpu_layout.codegen import Load, Op, PointwiseKernel, ReductionKernel


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    ap.add_argument("--shape", default="32,64,56,56")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    C = shape[1]
    x, s, b = Load(0), Load(1), Load(2)
    chain = Op("relu", (Op("add", (Op("mul", (x, s)), b)),))
    print(f"shape {shape}; median ms per call")
    print(f"{'case':44s} {'thr':>3s} {'eager':>8s} {'fused':>8s} {'ratio':>6s}")
    for nt in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(nt)
        for dt in (torch.float32, torch.bfloat16):
            for fmt in ("channels_last", "contiguous"):
                mf = getattr(torch, f"{fmt}_format" if fmt == "contiguous" else fmt)
                X = torch.randn(shape).to(dt).contiguous(memory_format=mf)
                S = torch.randn(1, C, 1, 1).to(dt)
                B = torch.randn(1, C, 1, 1).to(dt)
                out = torch.empty_like(X)
                run = PointwiseKernel([dt] * 3, [(chain, dt)], 4).compile()
                eager = median_ms(lambda: torch.relu(X * S + B), args.reps)
                ours = median_ms(lambda: run(X.shape, [X, S, B], [out]), args.reps)
                name = f"relu(x*s+b) {str(dt)[6:]} {fmt}"
                print(f"{name:44s} {nt:3d} {eager:8.3f} {ours:8.3f} {eager / ours:6.2f}")
            X = torch.randn(shape).to(dt).contiguous(memory_format=torch.channels_last)
            red = ReductionKernel(dt, x, "mean", 4, (2, 3), keepdim=True, out_dtype=dt).compile()
            out = torch.empty(shape[0], C, 1, 1, dtype=dt)
            eager = median_ms(lambda: X.mean((2, 3), keepdim=True), args.reps)
            ours = median_ms(lambda: red(X.shape, [X], [out]), args.reps)
            name = f"mean(2,3) keepdim {str(dt)[6:]} channels_last"
            print(f"{name:44s} {nt:3d} {eager:8.3f} {ours:8.3f} {eager / ours:6.2f}")
    small = torch.randn(16)
    o = torch.empty_like(small)
    run = PointwiseKernel([torch.float32] * 3, [(chain, torch.float32)], 1).compile()
    t = median_ms(lambda: run((16,), [small, small, small], [o]), 2000)
    print(f"per-call overhead (16 elements, Python run + cffi): {t * 1e3:.1f} us")


if __name__ == "__main__":
    main()
