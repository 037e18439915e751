"""Real models (torchvision, timm; random weights) through the backend, against eager.

The CI tier (`zoo.CI_TIER`, a dozen models at small resolutions, one per op family)
runs every configuration with some model and every model with some configuration:
24 configurations (fp32/AMP x static/dynamic=True/mark_dynamic x both wrappers x
inference_mode/no_grad), two per model. Each run checks:
- values against eager with PyTorch's benchmark check (torch._dynamo.utils.same
  against an fp64 eager reference; tolerance 1e-4 fp32, 1e-3 AMP, as
  cpu_layout.benchmark.TOLERANCE),
- output sizes and strides equal to eager's,
- no whole-graph fallback (CPU_LAYOUT_STRICT=1),
- a second batch size runs without recompiling under dynamic shapes.
The full tier (every torchvision classification/segmentation/video model, a timm
list) is `scripts/model_tier.py --tier full`.
"""
import itertools

import pytest
import torch

from cpu_layout import benchmark as B
from cpu_layout import zoo

pytestmark = pytest.mark.usefixtures("strict_compile")

if zoo.import_timm() is None:  # scripts/test.sh installs both; a bare pytest run may not
    pytest.skip("torchvision and timm are needed for the real-model tier", allow_module_level=True)

DTYPES = ("float32", "amp")
SHAPES = ("static", "dynamic", "mark_dynamic")
WRAPPERS = ("default", "cpp")
GRAD_MODES = ("inference_mode", "no_grad")
CONFIGS = list(itertools.product(DTYPES, SHAPES, WRAPPERS, GRAD_MODES))
_HALF = len(CONFIGS) // 2
assert len(zoo.CI_TIER) == _HALF, "two configurations per model cover all of them"


def _cases():
    # Model i takes configuration i (fp32) and i + 12 (the same with AMP).
    for i, (suite, name, shape, _family) in enumerate(zoo.CI_TIER):
        for cfg in (CONFIGS[i], CONFIGS[i + _HALF]):
            yield pytest.param(suite, name, shape, *cfg, id=f"{name}-{'-'.join(cfg)}")


def _grad_mode(mode):
    return torch.inference_mode() if mode == "inference_mode" else torch.no_grad()


@pytest.mark.parametrize("suite,name,shape,dtype,shapes,wrapper,grad_mode", list(_cases()))
def test_ci_tier(suite, name, shape, dtype, shapes, wrapper, grad_mode, compiled_graphs):
    model = zoo.build(suite, name)
    fn = torch.compile(model, backend="cpu_layout", dynamic=True if shapes == "dynamic" else None,
                       options={"cpp_wrapper": wrapper == "cpp"})
    batches = (2, 3) if shapes != "static" else (2,)
    for bs in batches:
        x = zoo.example_input((bs,) + shape, seed=bs)
        if shapes == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        with _grad_mode(grad_mode), B._autocast(dtype):
            ref = model(x)
            out = fn(x)
        fp64 = B.fp64_reference(model, x)
        assert B.strides_match(ref, out) and [t.shape for t in B._flatten(ref)] == \
            [t.shape for t in B._flatten(out)], B.stride_report(ref, out)
        assert all(_exact_strides(r, o) for r, o in zip(B._flatten(ref), B._flatten(out))), \
            "strides of size-1 dims differ from eager's"
        assert [t.dtype for t in B._flatten(ref)] == [t.dtype for t in B._flatten(out)]
        assert B.values_match(ref, out, fp64, dtype), B.describe_error(ref, out, fp64, dtype)
    assert len(compiled_graphs) == 1, "one graph, compiled once for every batch size"
    assert compiled_graphs[0].cpu_layout_graph.convs(), "convolutions ran on cpu_layout's oneDNN path"


def _exact_strides(ref, out) -> bool:
    return ref.stride() == out.stride()
