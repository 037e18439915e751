#!/usr/bin/env python3
"""cpu_layout's counterpart of PyTorch CPU's inductor_single_run.sh (issue 6).

    bash scripts/single_run.sh [THREAD] [MODE] [SCENARIO] [SUITE] [MODEL] [DT] \\
                               [CHANNELS] [SHAPE] [WRAPPER] [BS] [BACKEND] [options]

Positional arguments (same order, defaults and meanings as inductor_single_run.sh):
  1 THREAD    multiple | single | all            [multiple]
              single: 1 thread pinned to core 0, batch size 1; multiple: all cores of
              socket 0 (pinned with numactl or taskset when present); all: both.
  2 MODE      inference | training               [inference]  (training: not supported yet)
  3 SCENARIO  accuracy | performance             [accuracy]
  4 SUITE     builtin | torchvision | timm_models | huggingface [builtin]
              huggingface: transformers models from their configs (cpu_layout.zoo.HF_MODELS,
              random weights), token ids and an attention mask as input, sequence 128
              at batch 1 (single) and 384 otherwise (batch 8 unless BS says).
  5 MODEL     a model name, or all               [all]
  6 DT        float32 | amp | bfloat16 | int8    [float32]
              int8: the fp32 model quantized with PyTorch's PT2E flow
              (cpu_layout.zoo.quantize_pt2e: batch-norm statistics re-estimated, then
              torch.export strict=True, torchao's X86InductorQuantizer, calibration on 8
              seeded random batches of the run's input shape, convert_pt2e), then run as
              for float32: eager is the quantized graph run as is, BACKEND compiles the
              same graph. Accuracy: rel. RMS error against the fp32 model at most 1.1x
              the eager quantized graph's and top-1 agreement with it (benchmark.int8_check),
              not PyTorch's float tolerances. Static shapes only; needs torchao.
  7 CHANNELS  first | last                       [first]
  8 SHAPE     static | dynamic                   [static]    (dynamic: batch dim only)
  9 WRAPPER   default | cpp                      [default]
 10 BS        integer >= 0                       [0]  (>0 overrides the batch size,
              multi-thread runs only)
 11 BACKEND   cpu_layout | inductor | inductor_freezing | eager [cpu_layout]

--ninstances N (THREAD=multiple) splits socket 0's cores among N instances launched by
PyTorch's own launcher, `python -m torch.backends.xeon.run_cpu --ninstances N`; each
instance prints its own rows (dev column cpu:<instance>), one header in all. The
instances share cpu_layout's on-disk cache, so the C++ is compiled once.

Output on stdout is CSV only; the last line is the last row.
  accuracy:    dev,name,batch_size,accuracy,calls_captured,unique_graphs,graph_breaks
  performance: dev,name,batch_size,speedup,abs_latency,compilation_latency,
               compression_ratio,eager_peak_mem,dynamo_peak_mem
  (abs_latency in ms, compilation_latency in s, peak memory in GB: for the compiled
  model, what it holds between calls (cpu_layout.memory_stats: packed and derived
  weights, arenas, pools, scratch, code; Inductor's frozen constants are not seen,
  counted 0) plus the peak allocated in one call; eager's peak of one call.)
Failure reasons (one line each), skip messages and the progress bar go to stderr.
Exit status: 0 (also when rows report failures or a suite is skipped), 2 for bad
arguments and for configurations that are not supported yet.

This file is the launcher and the worker: the launcher parses and validates the
arguments without importing torch, then runs one pinned worker process per
thread mode (`--worker MODE`).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

THREADS = ("multiple", "single", "all")
MODES = ("inference", "training")
SCENARIOS = ("accuracy", "performance")
SUITES = ("builtin", "torchvision", "timm_models", "huggingface")
DTS = ("float32", "amp", "bfloat16", "int8")
CHANNELS = ("first", "last")
SHAPES = ("static", "dynamic")
WRAPPERS = ("default", "cpp")
BACKENDS = ("cpu_layout", "inductor", "inductor_freezing", "eager")
SUITE_PACKAGE = {"torchvision": "torchvision", "timm_models": "timm", "huggingface": "transformers"}

ACCURACY_HEADER = ["dev", "name", "batch_size", "accuracy", "calls_captured", "unique_graphs",
                   "graph_breaks"]
PERFORMANCE_HEADER = ["dev", "name", "batch_size", "speedup", "abs_latency", "compilation_latency",
                      "compression_ratio", "eager_peak_mem", "dynamo_peak_mem"]
EXIT_USAGE = 2
DEFAULT_PLOT = "single_run_speedup.png"


def _batch_size(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"BS must be an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"BS must be an integer >= 0, got {text!r}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="single_run.sh",
        description="Run built-in (or torchvision / timm) models through a backend and print "
                    "PyTorch-benchmark-style CSV rows.",
        epilog="example: bash scripts/single_run.sh multiple inference performance builtin all "
               "float32 first static default 0 cpu_layout",
    )
    pos = [
        ("thread", THREADS, "multiple"), ("mode", MODES, "inference"),
        ("scenario", SCENARIOS, "accuracy"), ("suite", SUITES, "builtin"),
    ]
    for name, choices, default in pos:
        p.add_argument(name, nargs="?", default=default, choices=choices, metavar=name.upper(),
                       help=f"{' | '.join(choices)} [{default}]")
    p.add_argument("model", nargs="?", default="all", metavar="MODEL", help="a model name or all [all]")
    pos = [("dt", DTS, "float32"), ("channels", CHANNELS, "first"), ("shape", SHAPES, "static"),
           ("wrapper", WRAPPERS, "default")]
    for name, choices, default in pos:
        p.add_argument(name, nargs="?", default=default, choices=choices, metavar=name.upper(),
                       help=f"{' | '.join(choices)} [{default}]")
    p.add_argument("bs", nargs="?", default=0, type=_batch_size, metavar="BS",
                   help="batch size override, >0 for multi-thread runs [0]")
    p.add_argument("backend", nargs="?", default="cpu_layout", choices=BACKENDS, metavar="BACKEND",
                   help=f"{' | '.join(BACKENDS)} [cpu_layout]")
    p.add_argument("--output", metavar="CSV", help="also append the rows to this CSV file")
    p.add_argument("--plot", nargs="?", const=DEFAULT_PLOT, metavar="PNG",
                   help=f"write a bar chart of speedup per model and backend (performance) "
                        f"[{DEFAULT_PLOT}]")
    p.add_argument("--iters", type=_positive, default=int(os.environ.get("SINGLE_RUN_ITERS", 50)),
                   help="timed calls per backend (performance) [50, env SINGLE_RUN_ITERS]")
    p.add_argument("--warmup", type=_nonneg, default=int(os.environ.get("SINGLE_RUN_WARMUP", 5)),
                   help="untimed calls before timing [5, env SINGLE_RUN_WARMUP]")
    p.add_argument("--no-pin", action="store_true", help="do not pin worker processes to cores")
    p.add_argument("--ninstances", type=_positive, default=1,
                   help="THREAD=multiple: split the cores among N instances launched by "
                        "python -m torch.backends.xeon.run_cpu; each prints its own rows, whose "
                        "dev column is cpu:<instance> [1]")
    p.add_argument("--worker", choices=("single", "multiple"), help=argparse.SUPPRESS)
    p.add_argument("--rows-file", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None, check_model: bool = True):
    """Parse and validate; bad arguments print the usage and exit 2 (argparse)."""
    p = build_parser()
    args = p.parse_intermixed_args(argv)
    if check_model:
        check_model_name(p, args)
    return args


def check_model_name(p: argparse.ArgumentParser, args) -> None:
    if args.suite == "huggingface" and args.model != "all":
        from cpu_layout.zoo import HF_MODELS  # imports torch; only needed to check a model name

        if args.model not in HF_MODELS:
            p.error(f"argument MODEL: unknown huggingface model {args.model!r} "
                    f"(choose from all, {', '.join(HF_MODELS)})")
    if args.suite == "builtin" and args.model != "all":
        names = builtin_model_names()
        if args.model not in names:
            p.error(f"argument MODEL: unknown built-in model {args.model!r} "
                    f"(choose from all, {', '.join(names)})")


def builtin_model_names():
    from cpu_layout import models  # imports torch; only needed to check a model name

    return list(models.MODELS)


# ---------------------------------------------------------------- cores, pinning
def socket0_cores():
    """Logical CPUs of socket 0, one per physical core (sysfs, else lscpu, else affinity)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    seen, cores = set(), []
    base = "/sys/devices/system/cpu"
    try:
        for cpu in allowed or range(os.cpu_count() or 1):
            topo = f"{base}/cpu{cpu}/topology"
            with open(f"{topo}/physical_package_id") as f:
                pkg = int(f.read())
            with open(f"{topo}/core_id") as f:
                core = int(f.read())
            if pkg == 0 and (pkg, core) not in seen:
                seen.add((pkg, core))
                cores.append(cpu)
    except (OSError, ValueError):
        cores = []
    if not cores and shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True,
                                 check=True).stdout
            for line in out.splitlines():
                if line.startswith("#"):
                    continue
                cpu, core, sock = (int(v or 0) for v in line.split(","))
                if sock == 0 and (sock, core) not in seen and (not allowed or cpu in allowed):
                    seen.add((sock, core))
                    cores.append(cpu)
        except (OSError, ValueError, subprocess.CalledProcessError):
            cores = []
    return cores or allowed or [0]


def pin_prefix(cores, no_pin: bool = False):
    """Command prefix that pins a process to `cores` (numactl, else taskset, else none)."""
    if no_pin:
        return []
    spec = ",".join(str(c) for c in cores)
    if shutil.which("numactl"):
        return ["numactl", f"--physcpubind={spec}"]
    if shutil.which("taskset"):
        return ["taskset", "-c", spec]
    return []


def worker_plan(thread: str):
    """[(thread mode, cores)] in run order."""
    modes = ["multiple", "single"] if thread == "all" else [thread]
    plan = []
    for m in modes:
        cores = socket0_cores()
        plan.append((m, cores if m == "multiple" else cores[:1]))
    return plan


# ---------------------------------------------------------------- launcher
def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, check_model=False)
    if args.worker:
        return worker_main(args)
    if args.mode == "training":
        _err("single_run: MODE=training is not supported yet: cpu_layout compiles inference "
             "graphs only (run under torch.no_grad()); use MODE=inference")
        return EXIT_USAGE
    check_model_name(build_parser(), args)
    if args.dt == "int8" and args.shape == "dynamic":
        _err("single_run: DT=int8 with SHAPE=dynamic is not supported yet: the PT2E graph keeps "
             "torch.export's guard on the batch size it was quantized at; use SHAPE=static")
        return EXIT_USAGE
    if args.dt == "int8" and args.suite == "huggingface":
        _err("single_run: DT=int8 with SUITE=huggingface is not supported yet: the PT2E flow here "
             "quantizes the CNN suites; use DT=float32 or amp")
        return EXIT_USAGE
    if args.dt == "int8" and importlib.util.find_spec("torchao") is None:
        _err("single_run: DT=int8 quantizes with PyTorch's PT2E flow, which needs torchao: "
             "pip install torchao==0.18.0")
        return EXIT_USAGE
    pkg = SUITE_PACKAGE.get(args.suite)
    if pkg and importlib.util.find_spec(pkg) is None:
        _err(f"single_run: skip: SUITE={args.suite} needs the '{pkg}' package, which is not "
             f"installed in this environment (no models run; the builtin suite needs nothing)")
        return 0
    if args.plot and args.scenario != "performance":
        _err("single_run: --plot applies to the performance scenario only; no PNG written")
    rows_file = tempfile.NamedTemporaryFile(prefix="single_run_rows_", suffix=".jsonl", delete=False)
    rows_file.close()
    rc = 0
    try:
        for mode, cores in worker_plan(args.thread):
            env = dict(os.environ)
            env["OMP_NUM_THREADS"] = str(len(cores))
            env["SINGLE_RUN_CORES"] = ",".join(map(str, cores))
            n = args.ninstances if mode == "multiple" else 1
            if n > 1:
                if n > len(cores):
                    _err(f"single_run: --ninstances {n} is more than the {len(cores)} cores of socket 0")
                    return EXIT_USAGE
                # PyTorch's own launcher pins each instance (numactl, else taskset), sets
                # OMP_NUM_THREADS, and preloads tcmalloc/jemalloc when it finds them.
                env["SINGLE_RUN_INSTANCES"] = str(n)
                prefix = [sys.executable, "-m", "torch.backends.xeon.run_cpu", "--ninstances", str(n),
                          "--ncores-per-instance", str(len(cores) // n),
                          "--core-list", ",".join(map(str, cores))]
                cmd = prefix + ["--", os.path.abspath(__file__)] + argv + \
                    ["--worker", mode, "--rows-file", rows_file.name]
                pin = f"{n} instances of {len(cores) // n} core(s) by torch.backends.xeon.run_cpu"
            else:
                prefix = pin_prefix(cores, args.no_pin)
                cmd = prefix + [sys.executable, os.path.abspath(__file__)] + argv + \
                    ["--worker", mode, "--rows-file", rows_file.name]
                pin = " ".join(prefix) if prefix else "no pinning"
            _err(f"== thread={mode}: {len(cores)} thread(s) on core(s) "
                 f"{','.join(map(str, cores))} ({pin})")
            sys.stdout.flush()
            r = subprocess.run(cmd, env=env)
            rc = max(rc, r.returncode)
            if r.returncode == EXIT_USAGE:
                break
        if args.plot and args.scenario == "performance":
            with open(rows_file.name) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            plot_speedups(rows, args.plot)
    finally:
        os.unlink(rows_file.name)
    return rc


def plot_speedups(rows, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        _err(f"single_run: --plot: matplotlib is not installed, so no PNG was written to {path} "
             f"(install matplotlib in the environment to enable plots)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for r in rows:
        series.setdefault(f"{r['backend']} ({r['thread']})", {})[r["name"]] = float(r["speedup"])
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) * max(1, len(series))), 4))
    width = 0.8 / max(1, len(series))
    for i, (label, vals) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [vals.get(n, 0.0) for n in names], width, label=label)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("speedup over eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    _err(f"single_run: wrote {path}")
    return True


# ---------------------------------------------------------------- worker
class Progress:
    """A progress bar over models on stderr (no tqdm dependency)."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def show(self, name: str):
        width = 20
        fill = int(width * self.done / max(self.total, 1))
        bar = "#" * fill + "-" * (width - fill)
        el = time.perf_counter() - self.t0
        _err(f"[{bar}] {self.done}/{self.total} {name} ({el:.0f}s)")

    def step(self, name: str):
        self.done += 1
        self.show(name)


def _fmt(v):
    return f"{v:.6f}" if isinstance(v, float) else str(v)


def append_csv(path: str, header, rows) -> None:
    """Append rows; write the header when the file is new or empty (and again, with a
    warning, if the file's header is different)."""
    need_header = True
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as f:
            headers = [r for r in csv.reader(f) if r and r[0] == "dev"]
        if headers and headers[-1] == list(header):
            need_header = False
        else:
            _err(f"single_run: {path} has a different header; appending a new header block")
    with open(path, "a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if need_header:
            w.writerow(header)
        for r in rows:
            w.writerow([_fmt(v) for v in r])


def load_suite_models(suite: str, model: str):
    """[(name, builder(batch_size) -> (model, input))]."""
    if suite == "builtin":
        from cpu_layout import models

        names = list(models.MODELS) if model == "all" else [model]
        return [(n, (lambda bs, n=n: models.build(n, batch_size=bs))) for n in names]
    from cpu_layout import zoo

    if suite == "huggingface":  # only reached when transformers is installed
        names = list(zoo.HF_MODELS) if model == "all" else [model]

        def build_hf(bs, n):
            bs = bs or 8
            return zoo.build_hf(n), zoo.hf_inputs(n, bs, 128 if bs == 1 else 384)
        return [(n, (lambda bs, n=n: build_hf(bs, n))) for n in names]
    if suite == "torchvision":  # only reached when torchvision is installed
        tv = zoo.import_torchvision()
        names = tv.models.list_models(module=tv.models) if model == "all" else [model]
    else:  # timm_models, only reached when timm is installed
        names = zoo.import_timm().list_models() if model == "all" else [model]
    pkg = "torchvision" if suite == "torchvision" else "timm"

    return [(n, (lambda bs, n=n: zoo.model_and_input(pkg, n, bs or 8))) for n in names]


def instance_index(all_cores, n: int) -> int:
    """Under run_cpu: which of `n` instances this is, from the cores it was pinned to
    (run_cpu hands out consecutive blocks of the core list)."""
    if n <= 1 or not hasattr(os, "sched_getaffinity"):
        return 0
    first = min(os.sched_getaffinity(0))
    per = max(1, len(all_cores) // n)
    return all_cores.index(first) // per if first in all_cores else 0


def worker_main(args) -> int:
    cores = [int(c) for c in os.environ.get("SINGLE_RUN_CORES", "0").split(",") if c]
    instances = int(os.environ.get("SINGLE_RUN_INSTANCES", "1"))
    instance = instance_index(cores, instances)
    dev = "cpu"
    if instances > 1:  # run_cpu pinned this instance to its share of the cores
        cores = sorted(os.sched_getaffinity(0))
        args.no_pin = True
        dev = f"cpu:{instance}"
    nthreads = 1 if args.worker == "single" else len(cores)
    if hasattr(os, "sched_setaffinity") and not args.no_pin:
        try:  # pinned already by numactl/taskset when present; this covers neither
            os.sched_setaffinity(0, cores)
        except OSError:
            pass
    import warnings

    import torch

    from cpu_layout import benchmark as B

    torch.set_num_threads(nthreads)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.wrapper == "cpp" and args.backend == "cpu_layout":
        ok, reason = B.cpp_wrapper_supported()
        if not ok:
            _err(f"single_run: {B.cpp_not_supported_message(reason)}; use WRAPPER=default, or "
                 f"BACKEND=inductor / inductor_freezing for Inductor's cpp wrapper")
            return EXIT_USAGE
    if args.wrapper == "cpp" and args.backend == "eager":
        _err("single_run: WRAPPER=cpp has no meaning for BACKEND=eager; ignored")
    # single: batch size 1; multiple: BS > 0 overrides the model's batch size.
    bs = 1 if args.worker == "single" else args.bs
    dtype, dynamic = args.dt, args.shape == "dynamic"
    int8 = dtype == "int8"
    if int8:
        from cpu_layout import zoo

        dtype = "float32"  # the quantized graph takes and returns fp32 tensors
    cl = args.channels == "last"
    entries = load_suite_models(args.suite, args.model)
    accuracy = args.scenario == "accuracy"
    header = ACCURACY_HEADER if accuracy else PERFORMANCE_HEADER
    if instance == 0:
        print(",".join(header), flush=True)
    prog = Progress(len(entries))
    prog.show("starting")
    rows = []
    for name, build in entries:
        try:
            model, x = build(bs)
        except Exception as exc:  # noqa: BLE001
            _err(B.one_line(name, exc))
            model = x = None
        batch = int((x[0] if isinstance(x, tuple) else x).shape[0]) if x is not None else bs
        qmodel = None
        if int8 and model is not None:
            try:  # re-estimates model's batch-norm statistics in place, then PT2E
                qmodel = zoo.quantize_pt2e(model, x, zoo.calibration_batches(x))
            except Exception as exc:  # noqa: BLE001
                _err(f"{B.one_line(name, exc)} (quantize_pt2e)")
                model = x = None
        if accuracy:
            if model is None:
                r = B.AccuracyResult("fail_to_run")
            elif int8:
                r = B.run_accuracy_int8(name, model, qmodel, x, args.backend, dynamic, args.wrapper, cl)
            else:
                r = B.run_accuracy(name, model, x, args.backend, dtype, dynamic, args.wrapper, cl)
            row = [dev, name, batch, r.status, r.calls_captured, r.unique_graphs, r.graph_breaks]
            if r.reason:
                _err(r.reason)
            if r.strides_ok is False:
                _err(f"{name}, warning: output strides differ from eager")
        else:
            if model is None:
                r = B.PerfResult("fail_to_run")
            else:
                r = B.run_performance(name, qmodel if int8 else model, x, args.backend, dtype,
                                      dynamic, args.wrapper, cl,
                                      warmup=args.warmup, iters=args.iters,
                                      rounds=min(5, args.iters))
            if r.reason:
                _err(r.reason)
            row = [dev, name, batch, r.speedup, r.abs_latency_ms, r.compile_s,
                   r.compression_ratio, r.eager_peak_bytes / 1e9, r.compiled_peak_bytes / 1e9]
        for w in getattr(r, "warnings", []):
            _err(f"{name}, {w}")
        rows.append(row)
        prog.step(name)
        print(",".join(_fmt(v) for v in row), flush=True)
        if args.rows_file:
            with open(args.rows_file, "a") as f:
                f.write(json.dumps({"name": name, "backend": args.backend, "thread": args.worker,
                                    "speedup": row[3]}) + "\n")
        if args.output:
            append_csv(args.output, header, [row])
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
