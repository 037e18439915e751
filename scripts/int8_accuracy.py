#!/usr/bin/env python3
"""INT8 accuracy of cpu_layout on PT2E-quantized torchvision models, one table.

For each model: random weights, batch-norm statistics re-estimated and the model
quantized with PyTorch's PT2E flow (`zoo.quantize_pt2e`, 8 seeded calibration batches),
then the quantized graph run eagerly and through torch.compile(backend="cpu_layout",
C++ wrapper) on a fixed batch of random images. Prints each one's relative RMS error
against the float model, their ratio, and the top-1 agreement of ours with eager int8
(with random weights logits are close to ties, so a one-step requantization difference
can flip an argmax: read top-1 with that in mind).

    python scripts/int8_accuracy.py [--models resnet50,mobilenet_v2] [--batch 16] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from cpu_layout import zoo  # noqa: E402

MODELS = ("resnet50,resnext50_32x4d,mobilenet_v2,mobilenet_v3_large,efficientnet_b0,densenet121,"
          "googlenet,shufflenet_v2_x1_0,regnet_y_800mf,convnext_tiny")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tv = zoo.import_torchvision()
    if tv is None:
        print("torchvision is not installed", file=sys.stderr)
        return 2
    print(f"batch {args.batch}, 224 px, {args.threads} thread(s)")
    print("| model | rel. RMS vs fp32: eager int8 | cpu_layout int8 | ratio | top-1 agreement with eager int8 |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = getattr(tv.models, name)().eval()
        x = zoo.example_input((args.batch, 3, 224, 224), seed=123)
        qm = zoo.quantize_pt2e(model, x, zoo.calibration_batches(x))
        with torch.no_grad():
            fp32, ref = model(x), qm(x)
            y = torch.compile(qm, backend="cpu_layout", options={"cpp_wrapper": True})(x)

        def rel(a):
            return ((a - fp32).pow(2).mean().sqrt() / fp32.pow(2).mean().sqrt()).item()

        agree = (y.argmax(1) == ref.argmax(1)).float().mean().item()
        print(f"| {name} | {rel(ref):.4f} | {rel(y):.4f} | {rel(y) / rel(ref):.3f} | {agree:.3f} |", flush=True)
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
