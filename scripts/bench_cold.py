#!/usr/bin/env python3
"""Cold and warm start: the first call of a fresh process, per model and backend.

Every figure is one new Python process that builds the model, compiles it and
times its first call (torch.no_grad, the suite's input, --threads threads):

  aot_eager   torch's own tracing with no backend work: the floor every backend pays
  cold        cpu_layout's C++ wrapper with an empty cache for the graph (the segment
              runtime and the module-state check, compiled once per machine, already in the cache)
  warm        the same again with the cache the cold run left
  ov          OpenVINO: convert_model + compile_model + first inference, in its own process

and the backend's own share, first call minus aot_eager's first call (cold and warm).
The runtime's one-time build is timed separately, in a cache of its own.

    python scripts/bench_cold.py [--suite torchvision] [--models densenet121,resnet50]
                                 [--threads 1] [--repeat 3] [--no-ov]

Each figure is the median of --repeat fresh processes (cold: each with an empty graph cache).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One measurement, run as `python bench_cold.py --child <json>` in a fresh process.
def _child(spec: dict) -> dict:
    import time

    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["what"] == "runtime":
        from cpu_layout import state_key
        from cpu_layout.codegen import program

        t0 = time.perf_counter()
        program.runtime()
        state_key.native()
        return {"seconds": time.perf_counter() - t0}
    from cpu_layout import zoo

    model, x = zoo.model_and_input(spec["suite"], spec["model"], 1)
    if spec["what"] == "ov":
        from cpu_layout.benchmark import OpenVINOCompiled

        t0 = time.perf_counter()
        ov = OpenVINOCompiled("openvino", "float32", False, "default", False, model, fn=model)
        ov(x)
        return {"seconds": time.perf_counter() - t0}
    if spec["what"] == "aot_eager":
        compiled = torch.compile(model, backend="aot_eager")
    else:
        compiled = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": True})
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    out = {"seconds": time.perf_counter() - t0, "process": time.perf_counter() - t_start}
    if spec["what"] != "aot_eager":
        from cpu_layout import build

        out["compiles"] = build.stats["compiles"]
    return out


def _run(spec: dict, cache: str) -> dict:
    env = dict(os.environ, CPU_LAYOUT_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec}: child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="torchvision")
    ap.add_argument("--models", default="densenet121,resnet50")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per figure (median) [3]")
    ap.add_argument("--no-ov", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    base = {"suite": args.suite, "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="bench_cold_") as tmp:
        runtime_cache = os.path.join(tmp, "runtime_only")
        rt = _run({**base, "what": "runtime"}, runtime_cache)
        print(f"segment runtime and module-state check, one-time build: {rt['seconds']:.2f} s")
        print(f"{'model':22s} {'aot_eager':>9s} {'cold':>7s} {'warm':>7s} {'ov':>7s}  "
              f"{'own cold':>8s} {'own warm':>8s}  (seconds, first call of a fresh process)")
        for name in args.models.split(","):
            def median(what, fresh_cache):
                times = []
                for r in range(args.repeat):
                    cache = os.path.join(tmp, f"{name}-{what}-{r if fresh_cache else 0}")
                    if not os.path.exists(cache):  # runtime built, graph not
                        subprocess.run(["cp", "-r", runtime_cache, cache], check=True)
                    out = _run({**base, "model": name, "what": what}, cache)
                    if what == "cplcpp" and not fresh_cache and out["compiles"]:
                        print(f"  {name}: a warm run compiled {out['compiles']} libraries", file=sys.stderr)
                    times.append(out["seconds"])
                return statistics.median(times)

            aot = median("aot_eager", True)
            cold = median("cplcpp", True)
            warm = median("cplcpp", False)  # the cache of cold's first run
            ov = float("nan") if args.no_ov else median("ov", True)
            print(f"{name:22s} {aot:9.2f} {cold:7.2f} {warm:7.2f} {ov:7.2f}  "
                  f"{cold - aot:8.2f} {warm - aot:8.2f}", flush=True)


if __name__ == "__main__":
    main()
