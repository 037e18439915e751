"""Convolution micro-benchmark: cpu_layout's oneDNN primitives against torch.

For layer shapes of resnet50, resnext50_32x4d, convnext, mobilenet_v2 and
maml_omniglot, prints median
per-call times of
  torch_cf    F.conv2d on contiguous (NCHW) tensors
  torch_cl    F.conv2d on channels_last tensors
  torch_pk    torch.ops.mkldnn._convolution_pointwise with a prepacked weight
              (the path Inductor takes with freezing), channels_last input
  ours_cf / ours_cl   cpu_layout.ops.conv2d in NCHW / NHWC
and the ratios best-torch / best-ours (>1: we are faster). With --fused it
also times conv+bias+ReLU and conv+bias+add+ReLU fused against torch's conv
followed by the separate ops. All numbers come from one run, at 1 thread and
at all threads.

    python scripts/bench_conv.py [--threads 1,2] [--dtype float32,bfloat16] [--quick]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cpu_layout import _native, ops

# (model, name, N, C_in, H, W, C_out, k, stride, pad, groups)
SHAPES = [
    ("resnet50", "conv1", 1, 3, 224, 224, 64, 7, 2, 3, 1),
    ("resnet50", "l1.1x1a", 1, 64, 56, 56, 64, 1, 1, 0, 1),
    ("resnet50", "l1.3x3", 1, 64, 56, 56, 64, 3, 1, 1, 1),
    ("resnet50", "l1.1x1b", 1, 64, 56, 56, 256, 1, 1, 0, 1),
    ("resnet50", "l2.3x3s2", 1, 128, 56, 56, 128, 3, 2, 1, 1),
    ("resnet50", "l3.3x3", 1, 256, 14, 14, 256, 3, 1, 1, 1),
    ("resnet50", "l4.1x1", 1, 512, 7, 7, 2048, 1, 1, 0, 1),
    ("mobilenet_v2", "stem", 1, 3, 224, 224, 32, 3, 2, 1, 1),
    ("mobilenet_v2", "dw112", 1, 32, 112, 112, 32, 3, 1, 1, 32),
    ("mobilenet_v2", "pw112", 1, 32, 112, 112, 16, 1, 1, 0, 1),
    ("mobilenet_v2", "dw28s2", 1, 144, 56, 56, 144, 3, 2, 1, 144),
    ("mobilenet_v2", "pw14", 1, 384, 14, 14, 64, 1, 1, 0, 1),
    ("resnext50", "g32_3x3_56", 1, 128, 56, 56, 128, 3, 1, 1, 32),
    ("resnext50", "g32_3x3_56s2", 1, 256, 56, 56, 256, 3, 2, 1, 32),
    ("resnext50", "g32_3x3_28", 1, 256, 28, 28, 256, 3, 1, 1, 32),
    ("resnext50", "g32_3x3_14", 1, 512, 14, 14, 512, 3, 1, 1, 32),
    ("resnext50", "g32_3x3_7", 1, 1024, 7, 7, 1024, 3, 1, 1, 32),
    ("convnext", "dw7x7_56", 1, 96, 56, 56, 96, 7, 1, 3, 96),
    ("maml", "conv1", 5, 1, 28, 28, 64, 3, 1, 0, 1),
    ("maml", "conv2", 5, 64, 13, 13, 64, 3, 1, 0, 1),
    ("maml", "conv3", 5, 64, 5, 5, 64, 3, 1, 0, 1),
]


def median_time(fn, min_time=0.2, repeats=7):
    """Median seconds per call over `repeats` blocks sized to ~min_time/repeats each."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    iters = max(1, int(min_time / repeats / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def packed_conv(x_cl, w, b, stride, pad, groups):
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        w, [pad, pad], [stride, stride], [1, 1], groups, list(x_cl.shape)
    )
    return lambda: torch.ops.mkldnn._convolution_pointwise(
        x_cl, packed, b, [pad, pad], [stride, stride], [1, 1], groups, "none", [], ""
    )


def bench_shape(shape, dtype, fused):
    model, name, n, c, h, w_, oc, k, s, p, g = shape
    x = torch.randn(n, c, h, w_).to(dtype)
    w = (torch.randn(oc, c // g, k, k) * 0.1).to(dtype)
    b = torch.randn(oc).to(dtype)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    w_cl = w.contiguous(memory_format=torch.channels_last)
    r = {}
    r["torch_cf"] = median_time(lambda: F.conv2d(x, w, b, s, p, 1, g))
    r["torch_cl"] = median_time(lambda: F.conv2d(x_cl, w_cl, b, s, p, 1, g))
    try:
        r["torch_pk"] = median_time(packed_conv(x_cl, w, b, s, p, g))
    except RuntimeError:
        r["torch_pk"] = float("nan")
    r["ours_cf"] = median_time(lambda: ops.conv2d(x, w, b, s, p, 1, g, out_layout="nchw"))
    r["ours_cl"] = median_time(lambda: ops.conv2d(x_cl, w, b, s, p, 1, g, out_layout="nhwc"))
    impl_cf = ops.impl_name(x, w, b, s, p, 1, g, out_layout="nchw")
    impl_cl = ops.impl_name(x_cl, w, b, s, p, 1, g, out_layout="nhwc")
    if fused:
        y = F.conv2d(x_cl, w_cl, b, s, p, 1, g)
        res = torch.randn_like(y)
        r["torch_relu"] = median_time(lambda: torch.relu_(F.conv2d(x_cl, w_cl, b, s, p, 1, g)))
        r["ours_relu"] = median_time(
            lambda: ops.conv2d(x_cl, w, b, s, p, 1, g, post_ops=["relu"], out_layout="nhwc")
        )
        r["torch_addrelu"] = median_time(
            lambda: torch.relu_(F.conv2d(x_cl, w_cl, b, s, p, 1, g).add_(res))
        )
        r["ours_addrelu"] = median_time(
            lambda: ops.conv2d(
                x_cl, w, b, s, p, 1, g, post_ops=[("add", res), "relu"], out_layout="nhwc"
            )
        )
    return r, impl_cf, impl_cl


def geomean(xs):
    xs = [x for x in xs if x == x and x > 0]
    return float(torch.tensor(xs).log().mean().exp()) if xs else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--models", default="resnet50,resnext50,convnext,mobilenet_v2,maml")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused post-op comparison")
    ap.add_argument("--quick", action="store_true", help="maml shapes only, fp32, 1 thread")
    args = ap.parse_args(argv)
    if args.quick:
        args.threads, args.dtype, args.models = "1", "float32", "maml"
    models = set(args.models.split(","))
    print(f"oneDNN {'.'.join(map(str, _native.DNNL_VERSION))}, ISA {_native.cpu_isa()}, "
          f"native bf16: {_native.native_bf16()}, torch {torch.__version__}")
    print("times in microseconds (median); speedup = best torch path / best ours (>1: ours faster)")
    slowest = []
    with torch.no_grad():
        for nt in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(nt)
            for dname in args.dtype.split(","):
                dtype = getattr(torch, dname)
                hdr = (f"{'model':<13}{'layer':<10}{'torch_cf':>9}{'torch_cl':>9}{'torch_pk':>9}"
                       f"{'ours_cf':>9}{'ours_cl':>9}{'speedup':>8}{'cf/cf':>7}{'cl/cl':>7}")
                if not args.no_fused:
                    hdr += f"{'relu':>7}{'add+relu':>9}"
                print(f"\n== threads={nt} dtype={dname}")
                print(hdr + "  impl (nchw | nhwc)")
                speedups, fused_relu, fused_add = [], [], []
                for shape in SHAPES:
                    if shape[0] not in models:
                        continue
                    r, impl_cf, impl_cl = bench_shape(shape, dtype, not args.no_fused)
                    best_t = min(v for k, v in r.items() if k in ("torch_cf", "torch_cl", "torch_pk") and v == v)
                    best_o = min(r["ours_cf"], r["ours_cl"])
                    sp = best_t / best_o
                    speedups.append(sp)
                    slowest.append((sp, nt, dname, shape[0], shape[1]))
                    us = {k: v * 1e6 for k, v in r.items()}
                    line = (f"{shape[0]:<13}{shape[1]:<10}{us['torch_cf']:9.1f}{us['torch_cl']:9.1f}"
                            f"{us['torch_pk']:9.1f}{us['ours_cf']:9.1f}{us['ours_cl']:9.1f}{sp:8.2f}"
                            f"{r['torch_cf'] / r['ours_cf']:7.2f}"
                            f"{min(r['torch_cl'], r['torch_pk'] if r['torch_pk'] == r['torch_pk'] else 1e9) / r['ours_cl']:7.2f}")
                    if not args.no_fused:
                        fr = r["torch_relu"] / r["ours_relu"]
                        fa = r["torch_addrelu"] / r["ours_addrelu"]
                        fused_relu.append(fr)
                        fused_add.append(fa)
                        line += f"{fr:7.2f}{fa:9.2f}"
                    print(line + f"  {impl_cf} | {impl_cl}")
                msg = f"geomean speedup {geomean(speedups):.2f}"
                if fused_relu:
                    msg += f", fused relu {geomean(fused_relu):.2f}, fused add+relu {geomean(fused_add):.2f}"
                print(msg)
    worst = sorted(slowest)[:3]
    print("\nslowest vs torch's best path: " + ", ".join(
        f"{m}/{l} t={nt} {d}: {sp:.2f}" for sp, nt, d, m, l in worst))
    stats = ops.cache_stats()
    print(f"reference kernels used: {stats['ref_primitives']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
