"""Third-party model suites (torchvision, timm) for tests and benchmarks.

Never imported by the backend itself. Weights are random (nothing downloads);
batch-norm statistics are made non-trivial so folding is exercised.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


_TORCHVISION_LIB = []


def _define_torchvision_op_schemas() -> None:
    # torchvision's wheel here is a CUDA build: with the CPU torch its C++ ops
    # do not load, yet its Python side registers fake kernels for nms/qnms and
    # fails with "operator torchvision::nms does not exist". Model definitions
    # need neither op, so declaring the two schemas is enough to import it.
    if _TORCHVISION_LIB:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_LIB.append(lib)  # a Library deregisters its schemas when collected


def import_torchvision():
    """`import torchvision`, or None when it is not installed."""
    try:
        import torchvision  # noqa: F401
        return torchvision
    except ImportError:
        return None
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    _define_torchvision_op_schemas()
    import importlib
    import sys

    for m in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[m]
    return importlib.import_module("torchvision")


def import_timm():
    """`import timm` (which imports torchvision), or None when it is not installed."""
    if import_torchvision() is None:
        return None
    try:
        import timm
        return timm
    except ImportError:
        return None


def _randomise_bn_stats(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def torchvision_model(name: str, **kwargs) -> torch.nn.Module:
    tv = import_torchvision()
    if tv is None:
        raise ImportError("torchvision is not installed")
    torch.manual_seed(0)
    return _randomise_bn_stats(tv.models.get_model(name, weights=None, **kwargs).eval(), 0)


def timm_model(name: str, **kwargs) -> torch.nn.Module:
    timm = import_timm()
    if timm is None:
        raise ImportError("timm is not installed")
    torch.manual_seed(0)
    return _randomise_bn_stats(timm.create_model(name, pretrained=False, **kwargs).eval(), 0)


def example_input(shape: Tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- the tiers the tests and scripts/model_tier.py run -------------------------------

# (suite, name, input size without the batch dim, op family it stands for): a dozen
# models at small resolutions, chosen so every op family real CNNs use appears once.
CI_TIER = (
    # tests/test_real_models.py gives entry i the configurations i and i + 12 of its
    # list: 0-3 static, 4-7 dynamic=True, 8-11 mark_dynamic on the batch. Swin stays
    # static: with every dim symbolic, Dynamo's own tracing of it takes minutes.
    ("torchvision", "swin_t", (3, 64, 64), "attention with relative position bias"),
    ("torchvision", "mobilenet_v3_small", (3, 64, 64), "depthwise + SE, hardswish"),
    ("torchvision", "regnet_x_400mf", (3, 64, 64), "grouped convs"),
    ("torchvision", "densenet121", (3, 32, 32), "dense concat"),
    ("torchvision", "resnet18", (3, 64, 64), "residual"),
    ("torchvision", "shufflenet_v2_x0_5", (3, 64, 64), "channel shuffle, chunk"),
    ("torchvision", "googlenet", (3, 64, 64), "inception branches"),
    ("torchvision", "r3d_18", (3, 4, 32, 32), "conv3d"),
    ("torchvision", "convnext_tiny", (3, 32, 32), "permute + layer_norm + linear"),
    ("torchvision", "deeplabv3_mobilenet_v3_large", (3, 64, 64), "dilated convs, bilinear upsampling"),
    ("timm", "resnest14d", (3, 64, 64), "split attention (radix softmax)"),
    ("timm", "convnext_atto", (3, 64, 64), "timm's own layers"),
)


def build(suite: str, name: str):
    """The model in eval mode (random weights)."""
    if suite == "torchvision":
        kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
        if name.startswith(("deeplabv3", "fcn", "lraspp")):
            kwargs = {"weights_backbone": None}
        return torchvision_model(name, **kwargs)
    if suite == "timm":
        return timm_model(name)
    raise ValueError(f"unknown suite {suite!r}")


def first_tensor(out):
    """A model's main output: segmentation models return {'out': ...}."""
    if isinstance(out, dict):
        return out["out"]
    return out
