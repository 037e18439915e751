"""Where a compiled forward spends its time, from the runtime's own counters.

    python scripts/breakdown.py [--suite torchvision|timm|builtin|huggingface] --models a,b [--batch 1]
                                [--size N] [--threads 1] [--dtype float32|amp] [--iters 20]
                                [--wrapper python|cpp] [--entry compile|exported] [--openvino]

Python wrapper (default): compiles under CPU_LAYOUT_PROFILE=1, which times
every call the wrapper makes by kind (oneDNN convs, generated kernels, matmuls
on ATen, views, layout copies, other ATen ops); the rest is Python glue
between calls.
C++ wrapper (--wrapper cpp): the segment runtime times each instruction it
runs (`program.set_profiling`), grouped the same way; "segment runtime" is
what its calls spend outside their instructions (taking inputs, releasing
registers), and "outside the segments" is the rest of the forward: Dynamo's
guards and frame, AOT's wrapper, and ours (module-state check, handles); with
--entry exported (cpu_layout.compile_exported) no Dynamo, only our input checks.
Both print milliseconds per forward for each kind, the copies made per
forward, and the plan's own predictions next to the measured times: of what
its layouts decide (convs, copies, ATen pooling) and of the whole forward
(plus modelled kernels, reductions, concats and ATen ops). --openvino adds
OpenVINO's own per-layer counters for the same model and input, by layer type
and kernel (its convs, reorders, fused subgraphs), to compare kind by kind.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from cpu_layout import benchmark as B
from cpu_layout import runtime, zoo


# The segment runtime's opcodes, in the kinds the Python wrapper's profile uses.
SEGMENT_KINDS = {
    "conv (oneDNN)": ("CONV",),
    "conv (torch's oneDNN)": ("ATEN_CONV",),
    "generated kernels": ("KERNEL", "REDUCTION", "LAYER_NORM", "GROUP_NORM", "SOFTMAX", "POOL_KERNEL"),
    "layout copies": ("ORDERED", "ORDERED_PERM", "REORDER", "REORDER_PERM"),
    "views": ("RESHAPE", "PERMUTE", "UNSQUEEZE", "AS_STRIDED", "ALIAS", "SLICE"),
    "cat/shuffle/clone": ("CAT", "SHUFFLE", "CLONE"),
    "ATen (C shim)": ("MAX_POOL", "AVG_POOL", "CAT_SHIM", "UPSAMPLE", "INDEX", "MM", "BMM", "ADDMM"),
    "segment bookkeeping": ("EXPECT", "BLOB", "SYM_DIM", "SYM_SCALAR", "GIVE", "RESET", "CHECK", "OUT"),
}


def _segment_kinds(profile: dict, iters: int) -> dict:
    """ms per forward per kind from program.take_profile(); "segment runtime" is
    the runs' time outside their instructions."""
    ms = {op: t / iters * 1e3 for op, (t, _) in profile.items()}
    per = {}
    for kind, ops_ in SEGMENT_KINDS.items():
        v = sum(ms.get(op, 0.0) for op in ops_)
        if v:
            per[kind] = v
    known = {op for ops_ in SEGMENT_KINDS.values() for op in ops_}
    per.update({op: v for op, v in ms.items() if op != "run" and op not in known})  # a new opcode shows by name
    per["segment runtime"] = ms.get("run", 0.0) - sum(per.values())
    return per


def _print_openvino(model, x, args) -> None:
    """OpenVINO's layers on the same input, by type and kernel (PERF_COUNT)."""
    try:
        per = B._openvino(model, args.dtype, False).layer_profile(x, args.iters)
    except B.NotSupportedYet as exc:
        print(f"  OpenVINO: {exc}")
        return
    print(f"  OpenVINO, its own counters: {sum(per.values()):.3f} ms of layers per forward")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:10]:
        print(f"    {k:48s} {v:9.3f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="torchvision", choices=("builtin", "torchvision", "timm", "huggingface"))
    ap.add_argument("--models", required=True, help="comma-separated names in the suite")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=None, help="spatial size [the model's default]")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "amp"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--wrapper", default="python", choices=("python", "cpp"))
    ap.add_argument("--entry", default="compile", choices=("compile", "exported"),
                    help="torch.compile, or cpu_layout.compile_exported (no Dynamo per call)")
    ap.add_argument("--nodes", type=int, default=0,
                    help="also the N slowest nodes of the C++ segments (cpp wrapper)")
    ap.add_argument("--in-order", action="store_true", help="list --nodes in program order")
    ap.add_argument("--openvino", action="store_true",
                    help="also OpenVINO's time per layer type and kernel, from its own counters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from cpu_layout import backend
    from cpu_layout.codegen import program

    cpp = args.wrapper == "cpp"
    # Read when each graph compiles: the Python wrapper's call timers. The C++
    # wrapper times itself; the timers would only add to what it measures.
    if cpp:
        os.environ.pop("CPU_LAYOUT_PROFILE", None)
    else:
        os.environ["CPU_LAYOUT_PROFILE"] = "1"
    nodes = []

    for name in args.models.split(","):
        model, x = zoo.model_and_input(args.suite, name, args.batch, args.size)
        graphs = []
        real = backend.compile_graph

        def spy(gm, inputs, options, *rest, real=real):
            call = real(gm, inputs, options, *rest)
            graphs.append(call)
            return call

        backend.compile_graph = spy
        torch._dynamo.reset()
        amp = args.dtype == "amp"
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                if args.entry == "exported":
                    import cpu_layout

                    fn = cpu_layout.compile_exported(torch.export.export(model, B.as_args(x)), {"cpp_wrapper": cpp})
                else:
                    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
                for _ in range(3):
                    fn(*B.as_args(x))
                runtime.PROFILE.clear()
                if cpp:
                    program.set_profiling(True)
                    program.take_profile()
                    for seg in list(runtime.SegmentCall.live):
                        seg.take_node_profile()
                c0 = runtime.COPIES["count"]
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn(*B.as_args(x))
                wall = (time.perf_counter() - t0) / args.iters * 1e3
        finally:
            backend.compile_graph = real
            if cpp:  # the counters are process-wide: never leave them running
                program.set_profiling(False)
        if cpp:
            per = _segment_kinds(program.take_profile(), args.iters)
            nodes = [nd for seg in list(runtime.SegmentCall.live) for nd in seg.take_node_profile()]
        copies = (runtime.COPIES["count"] - c0) / args.iters
        if not cpp:
            per = {k: v[0] / args.iters * 1e3 for k, v in runtime.PROFILE.items()}
        plans = [c.cpu_layout_graph.plan for c in graphs if hasattr(c.cpu_layout_graph, "plan")]
        print(f"{name} ({args.suite}, {args.dtype}, batch {B.as_args(x)[0].shape[0]}, "
              f"{tuple(B.as_args(x)[0].shape[1 if isinstance(x, tuple) else 2:])}, "
              f"{args.threads} threads, {args.wrapper} wrapper, {args.entry}): {wall:.2f} ms per forward, {len(graphs)} graph(s), "
              f"{copies:.0f} layout copies per forward")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {k:22s} {v:9.3f} ms  {100 * v / wall:5.1f}%")
        rest = wall - sum(per.values())
        glue = "outside the segments" if cpp else "Python glue"
        print(f"  {glue:22s} {rest:9.3f} ms  {100 * rest / wall:5.1f}%")
        pred = sum(p.total_cost for p in plans) / 1e3
        layout = sum(p.conv_cost + p.copy_cost + p.op_cost for p in plans) / 1e3
        priced = [k for k in per if k in ("conv (oneDNN)", "conv (torch's oneDNN)", "layout copies") or "pool2d" in k]
        meas = sum(per[k] for k in priced)
        if meas:
            print(f"  plan's prediction of what its layouts decide (convs, copies, pooling) {layout:.3f} ms; "
                  f"measured {meas:.3f} ms ({layout / meas:.2f}x)")
        print(f"  plan's prediction of the whole forward (+ kernels, reductions, concats, ATen ops "
              f"modelled) {pred:.3f} ms; measured {wall:.3f} ms ({pred / wall:.2f}x), "
              f"{wall - rest:.3f} ms without the {glue} ({pred / (wall - rest):.2f}x)")
        if cpp and args.nodes:
            nodes = [nd for nd in nodes if nd[1] > 0]
            if not args.in_order:
                nodes.sort(key=lambda nd: -nd[1])
            print(f"  the {min(args.nodes, len(nodes))} slowest of {len(nodes)} segment nodes "
                  f"(with the copies each reads through):")
            for what, sec in nodes[:args.nodes]:
                print(f"    {sec / args.iters * 1e3:8.3f} ms  {what}")
        if args.openvino:
            _print_openvino(model, x, args)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
