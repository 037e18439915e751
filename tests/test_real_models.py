"""Real models (torchvision, timm; random weights) through the backend, against eager.

The CI tier (`zoo.CI_TIER`, a dozen models at small resolutions, one per op family)
runs every configuration with some model and every model with some configuration:
24 configurations (fp32/AMP x static/dynamic=True/mark_dynamic x both wrappers x
inference_mode/no_grad), two per model. Each run checks (zoo.compare_with_eager):
- values against eager with PyTorch's benchmark check (torch._dynamo.utils.same
  against an fp64 eager reference; tolerance 1e-4 fp32, 1e-3 AMP, as
  cpu_layout.benchmark.TOLERANCE),
- output sizes, dtypes and strides equal to eager's,
- no whole-graph fallback (CPU_LAYOUT_STRICT=1),
- a second batch size runs without recompiling under dynamic shapes.
The full tier (every torchvision classification/segmentation/video model, a timm
list) is `scripts/model_tier.py --tier full`.
"""
import itertools

import pytest

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


@pytest.mark.parametrize("suite,name,shape,dtype,shapes,wrapper,grad_mode", list(_cases()))
def test_ci_tier(suite, name, shape, dtype, shapes, wrapper, grad_mode, compiled_graphs):
    model = zoo.build(suite, name)
    assert zoo.compare_with_eager(model, shape, dtype, shapes, wrapper, grad_mode) == []
    assert len(compiled_graphs) == 1, "one graph, compiled once for every batch size"
    assert compiled_graphs[0].cpu_layout_graph.convs(), "convolutions ran on cpu_layout's oneDNN path"
