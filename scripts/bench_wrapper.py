#!/usr/bin/env python3
"""cpu_layout's two wrappers against each other: per-call overhead, peak memory, foreign calls.

For each model x dtype x shape: median latency of eager, cpu_layout with the default
(Python) wrapper, cpu_layout with cpp_wrapper, and optionally Inductor with its cpp_wrapper
(--inductor), timed in interleaved rounds in one process; the overhead the C++ wrapper saves
per call (default - cpp, in microseconds); memory (below); and how many
C++ segments (foreign calls) one forward of the cpp wrapper enters. Memory is what the compiled
model holds between calls (cpu_layout.memory_stats: packed and derived weights, arenas, pools,
scratch, code) plus the peak bytes allocated during one forward.

The default model is conv5x16: five 3x3 convs of 16 channels at batch 1, where the wrapper's
own work is a large part of each call.

    python scripts/bench_wrapper.py [--models conv5x16,maml_omniglot,resnet18] [--dtypes float32,amp]
                                    [--shapes static,dynamic] [--threads N] [--iters N] [--inductor]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

from cpu_layout import benchmark as B  # noqa: E402
from cpu_layout import models  # noqa: E402
from cpu_layout import runtime  # noqa: E402

# label -> (backend, wrapper)
VARIANTS = {"eager": ("eager", "default"), "cpl": ("cpu_layout", "default"),
            "cpl_cpp": ("cpu_layout", "cpp"), "ind_cpp": ("inductor", "cpp")}


def run(name, dtype, shape, labels, args):
    model, x = models.build(name)
    dynamic = shape == "dynamic"
    torch._dynamo.reset()
    fns, out, notes, peaks = {}, {}, [], {}
    for label in labels:
        backend, wrapper = VARIANTS[label]
        c = B.compile_model(model, backend, dtype, dynamic and backend != "eager", wrapper, reset=False)
        xi = c.prepare_input(x)
        c.first_call(xi)
        out[label] = c.first_output
        for w in c.fallback_warnings:
            notes.append(f"{label}: {w}")
        c.mark()
        fns[label] = (c, xi)
    fp64 = B.fp64_reference(model, x)
    for label in labels[1:]:
        if not B.values_match(out["eager"], out[label], fp64, dtype) or \
                not B.strides_match(out["eager"], out[label]):
            notes.append(f"{label}: output differs from eager ({B.stride_report(out['eager'], out[label])})")
    per = max(1, args.iters // args.rounds)
    lat = B.interleaved_medians(fns, rounds=args.rounds, iters=per, warmup=2)
    for label, (c, _) in fns.items():
        c.check_own_code(args.rounds * per)
    for label in ("cpl", "cpl_cpp"):
        if label in fns:
            c, xi = fns[label]
            peaks[label] = B.peak_memory(c, xi) + c.held_bytes()
    c, xi = fns["cpl_cpp"]
    before = runtime.SegmentCall.calls
    c(xi)
    segments = runtime.SegmentCall.calls - before
    return dict(model=name, dtype=dtype, shape=shape, batch=int(x.shape[0]), lat=lat, peaks=peaks,
                segments=segments, notes=notes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="conv5x16")
    ap.add_argument("--dtypes", default="float32,amp")
    ap.add_argument("--shapes", default="static,dynamic")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--iters", type=int, default=200, help="timed calls per variant [200]")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inductor", action="store_true", help="also time Inductor with cpp_wrapper")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    labels = ["eager", "cpl", "cpl_cpp"] + (["ind_cpp"] if args.inductor else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}; {args.iters} timed calls per variant in {args.rounds} "
          f"interleaved rounds")
    rows = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for shape in args.shapes.split(","):
                rows.append(run(name, dtype, shape, labels, args))
                print(f"  {name} {dtype} {shape} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    head = (f"{'model':<14}{'dtype':<8}{'shape':<8}{'bs':>3} |" + "".join(f"{l + ' us':>12}" for l in labels)
            + f" | {'cpl/cpp':>8}{'saved us':>9} | {'mem cpl':>10}{'mem cpp':>10} | {'calls':>5}")
    print("median microseconds per call; cpl/cpp = default wrapper / cpp wrapper (>1: cpp faster); "
          "saved = default - cpp; mem KiB held between calls + allocated in one forward; "
          "calls = C++ segments entered per forward")
    print(head)
    print("-" * len(head))
    ratios = []
    for r in rows:
        lat = r["lat"]
        ratio = lat["cpl"] / lat["cpl_cpp"]
        ratios.append(ratio)
        line = f"{r['model']:<14}{r['dtype']:<8}{r['shape']:<8}{r['batch']:>3} |"
        line += "".join(f"{lat[l] * 1e6:12.1f}" for l in labels)
        line += f" | {ratio:8.2f}{(lat['cpl'] - lat['cpl_cpp']) * 1e6:9.1f}"
        line += f" | {r['peaks']['cpl'] / 1024:10.1f}{r['peaks']['cpl_cpp'] / 1024:10.1f} | {r['segments']:5d}"
        print(line)
    print("-" * len(head))
    print(f"geomean cpl/cpp {B.geomean(ratios):.2f}")
    notes = [f"{r['model']} {r['dtype']} {r['shape']}: {n}" for r in rows for n in r["notes"]]
    for n in notes:
        print("  note: " + n)
    return 1 if any("differs" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
