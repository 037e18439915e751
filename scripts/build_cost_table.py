#!/usr/bin/env python
"""Measure the conv cost table the layout planner ships for this CPU's oneDNN ISA
(cpu_layout/data/conv_cost_table_<isa>.json; the planner picks the table by ISA).

For each shape class (in/out channels, kernel, stride, groups, spatial size,
dtype) it times one oneDNN forward convolution with src/dst in NCHW and in
NHWC, single thread, batch 1, and records the median in microseconds.  It also
measures a layout-conversion copy (NCHW <-> NHWC) per byte, so conv and copy
costs share one unit.

The project's own oneDNN wrapper `cpu_layout.ops.conv2d(..., out_layout=)` is
used when it imports; otherwise `torch.nn.functional.conv2d` (also oneDNN) with
the input in contiguous vs channels_last memory.  The JSON records which one
measured it and the machine's ISA.

    python scripts/build_cost_table.py [--out PATH] [--budget-s 240] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from cpu_layout.plan.cost import DATA_DIR, cpu_isa  # noqa: E402
from cpu_layout.plan.measure import copy_us_per_byte  # noqa: E402

# (cin, cout, kernel, stride, groups, spatial): resnet/resnext/mobilenet/convnext/maml-like
# classes plus tiny channel counts, where NHWC may not pay off.
CLASSES = [
    # regular
    (1, 64, 3, 1, 1, 28), (64, 64, 3, 1, 1, 13), (3, 64, 7, 2, 1, 224), (3, 32, 3, 2, 1, 224),
    (64, 64, 1, 1, 1, 56), (64, 64, 3, 1, 1, 56), (64, 256, 1, 1, 1, 56), (256, 64, 1, 1, 1, 56),
    (64, 128, 3, 2, 1, 56), (128, 128, 3, 1, 1, 28), (128, 512, 1, 1, 1, 28), (512, 128, 1, 1, 1, 28),
    (128, 256, 3, 2, 1, 28), (256, 256, 3, 1, 1, 14), (256, 1024, 1, 1, 1, 14), (1024, 256, 1, 1, 1, 14),
    (512, 512, 3, 1, 1, 7), (512, 2048, 1, 1, 1, 7), (2048, 512, 1, 1, 1, 7),
    (32, 16, 1, 1, 1, 112), (16, 96, 1, 1, 1, 112), (96, 24, 1, 1, 1, 56),
    # tiny channel counts (below / near the vector width)
    (2, 8, 3, 1, 1, 32), (4, 16, 3, 1, 1, 32), (8, 8, 3, 1, 1, 32), (16, 16, 3, 1, 1, 32),
    (32, 32, 3, 1, 1, 32), (8, 4, 3, 1, 1, 32), (64, 3, 3, 1, 1, 32),
    # depthwise
    (32, 32, 3, 1, 32, 112), (96, 96, 3, 2, 96, 112), (144, 144, 3, 1, 144, 56),
    (192, 192, 3, 1, 192, 28), (384, 384, 3, 1, 384, 14), (960, 960, 3, 1, 960, 7),
    (96, 96, 7, 1, 96, 56), (384, 384, 7, 1, 384, 14), (16, 16, 3, 1, 16, 32),
    # grouped (resnext 32x4d, regnet-like, few groups)
    (128, 128, 3, 1, 32, 56), (256, 256, 3, 1, 32, 28), (512, 512, 3, 1, 32, 14),
    (1024, 1024, 3, 1, 32, 7), (64, 64, 3, 1, 8, 56), (256, 256, 3, 1, 16, 14),
    (64, 64, 3, 1, 2, 28), (128, 128, 3, 2, 4, 28),
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def backend():
    """(name, run(x, w, stride, padding, groups, channels_last))"""
    try:
        import cpu_layout.ops as ops

        def run(x, w, s, p, g, cl):
            return ops.conv2d(x, w, None, s, p, 1, g, out_layout="nhwc" if cl else "nchw")

        x = torch.randn(1, 4, 8, 8)
        run(x, torch.randn(4, 4, 3, 3), 1, 1, 1, False)
        return "cpu_layout.ops.conv2d", run
    except Exception as e:  # not built yet / import error: eager oneDNN is the next best thing
        print(f"cpu_layout.ops unavailable ({type(e).__name__}: {e}); using torch.nn.functional.conv2d",
              file=sys.stderr)

        def run(x, w, s, p, g, cl):
            return torch.nn.functional.conv2d(x, w, None, s, p, 1, g)

        return "torch.nn.functional.conv2d", run


def median_pair_us(fa, fb, target_s: float, min_reps: int = 5, max_reps: int = 60):
    """Median µs of fa and fb, timed alternately so load from other processes hits both alike."""
    fa(); fb()
    t0 = time.perf_counter()
    fa(); fb()
    one = time.perf_counter() - t0
    reps = int(max(min_reps, min(max_reps, target_s / max(one, 1e-6))))
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: cpu_layout/data/conv_cost_table_<isa>.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop adding classes after this")
    ap.add_argument("--quick", action="store_true", help="a few classes, for smoke tests")
    args = ap.parse_args()
    if args.out is None:
        args.out = os.path.join(DATA_DIR, f"conv_cost_table_{cpu_isa()}.json")

    torch.set_num_threads(1)  # the table is per-core; the planner compares layouts, not thread scaling
    torch.manual_seed(0)
    name, run = backend()
    classes = CLASSES[:6] if args.quick else CLASSES
    # bf16 is emulated (f32 compute) without avx512_bf16/amx: ~10x slower, so
    # measure it at half the spatial size; the planner scales by FLOPs anyway.
    from cpu_layout import _native

    slow_bf16 = not _native.native_bf16()
    start = time.perf_counter()
    entries = []
    for dtype in (torch.float32, torch.bfloat16):
        for cin, cout, k, s, g, hw in classes:
            if time.perf_counter() - start > args.budget_s:
                print("time budget reached; table truncated", file=sys.stderr)
                break
            if dtype == torch.bfloat16 and slow_bf16 and hw > 14:
                hw = hw // 2
            x = torch.randn(1, cin, hw, hw).to(dtype)
            w = (torch.randn(cout, cin // g, k, k) * 0.1).to(dtype)
            xs = {False: x, True: x.contiguous(memory_format=torch.channels_last)}
            pad = k // 2
            t = dict(zip((False, True), median_pair_us(lambda: run(xs[False], w, s, pad, g, False),
                                                       lambda: run(xs[True], w, s, pad, g, True),
                                                       target_s=1.0 if dtype == torch.float32 else 1.5)))
            e = dict(dtype=str(dtype).replace("torch.", ""), cin=cin, cout=cout, kernel=k, stride=s,
                     groups=g, spatial=hw, batch=1, nchw_us=round(t[False], 2), nhwc_us=round(t[True], 2))
            entries.append(e)
            print(f"{e['dtype']:9s} cin={cin:5d} cout={cout:5d} k={k} s={s} g={g:4d} hw={hw:4d}  "
                  f"nchw={t[False]:10.1f}us nhwc={t[True]:10.1f}us  ratio={t[True] / t[False]:.2f}", flush=True)

    # Copy cost: a layout conversion in each direction, per byte moved (one tensor's bytes),
    # measured as the planner measures it at compile time for other thread counts.
    copy = {str(dtype).replace("torch.", ""): copy_us_per_byte(dtype) for dtype in (torch.float32, torch.bfloat16)}

    table = {
        "version": 1,
        "unit": "microseconds (median, 1 thread, batch 1)",
        "backend": name,
        "isa": cpu_isa(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "threads": 1,
        "created": time.strftime("%Y-%m-%d"),
        "copy_us_per_byte": copy,
        "entries": entries,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {len(entries)} entries to {os.path.abspath(args.out)} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
