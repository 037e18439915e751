"""Third-party model suites (torchvision, timm) for tests and benchmarks.

Never imported by the backend itself. Weights are random (nothing downloads);
batch-norm statistics are made non-trivial (models.randomize_batch_norm) so
folding is exercised.
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


def build(suite: str, name: str) -> torch.nn.Module:
    """The model in eval mode: random weights, non-trivial batch-norm statistics."""
    from cpu_layout.models import randomize_batch_norm

    torch.manual_seed(0)
    if suite == "torchvision":
        tv = import_torchvision()
        if tv is None:
            raise ImportError("torchvision is not installed")
        kwargs = {}
        if name in ("googlenet", "inception_v3"):
            kwargs = {"aux_logits": False, "init_weights": True}
        elif name.startswith(("deeplabv3", "fcn", "lraspp")):
            kwargs = {"weights_backbone": None}
        model = tv.models.get_model(name, weights=None, **kwargs)
    elif suite == "timm":
        timm = import_timm()
        if timm is None:
            raise ImportError("timm is not installed")
        model = timm.create_model(name, pretrained=False)
    else:
        raise ValueError(f"unknown suite {suite!r}")
    return randomize_batch_norm(model, 0)


def default_input_shape(suite: str, name: str, model: torch.nn.Module,
                        size: Optional[int] = None) -> Tuple[int, ...]:
    """A model's usual input size without the batch dim: timm's own config; for
    torchvision 224 px (inception 299), video clips of 8 frames at 112 px (16 at
    224 px for MViT, S3D and Swin3D). `size` replaces the two spatial sizes."""
    if suite == "timm":
        shape = tuple(model.default_cfg.get("input_size", (3, 224, 224)))
    elif name == "inception_v3":
        shape = (3, 299, 299)
    elif type(model).__module__.startswith("torchvision.models.video."):
        big = name.startswith(("mvit", "s3d", "swin3d"))
        shape = (3, 16, 224, 224) if big else (3, 8, 112, 112)
    else:
        shape = (3, 224, 224)
    return shape[:-2] + (size, size) if size else shape


def model_and_input(suite: str, name: str, batch: int, size: Optional[int] = None):
    """(model in eval mode, example input at `batch`) for a model of `suite`
    (builtin, torchvision or timm) at its default input shape; `size` replaces
    the spatial sizes. The one place the benchmark scripts get a model from."""
    if suite == "builtin":
        from cpu_layout import models

        return models.build(name, batch_size=batch)
    model = build(suite, name)
    return model, example_input((batch,) + default_input_shape(suite, name, model, size))


def compare_with_eager(model: torch.nn.Module, shape: Tuple[int, ...], dtype: str = "float32",
                       shapes: str = "static", wrapper: str = "default",
                       grad_mode: str = "inference_mode", batch: int = 2) -> List[str]:
    """Compile `model` with cpu_layout (`shapes`: static, dynamic = dynamic=True,
    mark_dynamic = the batch dim marked) and run it next to eager at `batch`, and
    at batch + 1 unless static. Returns what differs, one line each (empty: nothing):
    output sizes, dtypes and strides must be eager's exactly, values must pass
    PyTorch's benchmark check against an fp64 reference (benchmark.TOLERANCE)."""
    from cpu_layout import benchmark as B

    fn = torch.compile(model, backend="cpu_layout", dynamic=True if shapes == "dynamic" else None,
                       options={"cpp_wrapper": wrapper == "cpp"})
    problems = []
    for bs in (batch,) if shapes == "static" else (batch, batch + 1):
        x = example_input((bs,) + tuple(shape), seed=bs)
        if shapes == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
        with mode, B._autocast(dtype):
            ref = model(x)
            out = fn(x)
        got = [(tuple(t.shape), t.stride(), t.dtype) for t in B._flatten(out)]
        want = [(tuple(t.shape), t.stride(), t.dtype) for t in B._flatten(ref)]
        if got != want:
            problems.append(f"batch {bs}: (size, stride, dtype) {got} where eager has {want}")
        fp64 = B.fp64_reference(model, x)
        if not B.values_match(ref, out, fp64, dtype):
            problems.append(f"batch {bs}: values: " + B.describe_error(ref, out, fp64, dtype))
    return problems
