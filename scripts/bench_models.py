#!/usr/bin/env python3
"""cpu_layout against eager, Inductor and OpenVINO on a model suite, one table.

Suites: builtin (cpu_layout.models, small inputs), torchvision and timm (cpu_layout.zoo,
random weights, nothing downloads; inputs --batch (1) x 3 x --size x --size (224)).
For every model x dtype (float32, amp) x shape (static, dynamic = batch dim only):
median latency of
  eager      the model as is
  eager_cl   eager, model and input in channels_last
  ind        Inductor, default configuration
  frz        Inductor with freezing + cpp_wrapper (its best CPU configuration)
  frzpy      Inductor with freezing, default (Python) wrapper
  cpl        cpu_layout, default (Python) wrapper
  cplcpp     cpu_layout, C++ wrapper (options={"cpp_wrapper": True})
  cplexp     cpu_layout.compile_exported(torch.export.export(model, (x,))), C++ wrapper:
             no Dynamo per call (static shapes only)
  ov         OpenVINO's CPU plugin (ov.convert_model + ov.compile_model; fp32 input,
             INFERENCE_PRECISION_HINT bf16 for amp, bfloat16; benchmark.OpenVINOCompiled)
  ovdyn      the same OpenVINO model run by a Dynamo backend under torch.compile: what
             OpenVINO would measure through torch.compile's per-call share (guards,
             parameters gathered as inputs), the peer of cpl and cplcpp
timed in interleaved rounds in the same process (so machine noise hits all alike),
speedups vs eager, vs frz and (cpl, cplcpp) vs ov, compile time (first call minus a
median call) of each compiled backend, and a check of every compiled output against
eager: values with PyTorch's benchmark tolerances (cpu_layout.benchmark.TOLERANCE) and
output strides (size-1 dims ignored; not for ov, which returns numpy arrays). Geomeans
at the bottom.

Each configuration starts from torch._dynamo.reset(); each compiled backend has its
own counting backend and the script checks that the timed calls ran the code that
backend compiled (and, for frz, that Inductor's freeze() really ran).

    python scripts/bench_models.py [--suite builtin|torchvision|timm] [--models a,b]
                                   [--batch N] [--size N] [--dtypes float32,amp]
                                   [--shapes static,dynamic] [--backends eager,cplcpp,ov]
                                   [--threads N] [--iters N] [--quick] [--csv PATH]
                                   [--skip-guards] [--guard-filter]

--skip-guards times every torch.compile'd variant under
torch.compiler.set_stance(skip_guard_eval_unsafe=True): Dynamo then checks only the
guards that tell its cached graphs apart, the setting for serving one model with
fixed input shapes (unsafe otherwise: it may run a graph compiled for other inputs).
At batch 1 Dynamo's guards are a sizeable part of a small model's per-call time.
--guard-filter compiles every torch.compile'd variant (Inductor's too) with
options={"guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}:
Dynamo keeps the guards on the inputs and drops those on torch.nn's own modules
(their attributes and submodules; changing them, model.train() included, then
goes unnoticed), a per-model choice that saves as much as --skip-guards.

Inductor compile times dominate the run time (seconds to tens of seconds per graph on
two cores, less once its on-disk caches are warm); --backends drops some.
"""
from __future__ import annotations

import argparse
import contextlib
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
from cpu_layout import models, zoo  # noqa: E402

# label -> (backend, channels_last, wrapper)
VARIANTS = {
    "eager": ("eager", False, "default"),
    "eager_cl": ("eager", True, "default"),
    "ind": ("inductor", False, "default"),
    "frz": ("inductor_freezing", False, "cpp"),
    "frzpy": ("inductor_freezing", False, "default"),
    "cpl": ("cpu_layout", False, "default"),
    "cplcpp": ("cpu_layout", False, "cpp"),
    "cplexp": ("cpu_layout_export", False, "cpp"),
    # OpenVINO called directly, not through torch.compile(backend="openvino"), which fails
    # on torch 2.13 (see cpu_layout.benchmark.OpenVINOCompiled)
    "ov": ("openvino", False, "default"),
    "ovdyn": ("openvino_dynamo", False, "default"),
}
COMPILED = ("ind", "frz", "frzpy", "cpl", "cplcpp", "cplexp", "ov", "ovdyn")
OURS = ("cpl", "cplcpp", "cplexp")
# Comparisons printed under the table: (ours, theirs, what kind of comparison).
PAIRS = (("cpl", "frzpy", "same kind of wrapper"), ("cplcpp", "frz", "same kind of wrapper"),
         ("cpl", "ov", "OpenVINO"), ("cplcpp", "ov", "OpenVINO"), ("cplexp", "ov", "OpenVINO"),
         ("cplcpp", "ovdyn", "OpenVINO, both through torch.compile's frame"),
         ("ovdyn", "ov", "torch.compile's per-call share, on OpenVINO's compute"))
# --models all for the real suites: common classification CNNs.
SUITE_ALL = {
    "torchvision": ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_b0",
                    "convnext_tiny", "shufflenet_v2_x1_0", "densenet121", "googlenet",
                    "regnet_y_800mf", "mnasnet1_0", "squeezenet1_1"),
    "timm": ("resnet50", "mobilenetv3_large_100", "efficientnet_b0", "convnext_tiny",
             "regnety_008", "resnest50d", "densenet121"),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


W = 9  # column width


def fmt_ms(v):
    return f"{v * 1e3:{W}.3f}" if v else f"{'-':>{W}}"


def fmt_x(v):
    return f"{v:{W}.2f}" if v and math.isfinite(v) else f"{'-':>{W}}"


def fmt_s(v):
    return f"{v:{W}.1f}" if v is not None else f"{'-':>{W}}"


def build(args, name):
    """(model, batch size -> example input, batch size) for one model of args.suite."""
    if args.suite == "builtin":
        return (models.build(name)[0], lambda bs: models.build(name, batch_size=bs)[1],
                args.batch or models.MODELS[name][1][0])
    model = zoo.build(args.suite, name)
    shape = zoo.default_input_shape(args.suite, name, model, args.size)
    return model, lambda bs: zoo.example_input((bs,) + shape), args.batch or 1


def run_config(name, dtype, shape, variants, args):
    """One model x dtype x shape: compile all variants, check, time. Returns a result dict."""
    dynamic = shape == "dynamic"
    model, make_input, batch = build(args, name)
    x = make_input(batch)
    torch._dynamo.reset()
    res = {"model": name, "dtype": dtype, "shape": shape, "batch": batch,
           "lat": {}, "compile": {}, "status": {}, "flags": [], "reasons": []}
    fns = {}
    ref = None
    for label in variants:
        backend, cl, wrapper = VARIANTS[label]
        try:
            c = B.compile_model(model, backend, dtype, dynamic if backend != "eager" else False,
                                wrapper, cl, reset=False,
                                guard_filter_fn=(torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe
                                                 if args.guard_filter else None))
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
            if label in ("ov", "ovdyn") and isinstance(ref, torch.Tensor):
                out = out.to(ref.dtype)  # OpenVINO returns fp32; eager's amp/bf16 output is bf16
            if not B.values_match(ref, out, res.get("fp64"), dtype):
                res["flags"].append(f"{label}:values")
                res["reasons"].append(f"{label}: {name}, AccuracyError: "
                                      f"{B.describe_error(ref, out, res.get('fp64'), dtype)}")
            if label not in ("eager_cl", "ov", "ovdyn") and not B.strides_match(ref, out):
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
    stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if args.skip_guards
              else contextlib.nullcontext())
    # Our backend pins the OpenMP workers of the thread that compiles (threads.pin_workers);
    # eager and Inductor share those workers, so they run unpinned, as in a process of their own.
    from cpu_layout import threads

    before = {k: threads.pin_workers if k in OURS else threads.unpin_workers for k in fns}
    with stance:
        lat = B.interleaved_medians(fns, rounds=rounds, iters=per, warmup=args.warmup, before=before)
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
        x2 = make_input(batch + 1)
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
                why = ("Dynamo specialises batch 1" if batch == 1
                       else "the batch dimension was not dynamic")
                res["reasons"].append(f"{label}: {name}, batch {batch + 1} recompiled ({why})")
    res.pop("fp64", None)
    return res


def print_table(results, variants):
    lat_cols = list(variants)
    # speedup sections: (reference variant, variants compared with it)
    speed = [("eager", [v for v in variants if v != "eager"]),
             ("frz", [v for v in ("ind",) + OURS if v in variants]),
             ("ov", [v for v in OURS if v in variants])]
    speed = [(ref, cols) for ref, cols in speed if ref in variants and cols]
    comp_cols = [v for v in COMPILED if v in variants]
    sections = ([("latency ms", lat_cols)] + [(f"x {ref}", cols) for ref, cols in speed]
                + [("compile s", comp_cols)])
    mw = max([14] + [len(r["model"]) + 2 for r in results])
    left = f"{'model':<{mw}}{'dtype':<8}{'shape':<8}{'bs':>3}"
    h1 = " " * len(left) + "".join(" | " + f"{t:<{W * len(c)}}" for t, c in sections)
    h2 = left + "".join(" | " + "".join(f"{v:>{W}}" for v in c) for _, c in sections) + " | flags"
    print("median ms per call; x R = R's latency / variant's (>1: variant faster than R), all "
          "measured in the same run; compile s = first call - median call")
    print(h1)
    print(h2)
    print("-" * len(h2))
    sp = {(ref, v): [] for ref, cols in speed for v in cols}
    ctime = {v: [] for v in comp_cols}
    cratio = {"ind": [], "frz": [], "ov": []}
    for r in results:
        lat = r["lat"]
        line = f"{r['model']:<{mw}}{r['dtype']:<8}{r['shape']:<8}{r['batch']:>3} |"
        line += "".join(fmt_ms(lat.get(v)) for v in lat_cols)
        for ref, cols in speed:
            line += " |"
            for v in cols:
                x = lat[ref] / lat[v] if lat.get(ref) and lat.get(v) else None
                line += fmt_x(x)
                if x:
                    sp[(ref, v)].append(x)
        line += " |"
        for v in comp_cols:
            t = r["compile"].get(v)
            line += fmt_s(t)
            if t:
                ctime[v].append(t)
        cp = r["compile"].get("cpl") or r["compile"].get("cplcpp") or r["compile"].get("cplexp")
        for k in cratio:
            if cp and r["compile"].get(k):
                cratio[k].append(cp / r["compile"][k])
        status = [f"{k}:{s}" for k, s in r["status"].items() if s == "not_supported"]
        line += " | " + (",".join(r["flags"] + status) or "ok")
        print(line)
    print("-" * len(h2))
    g = f"{'geomean':<{len(left)}} |" + " " * (W * len(lat_cols))
    for ref, cols in speed:
        g += " |" + "".join(fmt_x(B.geomean(sp[(ref, v)])) for v in cols)
    g += " |" + "".join(fmt_s(B.geomean(ctime[v]) if ctime[v] else None) for v in comp_cols)
    print(g)
    for ours, theirs, kind in PAIRS:
        rs = [r["lat"][theirs] / r["lat"][ours] for r in results
              if r["lat"].get(ours) and r["lat"].get(theirs)]
        if rs:
            print(f"{ours} vs {theirs} ({kind}): geomean {B.geomean(rs):.2f}x "
                  f"(min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} configs; >1: {ours} faster)")
    for k, lst in cratio.items():
        if lst:
            print(f"compile time cpl / {k}: geomean {B.geomean(lst):.3f} "
                  f"(min {min(lst):.3f}, max {max(lst):.3f}, {len(lst)} configs)")
    notes = [f"{r['model']} {r['dtype']} {r['shape']}: {m}" for r in results for m in r["reasons"]]
    if "ov" in variants:
        notes.insert(0, f"ov: values checked only (OpenVINO returns numpy arrays, no strides), "
                        f"cast to eager's dtype; fp32 input and weights, INFERENCE_PRECISION_HINT "
                        f"bf16 for amp/bfloat16, INFERENCE_NUM_THREADS {torch.get_num_threads()}")
    if notes:
        print("\nnotes / failures (one line each):")
        for m in notes:
            print("  " + m)


def write_csv(path, results, variants, suite):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["suite", "model", "dtype", "shape", "batch_size", "variant", "status",
                    "latency_ms", "speedup_vs_eager", "speedup_vs_frz", "speedup_vs_ov",
                    "compile_s", "flags"])
        for r in results:
            refs = [r["lat"].get(k) for k in ("eager", "frz", "ov")]
            for v in variants:
                t = r["lat"].get(v)
                flags = ";".join(fl for fl in r["flags"] if fl.startswith(v + ":"))
                w.writerow([suite, r["model"], r["dtype"], r["shape"], r["batch"], v,
                            r["status"].get(v, "skipped"), f"{t * 1e3:.6f}" if t else ""]
                           + [f"{e / t:.6f}" if e and t else "" for e in refs]
                           + [f"{r['compile'][v]:.6f}" if v in r["compile"] else "", flags])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="builtin", choices=("builtin", "torchvision", "timm"),
                    help="model set [builtin]")
    ap.add_argument("--models", default="all",
                    help="comma-separated names in the suite, or all (builtin: every built-in "
                         "model; " + "; ".join(
                             f"{k}: {', '.join(v)}" for k, v in SUITE_ALL.items()) + ")")
    ap.add_argument("--batch", type=int, default=0,
                    help="batch size (default: 1 for torchvision/timm, the model's own for builtin)")
    ap.add_argument("--size", type=int, default=None,
                    help="torchvision/timm: input height = width [224]; 0: the model's usual size")
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
    ap.add_argument("--skip-guards", action="store_true",
                    help="time compiled variants under torch.compiler.set_stance("
                         "skip_guard_eval_unsafe=True) (serving; see above)")
    ap.add_argument("--guard-filter", action="store_true",
                    help="compile with options={'guard_filter_fn': torch.compiler."
                         "skip_guard_on_inbuilt_nn_modules_unsafe} (serving; see above)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.rounds, args.warmup = 12, 3, 2
    if args.suite == "builtin":
        if args.size is not None:
            ap.error("--size is for the torchvision and timm suites")
        names = list(models.MODELS) if args.models == "all" else args.models.split(",")
        for n in names:
            if n not in models.MODELS:
                ap.error(f"unknown model {n!r}; built-in: {', '.join(models.MODELS)}")
    else:
        args.size = 224 if args.size is None else args.size
        names = list(SUITE_ALL[args.suite]) if args.models == "all" else args.models.split(",")
        lib = zoo.import_torchvision() if args.suite == "torchvision" else zoo.import_timm()
        if lib is None:
            ap.error(f"{args.suite} is not installed")
        known = (set(lib.models.list_models()).__contains__ if args.suite == "torchvision"
                 else lib.is_model)
        for n in names:
            if not known(n):
                ap.error(f"unknown {args.suite} model {n!r}")
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
    inputs = (f"batch {args.batch or 1}, {args.size or 'usual'} px" if args.suite != "builtin"
              else f"batch {args.batch or 'per model'}")
    print(f"suite {args.suite} ({inputs}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
          f"{args.iters} timed calls per variant in {args.rounds} interleaved rounds; "
          f"compile caches: {'fresh (cold)' if args.cold else 'as found on disk (may be warm)'}"
          f"{'; Dynamo guards skipped while timing (--skip-guards)' if args.skip_guards else ''}"
          f"{'; no guards on torch.nn modules (--guard-filter)' if args.guard_filter else ''}")
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
        write_csv(args.csv, results, variants, args.suite)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
