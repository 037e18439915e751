"""Run a tier of real models through cpu_layout and report a table.

    .venv/bin/python scripts/model_tier.py                       # the CI tier, one configuration
    .venv/bin/python scripts/model_tier.py --tier full           # every torchvision model + a timm list
    .venv/bin/python scripts/model_tier.py --tier full --dtype amp --wrapper cpp --grad-mode no_grad

Each model: eager vs compiled (strict: a whole-graph fallback counts as a failure)
at two batch sizes, values by PyTorch's benchmark check against an fp64 reference,
output sizes and strides equal to eager's. One row per model, counts at the end.
Exit status 0 whatever the rows say (a report, not a test); 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

# timm models that stand for families the torchvision list lacks or builds differently.
TIMM_FULL = (
    "resnet50d", "resnest14d", "seresnext26d_32x4d", "efficientnet_b0", "mobilenetv3_large_100",
    "mixnet_s", "rexnet_100", "ghostnet_100", "regnety_008", "dla34", "dpn68", "cspresnet50",
    "hrnet_w18_small", "convnext_atto", "convnextv2_atto", "mobilevit_xxs", "edgenext_xx_small",
    "coat_lite_tiny", "levit_128s", "poolformer_s12", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224", "efficientformer_l1", "tinynet_e", "lcnet_050", "repvgg_a0",
    "inception_v3", "xception41", "nfnet_l0",
)


def full_tier(zoo):
    """(suite, name, input size without batch) for every model of the full tier."""
    tv = zoo.import_torchvision()
    rows = []
    if tv is not None:
        for name in tv.models.list_models(module=tv.models):
            size = 299 if name == "inception_v3" else 224
            if name.startswith("vit_h") or name.startswith("regnet_y_128"):
                continue  # over a GB of random weights: not a CPU-tier model
            rows.append(("torchvision", name, (3, size, size)))
        for name in tv.models.list_models(module=tv.models.segmentation):
            rows.append(("torchvision", name, (3, 224, 224)))
        for name in tv.models.list_models(module=tv.models.video):
            frames = 16 if name.startswith(("mvit", "s3d")) else 8
            rows.append(("torchvision", name, (3, frames, 112, 112) if not name.startswith(("mvit", "swin3d", "s3d"))
                         else (3, frames, 224, 224)))
    if zoo.import_timm() is not None:
        import timm

        for name in TIMM_FULL:
            m = timm.create_model(name, pretrained=False)
            rows.append(("timm", name, tuple(m.default_cfg.get("input_size", (3, 224, 224)))))
    return rows


def run_one(zoo, B, torch, suite, name, shape, args):
    model = zoo.build(suite, name)
    fn = torch.compile(model, backend="cpu_layout", dynamic=True if args.shape == "dynamic" else None,
                       options={"cpp_wrapper": args.wrapper == "cpp"})
    problems = []
    for bs in (args.batch, args.batch + 1) if args.shape != "static" else (args.batch,):
        x = zoo.example_input((bs,) + tuple(shape), seed=bs)
        if args.shape == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        mode = torch.inference_mode() if args.grad_mode == "inference_mode" else torch.no_grad()
        with mode, B._autocast(args.dtype):
            ref = model(x)
            out = fn(x)
        if not B.strides_match(ref, out):
            problems.append("strides: " + B.stride_report(ref, out))
        fp64 = B.fp64_reference(model, x)
        if not B.values_match(ref, out, fp64, args.dtype):
            problems.append("values: " + B.describe_error(ref, out, fp64, args.dtype))
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", choices=("ci", "full"), default="ci")
    p.add_argument("--dtype", choices=("float32", "amp"), default="float32")
    p.add_argument("--wrapper", choices=("default", "cpp"), default="default")
    p.add_argument("--grad-mode", choices=("inference_mode", "no_grad"), default="inference_mode")
    p.add_argument("--shape", choices=("static", "dynamic", "mark_dynamic"), default="static")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--only", default="", help="comma-separated model names")
    args = p.parse_args(argv)

    os.environ["CPU_LAYOUT_STRICT"] = "1"
    import warnings

    import torch

    from cpu_layout import benchmark as B
    from cpu_layout import zoo

    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = ([(s, n, shp) for s, n, shp, _ in zoo.CI_TIER] if args.tier == "ci" else full_tier(zoo))
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r[1] in keep]
    print(f"# tier={args.tier} dtype={args.dtype} wrapper={args.wrapper} grad_mode={args.grad_mode} "
          f"shape={args.shape} batch={args.batch} threads={torch.get_num_threads()}")
    print(f"{'suite':12} {'model':34} {'result':8} {'secs':>6}  detail")
    counts = {}
    for suite, name, shape in rows:
        torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            problems = run_one(zoo, B, torch, suite, name, shape, args)
            result, detail = ("pass", "") if not problems else ("wrong", "; ".join(problems))
        except Exception as exc:  # noqa: BLE001 - a report row, whatever went wrong
            result = "error"
            detail = B.one_line(type(exc).__name__, exc, 240).replace("\n", " ")
            if os.environ.get("MODEL_TIER_TRACEBACK"):
                traceback.print_exc()
        counts[result] = counts.get(result, 0) + 1
        print(f"{suite:12} {name:34} {result:8} {time.perf_counter() - t0:6.1f}  {detail}", flush=True)
    print("# " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
