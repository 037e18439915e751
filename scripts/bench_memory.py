#!/usr/bin/env python3
"""Resident memory a compiled model adds, in fresh processes, against what it reports.

Each figure is one new Python process: it builds the model and its input (suite input
at --batches), reads its resident set size (RSS, /proc/self/statm), compiles the model
with one variant, calls it four times under torch.inference_mode() (Inductor: once more
first, inside its freezing configuration), and reads RSS again:

  eager      the module itself (what its calls leave in the allocator)
  aot_eager  torch.compile's tracing with no backend: Dynamo's and aot_autograd's share
  inductor   Inductor with freezing and its cpp_wrapper
  cplpy      cpu_layout, Python wrapper
  cplcpp     cpu_layout, C++ wrapper
  cplexp     cpu_layout.compile_exported (C++ wrapper); its baseline is read after export

For the cpu_layout variants the child also prints what the backend reports:
cpu_layout.memory_stats (held between calls, by kind) plus the peak the profiler sees
allocated in a fifth call, the figure the benchmarks' compression_ratio uses.

Caches: `filled` runs each variant once to fill a cache of its own, then measures a run
with it (convs timed before, kernels compiled before); `empty` measures the run that
fills a new one (its compile's leftovers count). The table prints, per model and batch,
each variant's growth in MB, the backend's own share (growth beyond aot_eager; beyond
the RSS after export for cplexp), the reported figure and the share/reported ratio, the
module's parameter bytes and the largest set of activations live at once in a segment;
then `cr`, compression_ratio as the benchmarks report it (eager's peak in one call over
the reported figure), and `rss cr`, eager's growth over the variant's.

    python scripts/bench_memory.py [--suite torchvision] [--models resnet50,densenet121]
        [--batches 1,8] [--variants eager,aot_eager,inductor,cplpy,cplcpp,cplexp]
        [--caches filled,empty] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("eager", "aot_eager", "inductor", "cplpy", "cplcpp", "cplexp")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(spec: dict) -> dict:
    import gc

    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, HERE)
    from cpu_layout import benchmark as B
    from cpu_layout import memory, zoo

    model, x = zoo.model_and_input(spec["suite"], spec["model"], spec["batch"])
    args = B.as_args(x)
    what = spec["what"]
    out = {"params": sum(p.numel() * p.element_size() for p in model.parameters())}
    with torch.inference_mode():
        if what == "cplexp":
            ep = torch.export.export(model, args)
        gc.collect()
        memory.trim()
        base = rss()
        if what == "eager":
            c = model
        elif what == "aot_eager":
            c = torch.compile(model, backend="aot_eager")
        elif what == "inductor":
            c = torch.compile(model, backend="inductor")
        elif what in ("cplpy", "cplcpp"):
            c = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": what == "cplcpp"})
        elif what == "cplexp":
            import cpu_layout

            c = cpu_layout.compile_exported(ep, {"cpp_wrapper": True})
        else:
            raise ValueError(what)
        if what == "inductor":  # freezing and its C++ wrapper are read while it compiles
            import torch._inductor.config as ic
            import torch._inductor.freezing as fz

            real, frozen = fz.freeze, []
            fz.freeze = lambda *a, **k: frozen.append(1) or real(*a, **k)
            with ic.patch(freezing=True, cpp_wrapper=True):
                c(*args)
            fz.freeze = real
            if not frozen:
                raise RuntimeError("Inductor's freeze() never ran: not a freezing build")
        for _ in range(4):
            c(*args)
        gc.collect()
        out["growth"] = rss() - base
        if what == "eager":
            out["call_peak"] = B.peak_memory(lambda a: c(*a), args)
        if what.startswith("cpl"):
            import cpu_layout

            stats = cpu_layout.memory_stats(c)
            out["stats"] = stats
            out["call_peak"] = B.peak_memory(lambda a: c(*a), args)
            out["reported"] = stats["total"] + out["call_peak"]
    return out


def _run(spec: dict, cache: str) -> dict:
    env = dict(os.environ, CPU_LAYOUT_CACHE_DIR=os.path.join(cache, "cpu_layout"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec}: child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> str:
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cpus"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="torchvision")
    ap.add_argument("--models", default="resnet50,densenet121")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--caches", default="filled,empty")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    variants = [v for v in args.variants.split(",") if v]
    bad = set(variants) - set(VARIANTS)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    mb = 1e6
    print(f"# {_machine()}, {args.threads} thread(s); MB = 1e6 bytes; growth of RSS from the built model "
          f"to after four calls, fresh process per figure")
    print(f"{'model':16s} {'bs':>3s} {'cache':6s} " + " ".join(f"{v:>9s}" for v in variants)
          + f" | {'variant':8s} {'share':>7s} {'reported':>8s} {'ratio':>6s} {'params':>7s} {'live':>6s}"
          + f" {'cr':>6s} {'rss cr':>6s}")
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for cache_kind in args.caches.split(","):
                    res = {}
                    for v in variants:
                        spec = {"suite": args.suite, "model": name, "batch": batch, "what": v,
                                "threads": args.threads}
                        cache = os.path.join(tmp, f"{name}-{batch}-{v}-{cache_kind}")
                        if cache_kind == "filled":
                            _run(spec, cache)
                        res[v] = _run(spec, cache)
                    line = f"{name:16s} {batch:3d} {cache_kind:6s} " + " ".join(
                        f"{res[v]['growth'] / mb:9.1f}" for v in variants)
                    first = True
                    for v in variants:
                        if not v.startswith("cpl"):
                            continue
                        floor = res["aot_eager"]["growth"] if v != "cplexp" and "aot_eager" in res else 0
                        share = res[v]["growth"] - floor
                        rep = res[v]["reported"]
                        tail = (f" | {v:8s} {share / mb:7.1f} {rep / mb:8.1f} {share / rep:6.2f} "
                                f"{res[v]['params'] / mb:7.1f} {res[v]['stats']['largest_live'] / mb:6.1f}")
                        if "eager" in res:  # compression_ratio as the benchmarks report it, and from RSS
                            tail += (f" {res['eager']['call_peak'] / rep:6.2f}"
                                     f" {res['eager']['growth'] / res[v]['growth']:6.2f}")
                        print((line if first else " " * len(line)) + tail, flush=True)
                        first = False
                    if first:
                        print(line, flush=True)
                    for v in variants:
                        if v.startswith("cpl"):
                            kinds = ", ".join(f"{k} {val / mb:.1f}" for k, val in res[v]["stats"].items()
                                              if k != "total")
                            print(f"    {v}: {kinds}; call peak {res[v]['call_peak'] / mb:.1f}", flush=True)


if __name__ == "__main__":
    main()
