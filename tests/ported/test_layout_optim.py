"""Layout-optimisation tests ported from PyTorch, from GPU to CPU.

Upstream: pytorch/pytorch, test/inductor/test_layout_optim.py at commit
05a963fb5b172aaae7f62c31880af2f2621809cb (`TestLayoutOptim`).

Adaptation: backend="cpu_layout" instead of Inductor, CPU instead of CUDA,
inference only. Upstream introduces graph breaks in two ways and so do these
tests: by wrapping the model in DistributedDataParallel (Dynamo's DDP
optimizer then splits the graph at gradient-bucket boundaries; here a
one-process "gloo" group stands in for upstream's one-process "nccl" group) or
by `torch._dynamo.graph_break()` in forward (USE_DDP_WRAPPER=0 upstream).
Upstream compares against an fp64 run with `same(..., fp64_ref=...)`; here the
compiled output is compared with eager fp32 directly. Not ported: the training
tests (test_training_acc, test_nll_loss_backward; the backend does not compile
training graphs) and test_keep_output_layout_with_freezing (freezing is an
Inductor option; the backend keeps parameters as graph inputs, so it is the
same test as test_keep_output_layout_infer).

Every test runs under both wrappers (CPU_LAYOUT_CPP_WRAPPER=0/1) with
CPU_LAYOUT_STRICT=1 (a whole-graph fallback to eager is an error), under
torch.no_grad() and then, where cheap, again under torch.inference_mode().
Tolerances: fp32 to rtol 1e-4 and atol 1e-4 * max|ref| (bf16 / AMP would be
3e-2 relative to max|ref|; no test here uses them). Outputs must have eager's
sizes and strides.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ported_support import compile_, assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_compile", "wrapper")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-process gloo group for DistributedDataParallel (upstream: nccl)."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group(backend="gloo", init_method=f"file://{store}", world_size=1, rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Model2Conv(nn.Module):
    def __init__(self, dim=512, manual_graph_break=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, dim, kernel_size=3, stride=2, bias=False)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, stride=2, bias=False)
        self.manual_graph_break = manual_graph_break

    def forward(self, x):
        x = self.conv1(x)
        if self.manual_graph_break:
            torch._dynamo.graph_break()
        x = self.conv2(x)
        return x

    def get_example_inputs(self):
        return (torch.rand(2, 3, 16, 16),)


class Model3Conv(nn.Module):
    def __init__(self, dim=512, patch_size=7, kernel_size=7, manual_graph_break=False):
        super().__init__()
        self.seq = nn.Sequential(
            nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size, bias=False),
            nn.Conv2d(dim, dim, kernel_size, groups=dim, padding="same", bias=False),
        )
        self.conv = nn.Conv2d(dim, dim, kernel_size=1, bias=False)
        self.manual_graph_break = manual_graph_break

    def forward(self, x):
        x = self.seq(x)
        if self.manual_graph_break:
            torch._dynamo.graph_break()
        x = self.conv(x)
        return x

    def get_example_inputs(self):
        return (torch.randn(2, 3, 16, 16),)


class MutateBaseForConvOutput(nn.Module):
    def __init__(self, manual_graph_break=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 512, kernel_size=3, stride=2, bias=False)

    def forward(self, x):
        x = self.conv(x)
        y = x.view(-1)
        x.mul_(2)
        return y

    def get_example_inputs(self):
        return (torch.rand(2, 3, 16, 16),)


class MutateViewForConvOutput(nn.Module):
    def __init__(self, manual_graph_break=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 512, kernel_size=3, stride=2, bias=False)

    def forward(self, x):
        x = self.conv(x)
        y = x.view(-1)
        y.mul_(2)
        return x

    def get_example_inputs(self):
        return (torch.rand(2, 3, 16, 16),)


def verify_accuracy_for_infer(request, model_class, use_ddp_wrapper, compiled_graphs,
                              min_graphs=1):
    """Upstream's verify_accuracy(is_train=False): eager vs compiled, with the graph
    broken by DDP's bucketing or by a manual graph break."""
    mod = model_class(manual_graph_break=not use_ddp_wrapper).eval()
    inp = list(mod.get_example_inputs())
    with torch.no_grad():
        expected = copy.deepcopy(mod)(*copy.deepcopy(inp))
    if use_ddp_wrapper:
        request.getfixturevalue("process_group")
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Default buckets, as upstream: the last conv's weight fills DDP's 1 MB
        # first bucket, so Dynamo's DDP optimizer splits the graph after it.
        mod = DDP(mod)
    for mode in (torch.no_grad, torch.inference_mode):  # a fresh compile in each mode
        torch._dynamo.reset()
        compiled_graphs.clear()
        with mode():
            actual = compile_(mod)(*copy.deepcopy(inp))
        assert_same(actual, expected)
        assert len(compiled_graphs) >= min_graphs, "the graph break did not happen"


@pytest.mark.parametrize("use_ddp_wrapper", [True, False], ids=["ddp", "manual_break"])
def test_2conv_with_graph_break(request, use_ddp_wrapper, compiled_graphs):
    """Make sure a graph break does not cause any accuracy issue."""
    verify_accuracy_for_infer(request, Model2Conv, use_ddp_wrapper, compiled_graphs,
                              min_graphs=2)


@pytest.mark.parametrize("use_ddp_wrapper", [True, False], ids=["ddp", "manual_break"])
def test_3conv_with_graph_break(request, use_ddp_wrapper, compiled_graphs):
    verify_accuracy_for_infer(request, Model3Conv, use_ddp_wrapper, compiled_graphs,
                              min_graphs=2)


@pytest.mark.parametrize("use_ddp_wrapper", [True, False], ids=["ddp", "plain"])
def test_mutate_base_for_conv_output(request, use_ddp_wrapper, compiled_graphs):
    verify_accuracy_for_infer(request, MutateBaseForConvOutput, use_ddp_wrapper,
                              compiled_graphs)


@pytest.mark.parametrize("use_ddp_wrapper", [True, False], ids=["ddp", "plain"])
def test_mutate_view_for_conv_output(request, use_ddp_wrapper, compiled_graphs):
    verify_accuracy_for_infer(request, MutateViewForConvOutput, use_ddp_wrapper,
                              compiled_graphs)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_keep_output_layout_infer(mode):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)

        def forward(self, x):
            return self.conv(x)

    mod = Model().eval()
    inp = torch.randn(2, 3, 5, 5)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        out = mod(inp)
        opt_out = compile_(mod)(inp)
    # We should be able to do view on eager output
    out.view(5, -1)
    # ... and on the compiled module's output: a channels-last output would fail here.
    opt_out.view(5, -1)
    assert_same(opt_out, out)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_mutate_view(mode):
    def f(x):
        y = x.view(3, 2)
        y.mul_(2)

    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        x = torch.randn(2, 3)
        expected = x.clone()
        f(expected)
        assert compile_(f)(x) is None
    assert torch.equal(x, expected)
    assert x.stride() == (3, 1)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_mutate_base(mode):
    def f(x):
        y = x.view(3, 2)
        x.mul_(2)
        return y

    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        x = torch.randn(2, 3)
        x_eager = x.clone()
        expected = f(x_eager)
        y = compile_(f)(x)
    assert_same(y, expected)
    assert torch.equal(x, x_eager), "the input is mutated like eager's"
    assert y.data_ptr() == x.data_ptr(), "the output is a view of the input, as in eager"


def test_dynamic_shape_specialization(compiled_graphs):
    """Dynamic dimensions must not be specialized to static ones (upstream also
    runs a backward, which is not ported: inference only)."""

    def f(a, b):
        x = a.sin()
        y = b.cos()
        return x + y

    for mode in (torch.no_grad, torch.inference_mode):
        torch._dynamo.reset()
        compiled_graphs.clear()
        for size in [4, 8, 16]:
            with mode():
                a = torch.randn(2, size)
                b = torch.randn(2, size)
                actual = compile_(f, dynamic=True)(a, b)
                assert_same(actual, f(a, b))
        assert len(compiled_graphs) == 1, "a new size must not recompile"
