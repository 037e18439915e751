#!/usr/bin/env python3
"""cpu_layout against eager, Inductor and OpenVINO on a model suite, one table.

Suites: builtin (cpu_layout.models, small inputs), torchvision and timm (cpu_layout.zoo,
random weights, nothing downloads; inputs --batch (1) x 3 x --size x --size (224)),
huggingface (zoo.HF_MODELS: transformers models built from their configs, random
weights; inputs token ids and an attention mask of --batch x --seq (128), every other
row's last quarter padded, plus decoder ids for T5 and BART; the model's first output
is compared: logits, or the encoder's last hidden state).
For every model x dtype (float32, amp; bfloat16, int8 on request) x shape (static,
dynamic = batch dim only): median latency of
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
  cplcpp32   (int8 rows only) cpu_layout, C++ wrapper, on the unquantized fp32 model
timed in interleaved rounds in the same process (so machine noise hits all alike),
speedups vs eager, vs frz and (cpl, cplcpp) vs ov, compile time (first call minus a
median call) of each compiled backend, and a check of every compiled output against
eager: values with PyTorch's benchmark tolerances (cpu_layout.benchmark.TOLERANCE) and
output strides (size-1 dims ignored; not for ov, which returns numpy arrays). Geomeans
at the bottom.

INT8 (--dtypes int8; static shapes only): each model is quantized once with PyTorch's
PT2E flow, cpu_layout.zoo.quantize_pt2e: its batch-norm statistics re-estimated on 8
calibration batches (zoo.calibration_batches: random, shaped like the input, seeded 0;
torchvision's random init leaves them at (0, 1) and mobilenet/efficientnet activations
then shrink to ~1e-10, which int8 rounds to 0), torch.export.export(..., strict=True)
(torch 2.13's default non-strict export makes X86InductorQuantizer fail on ResNets:
"Input partition has more than one output node"), torchao's X86InductorQuantizer
(default static config), prepare_pt2e, calibration on the same batches, convert_pt2e.
The graph keeps export's guard on the batch size, so it is quantized at --batch. In an
int8 row every variant but ov and cplcpp32 times that one quantized graph module:
  eager      the quantized graph run as is (q/dq as ATen ops around fp32 convs)
  eager_cl   the same, module and input channels_last
  ind, frz, frzpy   Inductor on it (with freezing, frz and frzpy, Inductor's int8
             patterns become onednn.qconv_pointwise / qlinear_pointwise; without, ind,
             its q/dq become generated code around fp32 convs)
  cpl, cplcpp       torch.compile(quantized graph, backend="cpu_layout")
  cplexp     compile_exported(torch.export.export(quantized graph, (x,)))
  ov         OpenVINO INT8 as its users make it: ov.convert_model of the fp32 model,
             nncf.quantize(ov_model, nncf.Dataset(the same calibration batches as
             numpy)) with NNCF's defaults, ov.compile_model (INFERENCE_PRECISION_HINT
             f32 for what stays unquantized; benchmark.OpenVINOInt8Compiled; needs nncf)
  cplcpp32   our fp32 (C++ wrapper) on the unquantized model, batch-norm statistics
             re-estimated as for quantization (the same function)
(ovdyn is not measured for int8.) "x eager" is then against the eager quantized graph,
"x ov" against OpenVINO INT8, "x frz" against Inductor's int8, "x cplcpp32" against our
own fp32; the lines under the table give cpl/cplcpp/cplexp vs ov, vs frz and vs
cplcpp32 over the int8 rows. Values (benchmark.int8_check) are checked against the eager
quantized graph, not with PyTorch's float tolerances: relative RMS error against the
fp32 model's output at most 1.1x the eager quantized graph's, top-1 agreement with it
on at least 99% of rows, and that error at least half the eager graph's (else an fp32
model was measured: flag not_int8, as for a timed module without q/dq nodes, or an
OpenVINO model with no int8 convolution). ov is held to the same RMS bound and to
top-1 agreement with fp32 no lower than the eager quantized graph's; a miss is flagged
ov:values (NNCF's defaults and PT2E quantize differently). The notes give every
variant's error. cplcpp32 is checked as an fp32 variant against the fp32 model.

Each configuration starts from torch._dynamo.reset(); each compiled backend has its
own counting backend and the script checks that the timed calls ran the code that
backend compiled (and, for frz, that Inductor's freeze() really ran).

    python scripts/bench_models.py [--suite builtin|torchvision|timm|huggingface] [--models a,b]
                                   [--batch N] [--size N] [--seq N] [--dtypes float32,amp,int8]
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
    # int8 rows only: this project's fp32 cpu_layout (C++ wrapper) on the unquantized model
    "cplcpp32": ("cpu_layout", False, "cpp"),
}
COMPILED = ("ind", "frz", "frzpy", "cpl", "cplcpp", "cplexp", "ov", "ovdyn", "cplcpp32")
OURS = ("cpl", "cplcpp", "cplexp")
PINNED = OURS + ("cplcpp32",)  # variants that run on our backend (pinned OpenMP workers)
# Comparisons printed under the table: (ours, theirs, what kind of comparison).
PAIRS = (("cpl", "frzpy", "same kind of wrapper"), ("cplcpp", "frz", "same kind of wrapper"),
         ("cpl", "ov", "OpenVINO"), ("cplcpp", "ov", "OpenVINO"), ("cplexp", "ov", "OpenVINO"),
         ("cplcpp", "ovdyn", "OpenVINO, both through torch.compile's frame"),
         ("ovdyn", "ov", "torch.compile's per-call share, on OpenVINO's compute"))
# The same for int8 rows (ov there is OpenVINO INT8, frz Inductor's int8 on the same
# quantized graph, cplcpp32 our own fp32 on the unquantized model).
INT8_PAIRS = (("cpl", "ov", "OpenVINO INT8 (NNCF)"), ("cplcpp", "ov", "OpenVINO INT8 (NNCF)"),
              ("cplexp", "ov", "OpenVINO INT8 (NNCF)"),
              ("cpl", "frz", "Inductor int8, freezing + C++ wrapper"),
              ("cplcpp", "frz", "Inductor int8, freezing + C++ wrapper"),
              ("cplexp", "frz", "Inductor int8, freezing + C++ wrapper"),
              ("cpl", "cplcpp32", "our own fp32, unquantized model"),
              ("cplcpp", "cplcpp32", "our own fp32, unquantized model"),
              ("cplexp", "cplcpp32", "our own fp32, unquantized model"))
INT8 = "int8"
# --models all for the real suites: common classification CNNs.
SUITE_ALL = {
    "torchvision": ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_b0",
                    "convnext_tiny", "shufflenet_v2_x1_0", "densenet121", "googlenet",
                    "regnet_y_800mf", "mnasnet1_0", "squeezenet1_1"),
    "timm": ("resnet50", "mobilenetv3_large_100", "efficientnet_b0", "convnext_tiny",
             "regnety_008", "resnest50d", "densenet121"),
    "huggingface": tuple(zoo.HF_MODELS),
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
    """(model, batch size -> example input, batch size) for one model of args.suite
    (huggingface: the input is (token ids, attention mask[, decoder ids]))."""
    if args.suite == "huggingface":
        return (zoo.build_hf(name), lambda bs: zoo.model_and_input(args.suite, name, bs, args.seq)[1],
                args.batch or 1)
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
    int8 = dtype == INT8
    run_dtype = "float32" if int8 else dtype  # the quantized graph takes fp32 input
    if int8:
        # PT2E once per model: the quantized graph every int8 torch variant times; the fp32
        # model (its batch-norm statistics re-estimated on the same batches) for cplcpp32,
        # OpenVINO INT8 and the fp32 reference.
        calib = zoo.calibration_batches(x)
        t0 = time.perf_counter()
        try:
            qmodel = zoo.quantize_pt2e(model, x, calib)
        except Exception as exc:  # noqa: BLE001
            res["status"]["eager"] = "fail_to_run"
            res["flags"].append("quantize:fail")
            res["reasons"].append("quantize_pt2e: " + B.one_line(name, exc))
            return res
        res["quantize_s"] = time.perf_counter() - t0
        res["qnodes"] = B.quantize_nodes(qmodel)
        with torch.no_grad():
            fp32_out = model(x)
        res["int8"] = {}
    fns = {}
    ref = None
    for label in variants:
        backend, cl, wrapper = VARIANTS[label]
        if label == "cplcpp32" and not int8:
            continue  # int8 rows only (in fp32 rows it is cplcpp)
        if int8 and label == "ovdyn":
            res["status"][label] = "not_supported"
            res["reasons"].append(f"{label}: OpenVINO INT8 through a Dynamo backend is not measured "
                                  f"(ov is OpenVINO INT8 called directly)")
            continue
        try:
            if int8 and label == "ov":
                c = B.compile_openvino_int8(model, calib)
            else:
                src = qmodel if int8 and label != "cplcpp32" else model
                c = B.compile_model(src, backend, run_dtype,
                                    dynamic if backend != "eager" else False,
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
            if int8:
                res["int8"][label] = B.int8_check(out, out, fp32_out)[2]
                if B.quantize_nodes(c.model) == 0 or res["int8"][label]["rms"] == 0:
                    res["flags"].append(f"{label}:not_int8")
                    res["reasons"].append(f"{label}: {name}, the timed module is not a quantized "
                                          f"graph (its output is the fp32 model's)")
        elif ref is not None and int8 and label != "cplcpp32":
            # int8: against the quantized graph run eagerly (rel. RMS error vs fp32, top-1)
            ok, why, nums = B.int8_check(out, ref, fp32_out, against="fp32" if label == "ov" else "eager_q")
            res["int8"][label] = nums
            if not ok:
                res["flags"].append(f"{label}:values")
                res["reasons"].append(f"{label}: {name}, int8 AccuracyError: {why}")
            if label == "ov" and c.int8_layers == 0:
                res["flags"].append(f"{label}:not_int8")
                res["reasons"].append(f"{label}: {name}, no convolution of OpenVINO's compiled model "
                                      f"runs in int8")
            elif label != "ov" and B.quantize_nodes(c.model) == 0:
                res["flags"].append(f"{label}:not_int8")
                res["reasons"].append(f"{label}: {name}, the timed module is not the quantized graph")
            if label not in ("eager_cl", "ov") and not B.strides_match(ref, out):
                res["flags"].append(f"{label}:strides")
                res["reasons"].append(f"{label}: {name}, strides differ: {B.stride_report(ref, out)}")
        elif ref is not None:
            want = fp32_out if label == "cplcpp32" else ref
            if label in ("ov", "ovdyn") and isinstance(want, torch.Tensor):
                out = out.to(want.dtype)  # OpenVINO returns fp32; eager's amp/bf16 output is bf16
            if not B.values_match(want, out, res.get("fp64"), run_dtype):
                res["flags"].append(f"{label}:values")
                res["reasons"].append(f"{label}: {name}, AccuracyError: "
                                      f"{B.describe_error(want, out, res.get('fp64'), run_dtype)}")
            if label not in ("eager_cl", "ov", "ovdyn") and not B.strides_match(want, out):
                res["flags"].append(f"{label}:strides")
                res["reasons"].append(f"{label}: {name}, strides differ: {B.stride_report(want, out)}")
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

    before = {k: threads.pin_workers if k in PINNED else threads.unpin_workers for k in fns}
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
             ("ov", [v for v in OURS if v in variants]),
             ("cplcpp32", [v for v in ("eager",) + OURS if v in variants])]
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
    float_rows = [r for r in results if r["dtype"] != INT8]
    int8_rows = [r for r in results if r["dtype"] == INT8]
    for rows, pairs, prefix in ((float_rows, PAIRS, ""), (int8_rows, INT8_PAIRS, "int8: ")):
        for ours, theirs, kind in pairs:
            rs = [r["lat"][theirs] / r["lat"][ours] for r in rows
                  if r["lat"].get(ours) and r["lat"].get(theirs)]
            if rs:
                print(f"{prefix}{ours} vs {theirs} ({kind}): geomean {B.geomean(rs):.2f}x "
                      f"(min {min(rs):.2f}, max {max(rs):.2f}, {len(rs)} configs; >1: {ours} faster)")
    for k, lst in cratio.items():
        if lst:
            print(f"compile time cpl / {k}: geomean {B.geomean(lst):.3f} "
                  f"(min {min(lst):.3f}, max {max(lst):.3f}, {len(lst)} configs)")
    notes = [f"{r['model']} {r['dtype']} {r['shape']}: {m}" for r in results for m in r["reasons"]]
    if "ov" in variants and float_rows:
        notes.insert(0, f"ov: values checked only (OpenVINO returns numpy arrays, no strides), "
                        f"cast to eager's dtype; fp32 input and weights, INFERENCE_PRECISION_HINT "
                        f"bf16 for amp/bfloat16, INFERENCE_NUM_THREADS {torch.get_num_threads()}")
    if int8_rows:
        notes.insert(0, "int8 rows: every variant but ov and cplcpp32 times the same PT2E graph "
                        "(zoo.quantize_pt2e: export strict=True, X86InductorQuantizer, "
                        f"{zoo.CALIBRATION_BATCHES} seeded random calibration batches); eager = that "
                        "graph run as is; ov = OpenVINO INT8 (nncf.quantize of the fp32 model on the "
                        "same batches, INFERENCE_PRECISION_HINT f32); cplcpp32 = our fp32 on the "
                        "unquantized model. Values: rel. RMS error vs the fp32 model at most "
                        f"{B.INT8_RMS_FACTOR}x eager's, top-1 agreement with eager >= {B.INT8_TOP1} "
                        "(ov: with fp32, no lower than eager's)")
        for r in int8_rows:
            acc = r.get("int8") or {}
            if not acc:
                continue
            rms = ", ".join(f"{k} {v['rms']:.4f}" for k, v in acc.items())
            top = ", ".join(f"{k} {v['top1']:.2f}" for k, v in acc.items()
                            if k not in ("eager", "ov") and v.get("top1") is not None)
            top32 = ", ".join(f"{k} {v['top1_fp32']:.2f}" for k, v in acc.items()
                              if v.get("top1_fp32") is not None)
            notes.append(f"{r['model']} int8 {r['shape']}: rel. RMS error vs fp32: {rms}; top-1 "
                         f"agreement with eager: {top or '-'}; with fp32: {top32 or '-'}; "
                         f"{r.get('qnodes', 0)} q/dq nodes, quantized in {r.get('quantize_s', 0):.1f}s")
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
    ap.add_argument("--suite", default="builtin", choices=("builtin", "torchvision", "timm", "huggingface"),
                    help="model set [builtin]")
    ap.add_argument("--models", default="all",
                    help="comma-separated names in the suite, or all (builtin: every built-in "
                         "model; " + "; ".join(
                             f"{k}: {', '.join(v)}" for k, v in SUITE_ALL.items()) + ")")
    ap.add_argument("--batch", type=int, default=0,
                    help="batch size (default: 1 for torchvision/timm, the model's own for builtin)")
    ap.add_argument("--size", type=int, default=None,
                    help="torchvision/timm: input height = width [224]; 0: the model's usual size")
    ap.add_argument("--seq", type=int, default=128,
                    help="huggingface: sequence length [128] (every other row's last quarter padded)")
    ap.add_argument("--dtypes", default="float32,amp",
                    help="float32,amp[,bfloat16][,int8] (int8: PT2E-quantized, static shapes)")
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
    elif args.suite == "huggingface":
        if zoo.import_transformers() is None:
            ap.error("the huggingface suite needs transformers (pip install transformers)")
        names = list(SUITE_ALL[args.suite]) if args.models == "all" else args.models.split(",")
        for n in names:
            if n not in zoo.HF_MODELS:
                ap.error(f"unknown huggingface model {n!r}; choose from {', '.join(zoo.HF_MODELS)}")
        if INT8 in args.dtypes.split(","):
            ap.error("int8: the huggingface suite is not quantized yet (CNN suites only)")
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
        if d not in B.DTYPES + (INT8,):
            ap.error(f"unknown dtype {d!r}; choose from {', '.join(B.DTYPES + (INT8,))}")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in ("static", "dynamic"):
            ap.error(f"unknown shape {s!r}; choose from static, dynamic")
    variants = ["eager"] + [v for v in args.backends.split(",") if v != "eager"]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown backend variant {v!r}; choose from {', '.join(VARIANTS)}")
    if INT8 not in dtypes:  # cplcpp32 is the fp32 column of int8 rows
        variants = [v for v in variants if v != "cplcpp32"]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    inputs = (f"batch {args.batch or 'per model'}" if args.suite == "builtin"
              else f"batch {args.batch or 1}, sequence {args.seq}" if args.suite == "huggingface"
              else f"batch {args.batch or 1}, {args.size or 'usual'} px")
    print(f"suite {args.suite} ({inputs}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
          f"{args.iters} timed calls per variant in {args.rounds} interleaved rounds; "
          f"compile caches: {'fresh (cold)' if args.cold else 'as found on disk (may be warm)'}"
          f"{'; Dynamo guards skipped while timing (--skip-guards)' if args.skip_guards else ''}"
          f"{'; no guards on torch.nn modules (--guard-filter)' if args.guard_filter else ''}")
    t_start = time.perf_counter()
    results = []
    configs = [(n, d, s) for n in names for d in dtypes for s in shapes
               if not (d == INT8 and s == "dynamic")]
    if INT8 in dtypes and "dynamic" in shapes:
        log("int8: static shapes only (the PT2E graph keeps export's guard on the batch size); "
            "no int8 dynamic rows")
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
