#!/usr/bin/env python3
"""Built-in model suite: cpu_layout against eager and Inductor, one table.

For every model x dtype (float32, amp) x shape (static, dynamic = batch dim only):
median latency of
  eager      the model as is
  eager_cl   eager, model and input in channels_last
  ind        Inductor, default configuration
  frz        Inductor with freezing + cpp_wrapper (its best CPU configuration)
  frzpy      Inductor with freezing, default (Python) wrapper
  cpl        cpu_layout, default (Python) wrapper
  cplcpp     cpu_layout, C++ wrapper (options={"cpp_wrapper": True})
timed in interleaved rounds in the same process (so machine noise hits all alike),
speedups vs eager and vs frz, compile time (first call minus a median call) of each
compiled backend, and a check of every compiled output against eager: values with
PyTorch's benchmark tolerances (cpu_layout.benchmark.TOLERANCE) and output strides
(size-1 dims ignored). Geomeans at the bottom.

Each configuration starts from torch._dynamo.reset(); each compiled backend has its
own counting backend and the script checks that the timed calls ran the code that
backend compiled (and, for frz, that Inductor's freeze() really ran).

    python scripts/bench_models.py [--models a,b] [--dtypes float32,amp] [--shapes static,dynamic]
                                   [--threads N] [--iters N] [--quick] [--csv PATH]

Inductor compile times dominate the run time (seconds to tens of seconds per graph on
two cores, less once its on-disk caches are warm); --backends drops some.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
if "--cold" in sys.argv:  # must happen before torch/inductor read their cache locations
    import tempfile

    _COLD = tempfile.mkdtemp(prefix="bench_models_cold_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_COLD, "inductor")
    os.environ["CPU_LAYOUT_CACHE_DIR"] = os.path.join(_COLD, "cpu_layout")

import torch  # noqa: E402

from cpu_layout import benchmark as B  # noqa: E402
from cpu_layout import models  # noqa: E402

# label -> (backend, channels_last, wrapper)
VARIANTS = {
    "eager": ("eager", False, "default"),
    "eager_cl": ("eager", True, "default"),
    "ind": ("inductor", False, "default"),
    "frz": ("inductor_freezing", False, "cpp"),
    "frzpy": ("inductor_freezing", False, "default"),
    "cpl": ("cpu_layout", False, "default"),
    "cplcpp": ("cpu_layout", False, "cpp"),
}
COMPILED = ("ind", "frz", "frzpy", "cpl", "cplcpp")
# Like-for-like wrapper comparisons printed under the table: (ours, Inductor's).
PAIRS = (("cpl", "frzpy"), ("cplcpp", "frz"))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


W = 9  # column width


def fmt_ms(v):
    return f"{v * 1e3:{W}.3f}" if v else f"{'-':>{W}}"


def fmt_x(v):
    return f"{v:{W}.2f}" if v and math.isfinite(v) else f"{'-':>{W}}"


def fmt_s(v):
    return f"{v:{W}.1f}" if v is not None else f"{'-':>{W}}"


def run_config(name, dtype, shape, variants, args):
    """One model x dtype x shape: compile all variants, check, time. Returns a result dict."""
    dynamic = shape == "dynamic"
    model, x = models.build(name)
    torch._dynamo.reset()
    res = {"model": name, "dtype": dtype, "shape": shape, "batch": int(x.shape[0]),
           "lat": {}, "compile": {}, "status": {}, "flags": [], "reasons": []}
    fns = {}
    ref = None
    for label in variants:
        backend, cl, wrapper = VARIANTS[label]
        try:
            c = B.compile_model(model, backend, dtype, dynamic if backend != "eager" else False,
                                wrapper, cl, reset=False)
            xi = c.prepare_input(x)
            t0 = time.perf_counter()
            c.first_call(xi)
            res["compile"][label] = time.perf_counter() - t0  # minus median below
            out = c.first_output
        except B.NotSupportedYet as exc:
            res["status"][label] = "not_supported"
            res["reasons"].append(f"{label}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001
            res["status"][label] = "fail_to_run"
            res["flags"].append(f"{label}:fail")
            res["reasons"].append(f"{label}: " + B.one_line(name, exc))
            continue
        if label == "eager":
            ref = out
            res["fp64"] = B.fp64_reference(model, x)
        elif ref is not None:
            if not B.values_match(ref, out, res.get("fp64"), dtype):
                res["flags"].append(f"{label}:values")
                res["reasons"].append(f"{label}: {name}, AccuracyError: "
                                      f"{B.describe_error(ref, out, res.get('fp64'), dtype)}")
            if label != "eager_cl" and not B.strides_match(ref, out):
                res["flags"].append(f"{label}:strides")
                res["reasons"].append(f"{label}: {name}, strides differ: {B.stride_report(ref, out)}")
        for w in c.fallback_warnings:
            res["flags"].append(f"{label}:fallback")
            res["reasons"].append(f"{label}: {name}, {w}")
        res["status"][label] = "pass"
        c.mark()
        fns[label] = (c, xi)
    if "eager" not in fns:
        return res
    rounds, per = args.rounds, max(1, args.iters // args.rounds)
    lat = B.interleaved_medians(fns, rounds=rounds, iters=per, warmup=args.warmup)
    for label, (c, _) in fns.items():
        try:
            c.check_own_code(args.warmup + rounds * per)
        except B.WrongCodeRan as exc:
            res["flags"].append(f"{label}:wrong_code")
            res["reasons"].append(f"{label}: {exc}")
            lat.pop(label, None)
            continue
        if label in res["compile"] and label in COMPILED:
            res["compile"][label] = max(res["compile"][label] - lat[label], 0.0)
        else:
            res["compile"].pop(label, None)
    res["lat"] = lat
    if dynamic:  # a second batch size must not recompile
        x2 = models.build(name, batch_size=res["batch"] + 1)[1]
        for label, (c, _) in fns.items():
            if label not in COMPILED or label not in lat:
                continue
            before = c.compiles
            try:
                c(c.prepare_input(x2))
            except Exception as exc:  # noqa: BLE001
                res["flags"].append(f"{label}:bs+1_fail")
                res["reasons"].append(f"{label}: batch {res['batch'] + 1}: " + B.one_line(name, exc))
                continue
            if c.compiles != before:
                res["flags"].append(f"{label}:recompiled")
                res["reasons"].append(f"{label}: {name}, batch {res['batch'] + 1} recompiled "
                                      f"(the batch dimension was not dynamic)")
    res.pop("fp64", None)
    return res


def print_table(results, variants):
    lat_cols = list(variants)
    x_cols = [v for v in variants if v != "eager"]
    vs_frz = [v for v in ("ind", "cpl", "cplcpp") if v in variants and "frz" in variants]
    comp_cols = [v for v in COMPILED if v in variants]
    sections = [("latency ms", lat_cols), ("x eager", x_cols)]
    if vs_frz:
        sections.append(("x frz", vs_frz))
    sections.append(("compile s", comp_cols))
    left = f"{'model':<14}{'dtype':<8}{'shape':<8}{'bs':>3}"
    h1 = " " * len(left) + "".join(" | " + f"{t:<{W * len(c)}}" for t, c in sections)
    h2 = left + "".join(" | " + "".join(f"{v:>{W}}" for v in c) for _, c in sections) + " | flags"
    print("median ms per call; x eager = eager / variant, x frz = frz / variant (>1: variant "
          "faster), all measured in the same run; compile s = first call - median call")
    print(h1)
    print(h2)
    print("-" * len(h2))
    cols = {("x", v): [] for v in x_cols}
    cols.update({("f", v): [] for v in vs_frz})
    ctime = {v: [] for v in comp_cols}
    cratio = {"ind": [], "frz": []}
    for r in results:
        lat = r["lat"]
        e, f = lat.get("eager"), lat.get("frz")
        line = f"{r['model']:<14}{r['dtype']:<8}{r['shape']:<8}{r['batch']:>3} |"
        line += "".join(fmt_ms(lat.get(v)) for v in lat_cols) + " |"
        for v in x_cols:
            sp = e / lat[v] if e and lat.get(v) else None
            line += fmt_x(sp)
            if sp:
                cols[("x", v)].append(sp)
        if vs_frz:
            line += " |"
            for v in vs_frz:
                sp = f / lat[v] if f and lat.get(v) else None
                line += fmt_x(sp)
                if sp:
                    cols[("f", v)].append(sp)
        line += " |"
        for v in comp_cols:
            t = r["compile"].get(v)
            line += fmt_s(t)
            if t:
                ctime[v].append(t)
        cp = r["compile"].get("cpl") or r["compile"].get("cplcpp")
        for k in cratio:
            if cp and r["compile"].get(k):
                cratio[k].append(cp / r["compile"][k])
        status = [f"{k}:{s}" for k, s in r["status"].items() if s == "not_supported"]
        line += " | " + (",".join(r["flags"] + status) or "ok")
        print(line)
    print("-" * len(h2))
    g = f"{'geomean':<{len(left)}} |" + " " * (W * len(lat_cols)) + " |"
    g += "".join(fmt_x(B.geomean(cols[("x", v)])) for v in x_cols)
    if vs_frz:
        g += " |" + "".join(fmt_x(B.geomean(cols[("f", v)])) for v in vs_frz)
    g += " |" + "".join(fmt_s(B.geomean(ctime[v]) if ctime[v] else None) for v in comp_cols)
    print(g)
    for ours, theirs in PAIRS:
        rs = [r["lat"][theirs] / r["lat"][ours] for r in results
              if r["lat"].get(ours) and r["lat"].get(theirs)]
        if rs:
            print(f"{ours} vs {theirs} (same kind of wrapper): geomean {B.geomean(rs):.2f}x "
                  f"(min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} configs; >1: {ours} faster)")
    for k, lst in cratio.items():
        if lst:
            print(f"compile time cpl / {k}: geomean {B.geomean(lst):.3f} "
                  f"(min {min(lst):.3f}, max {max(lst):.3f}, {len(lst)} configs)")
    reasons = [f"{r['model']} {r['dtype']} {r['shape']}: {m}" for r in results for m in r["reasons"]]
    if reasons:
        print("\nnotes / failures (one line each):")
        for m in reasons:
            print("  " + m)


def write_csv(path, results, variants):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["model", "dtype", "shape", "batch_size", "variant", "status", "latency_ms",
                    "speedup_vs_eager", "speedup_vs_frz", "compile_s", "flags"])
        for r in results:
            e, fz = r["lat"].get("eager"), r["lat"].get("frz")
            for v in variants:
                t = r["lat"].get(v)
                flags = ";".join(fl for fl in r["flags"] if fl.startswith(v + ":"))
                w.writerow([r["model"], r["dtype"], r["shape"], r["batch"], v,
                            r["status"].get(v, "skipped"),
                            f"{t * 1e3:.6f}" if t else "",
                            f"{e / t:.6f}" if e and t else "",
                            f"{fz / t:.6f}" if fz and t else "",
                            f"{r['compile'][v]:.6f}" if v in r["compile"] else "", flags])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help="comma-separated built-in models, or all")
    ap.add_argument("--dtypes", default="float32,amp", help="float32,amp[,bfloat16]")
    ap.add_argument("--shapes", default="static,dynamic", help="static,dynamic")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--iters", type=int, default=40, help="timed calls per variant [40]")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds [5]")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (12 calls, 3 rounds)")
    ap.add_argument("--backends", default=",".join(VARIANTS),
                    help=f"subset of {','.join(VARIANTS)} (eager is always run)")
    ap.add_argument("--cold", action="store_true",
                    help="fresh, empty Inductor and cpu_layout on-disk caches (cold compile times; "
                         "default: whatever caches exist, usually warm after a first run)")
    ap.add_argument("--csv", help="write one row per model/dtype/shape/variant here")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.rounds, args.warmup = 12, 3, 2
    names = list(models.MODELS) if args.models == "all" else args.models.split(",")
    for n in names:
        if n not in models.MODELS:
            ap.error(f"unknown model {n!r}; built-in: {', '.join(models.MODELS)}")
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in B.DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {', '.join(B.DTYPES)}")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in ("static", "dynamic"):
            ap.error(f"unknown shape {s!r}; choose from static, dynamic")
    variants = ["eager"] + [v for v in args.backends.split(",") if v != "eager"]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown backend variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
          f"{args.iters} timed calls per variant in {args.rounds} interleaved rounds; "
          f"compile caches: {'fresh (cold)' if args.cold else 'as found on disk (may be warm)'}")
    t_start = time.perf_counter()
    results = []
    configs = [(n, d, s) for n in names for d in dtypes for s in shapes]
    for i, (n, d, s) in enumerate(configs, 1):
        t0 = time.perf_counter()
        results.append(run_config(n, d, s, variants, args))
        log(f"[{i}/{len(configs)}] {n} {d} {s}: {time.perf_counter() - t0:.1f}s "
            f"(total {time.perf_counter() - t_start:.0f}s)")
    torch._dynamo.reset()
    print()
    print_table(results, variants)
    print(f"\nwall time {time.perf_counter() - t_start:.0f}s, load average {os.getloadavg()[0]:.2f} at end")
    if args.csv:
        write_csv(args.csv, results, variants)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
