#!/usr/bin/env python
"""Planning time for a 200-conv graph (ResNeXt-like bottlenecks with residuals and grouped convs).

    python scripts/bench_plan.py [--convs 200] [--runs 30]

Prints the median wall time of `cpu_layout.plan.plan` (target: < 50 ms), both
with a warm cost model (conv lookups memoised, as within one compile) and a
cold one (a fresh CostModel per run, every lookup searched in the table).
"""
import argparse
import statistics
import time

import torch

from cpu_layout.plan import CostModel, Graph, plan
from cpu_layout.plan.cost import TABLE_PATH


def resnet_like(n_convs: int, batch: int = 8) -> Graph:
    g = Graph()
    x = g.input("x", (batch, 3, 224, 224))
    y = g.pool(g.pointwise(g.batchnorm(g.conv(x, 64, 7, stride=2, padding=3)), op="relu"), 3, 2, 1)
    c, block = 64, 0
    while len(g.of_kind("conv")) < n_convs - 1:
        stage = min(block // 12, 3)
        width, out = 128 * 2 ** stage, 256 * 2 ** stage
        stride = 2 if block % 12 == 0 and block else 1
        grouped = block % 2 == 1  # every other block is ResNeXt-style (groups=32)
        a = g.pointwise(g.batchnorm(g.conv(y, width, 1)), op="relu")
        a = g.pointwise(g.batchnorm(g.conv(a, width, 3, stride=stride, padding=1,
                                           groups=32 if grouped else 1)), op="relu")
        a = g.batchnorm(g.conv(a, out, 1))
        skip = y if (c == out and stride == 1) else g.batchnorm(g.conv(y, out, 1, stride=stride))
        y = g.pointwise(g.pointwise(a, skip, op="add"), op="relu")
        c, block = out, block + 1
    head = g.pointwise(g.conv(y, 512, 1), op="relu")
    g.output(head)  # a feature map output (eager strides: contiguous)
    g.output(g.linear(g.flatten(g.adaptive_pool(y, (1, 1)), 1), 1000))
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--convs", type=int, default=200)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    g = resnet_like(args.convs)
    n_conv = len(g.of_kind("conv"))
    warm_cm = CostModel.load(TABLE_PATH)
    p = plan(g, warm_cm, compare_policies=True)
    times = {"warm": [], "cold": []}
    for _ in range(args.runs):
        for kind in ("warm", "cold"):
            cm = warm_cm if kind == "warm" else CostModel.load(TABLE_PATH)
            t0 = time.perf_counter()
            plan(g, cm)
            times[kind].append(time.perf_counter() - t0)
    print(f"graph: {len(g)} nodes, {n_conv} convs ({sum(1 for c in g.of_kind('conv') if c.groups > 1)} grouped)")
    print(f"plan: {len(p.copies)} copies, {sum(d.label == 'channels_last' for d in p.convs.values())} convs NHWC, "
          f"total {p.total_cost / 1e3:.1f} ms est.; policies: "
          + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in p.policies.items()) + f"; exact={p.exact}")
    for kind, ts in times.items():
        print(f"planning time ({kind} cost model): median {statistics.median(ts) * 1e3:.1f} ms, "
              f"min {min(ts) * 1e3:.1f} ms over {len(ts)} runs")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
