"""Run a tier of real models through cpu_layout and report a table.

    .venv/bin/python scripts/model_tier.py                       # the CI tier, one configuration
    .venv/bin/python scripts/model_tier.py --tier full           # every torchvision model + a timm list
    .venv/bin/python scripts/model_tier.py --tier full --dtype amp --wrapper cpp --grad-mode no_grad

Each model: zoo.compare_with_eager (strict: a whole-graph fallback counts as a
failure): values by PyTorch's benchmark check against an fp64 reference, output
sizes, dtypes and strides equal to eager's, a second batch size unless static. One row per model, counts at the end.
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
    names = []
    if tv is not None:
        for module in (tv.models, tv.models.segmentation, tv.models.video):
            names += [("torchvision", n) for n in tv.models.list_models(module=module)
                      if not n.startswith(("vit_h", "regnet_y_128"))]  # over a GB of weights each
    if zoo.import_timm() is not None:
        names += [("timm", n) for n in TIMM_FULL]
    return [(s, n, None) for s, n in names]  # sizes from the model: zoo.default_input_shape


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", choices=("ci", "full"), default="ci")
    p.add_argument("--dtype", choices=("float32", "amp"), default="float32")
    p.add_argument("--wrapper", choices=("default", "cpp"), default="default")
    p.add_argument("--grad-mode", choices=("inference_mode", "no_grad"), default="inference_mode")
    p.add_argument("--shape", choices=("static", "dynamic", "mark_dynamic"), default="static")
    p.add_argument("--batch", type=int, default=2,
                   help="first batch size (the second is one more; Dynamo specialises a batch of 1)")
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
            model = zoo.build(suite, name)
            shape = shape or zoo.default_input_shape(suite, name, model)
            problems = zoo.compare_with_eager(model, shape, args.dtype, args.shape, args.wrapper,
                                              args.grad_mode, args.batch)
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
