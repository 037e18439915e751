"""Convolution, conv + batch-norm folding and parameter-mutation tests ported from PyTorch.

Upstream: pytorch/pytorch, test/inductor/test_inductor_freezing.py at commit
e0ab81b0d61478c08a8f437e47f6e5c6c38852de (`OptimizeForInferenceTemplate`,
instantiated for CPU as `FreezingCpuTests`).

Adaptation: backend="cpu_layout" instead of Inductor with freezing=True, CPU
only (test_conv_multiple_uses is CUDA-only upstream and runs on CPU here),
small shapes. Inductor's freezing turns parameters into constants; cpu_layout
keeps them as graph inputs and folds batch-norm into the conv itself, so the
same models test the same things: folded conv + BN (with bias or not, bf16 or
fp32, shared or functional BN), layout conversions around convs, and forward
passes that mutate parameters. Upstream's code checks (FileCheck on generated
code, inner-compile hooks) become checks of the output's values, sizes and
strides and of the parameters' own strides. Two variants of the folding
tests build the module or its BN statistics under inference_mode (inference
tensors keep no version counter), and the tests at the end (test_param_*)
extend upstream's test_mutation to what freezing would get wrong: parameters
changed in place, between calls or by forward itself (in place, or through
`.data` as upstream's test_cpu_repro.py::test_set_source_Tensor does).
Not ported (nothing convolution- or parameter-related to check on this
backend): test_error_on_eager (freezing-only behaviour), test_autocast and
test_mm_concat (skipped on CPU upstream), test_rng_op,
test_symint_not_folded, test_param_deallocated (skipped on CPU upstream),
test_unequal_bias_horizontal_addmm_fusion.

Every test runs under both wrappers (CPU_LAYOUT_CPP_WRAPPER=0/1) with
CPU_LAYOUT_STRICT=1 (a whole-graph fallback to eager is an error), under
torch.no_grad() and then, where cheap, again under torch.inference_mode().
Tolerances: fp32 to rtol 1e-4 and atol 1e-4 * max|ref|; bf16 outputs to 3e-2
relative and 3e-2 * max|ref| absolute.
"""
import copy

import pytest
import torch
from torch import nn

from cpu_layout.models import randomize_batch_norm  # noqa: E402
from ported_support import compile_, clone, assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_compile", "wrapper")


def check(fn, args, inference_mode=True, bf16=False):
    """Compile `fn`, compare with eager under no_grad; compile it afresh under
    inference_mode and compare again. `bf16`: the graph computes in bf16 even
    where its output is fp32, so compare to bf16 tolerance."""
    with torch.no_grad():
        ref = fn(*clone(args))
        opt = compile_(fn)
        assert_same(opt(*clone(args)), ref, bf16)
        assert_same(opt(*clone(args)), ref, bf16)  # a second call, as upstream's test_cpp_wrapper
    if inference_mode:  # a fresh compile, under inference_mode only
        torch._dynamo.reset()
        with torch.inference_mode():
            assert_same(compile_(fn)(*clone(args)), fn(*clone(args)), bf16)
    return opt


class ConvBN(nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=bias, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001, dtype=torch.float)

    def forward(self, x):
        return self.bn(self.conv(x))


class ConvFunctionalBN(nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, kernel_size=3, stride=2,
                 running_mean=None, running_var=None, weight=None, bn_bias=None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=bias, kernel_size=kernel_size,
                              stride=stride)
        self.running_mean = running_mean
        self.running_var = running_var
        self.weight = weight
        self.bias = bn_bias

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.conv(x), self.running_mean,
                                              self.running_var, self.weight, self.bias,
                                              False, 0.1, 1e-5)


class ConvMultiBN(nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=bias, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001, dtype=torch.float)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=0.1, dtype=torch.float)

    def forward(self, x):
        tmp = self.bn(self.conv(x))
        tmp2 = self.bn2(self.conv(x))
        return tmp + tmp2


class ConvMultiFunctionalBN(nn.Module):
    def __init__(self, in_channels, out_channels, bias=False, kernel_size=3, stride=2,
                 running_mean=None, running_var=None, weight=None, bn_bias=None,
                 running_mean2=None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=bias, kernel_size=kernel_size,
                              stride=stride)
        self.running_mean = running_mean
        self.running_var = running_var
        self.weight = weight
        self.bias = bn_bias
        self.running_mean2 = running_mean2

    def forward(self, x):
        F = torch.nn.functional
        tmp = F.batch_norm(self.conv(x), self.running_mean, self.running_var, self.weight,
                           self.bias, False, 0.1, 1e-5)
        tmp2 = F.batch_norm(self.conv(x), self.running_mean2, self.running_var, self.weight,
                            self.bias, False, 0.1, 1e-5)
        return tmp + tmp2


def train_bn_stats(mod, channels):
    """Upstream's 'update the default parameters of BN module': ten eager training
    forwards, then eval()."""
    for _ in range(10):
        mod(torch.rand(3, channels, 16, 16))
    return mod.eval()


# --- upstream tests ---------------------------------------------------------------------------


def test_mutation():
    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.mutated_param = nn.Parameter(torch.zeros([10, 10]))

        def forward(self):
            self.mutated_param.add_(10)
            return self.mutated_param

    with torch.no_grad():
        mod = Mod()
        out_eager = mod().clone()
        out_eager2 = mod().clone()

        mod = Mod()

        def foo(mod):
            return mod()

        opt = compile_(foo)
        out_comp = opt(mod)
        assert torch.equal(out_comp, out_eager)
        out_comp2 = opt(mod)
        assert torch.equal(out_comp2, out_eager2)
        assert torch.equal(mod.mutated_param, out_eager2), "the parameter itself was updated"


def test_aliased_param_return():
    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.aliased_param = nn.Parameter(torch.randn([10, 10]))

        def forward(self):
            return self.aliased_param[1:], self.aliased_param

    mod = Mod().eval()

    def foo(mod):
        return mod()

    with torch.no_grad():
        ref = mod()
        out = compile_(foo)(mod)
    assert_same(out, ref)
    assert out[1].data_ptr() == mod.aliased_param.data_ptr()
    assert out[0].data_ptr() == mod.aliased_param[1:].data_ptr()


def test_conv_multiple_uses():
    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 1, 1)
            self.bn1 = nn.BatchNorm2d(1)
            self.bn1.weight.data.normal_()

        def forward(self, x, y):
            return self.conv1(x) + self.bn1(self.conv1(y))

    model = ToyModel().eval()
    randomize_batch_norm(model.bn1, 0)
    a = torch.rand(4, 1, 16, 16)
    b = torch.rand(4, 1, 16, 16)
    check(model, (a, b))


def test_unfolded_bn():
    # Upstream also calls once outside no_grad: a training graph, which this
    # backend does not compile (it refuses, strictly, under CPU_LAYOUT_STRICT).
    x = torch.rand([3, 32, 15, 15])
    mod = randomize_batch_norm(nn.BatchNorm2d(32, eps=0.001), 0)

    def foo(mod, x):
        return mod(x) + 10

    check(foo, (mod, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_folded_conv_bn(use_bias, dtype):
    mod = ConvBN(3, 32, bias=use_bias, kernel_size=3, stride=2).eval()
    randomize_batch_norm(mod.bn, 0)
    mod = mod.to(dtype)
    x = torch.rand(2, 3, 16, 16).to(dtype)

    def foo(mod, x):
        return mod(x)

    check(foo, (mod, x))


def test_folded_conv_bn_with_module_sharing():
    mod = train_bn_stats(ConvBN(32, 32, bias=True, kernel_size=3, stride=2), 32)
    x = torch.rand(3, 32, 16, 16)

    def foo(mod, x):
        mod(x)
        return mod(x)

    check(foo, (mod, x))


def test_folded_conv_functional_bn_with_module_sharing():
    x = torch.rand(3, 32, 16, 16)
    mod = ConvFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                           running_mean=torch.mean(x, dim=(0, 2, 3)),
                           running_var=torch.var(x, dim=(0, 2, 3)),
                           weight=torch.ones(32), bn_bias=torch.zeros(32)).eval()

    def foo(mod, x):
        mod(x)
        return mod(x)

    check(foo, (mod, x))


def test_folded_conv_bn_built_under_inference_mode():
    # test_folded_conv_bn with the module, its BN statistics and the input all
    # made under inference_mode (inference tensors keep no version counter).
    with torch.inference_mode():
        mod = ConvBN(3, 16, bias=True, kernel_size=3, stride=2).eval()
        randomize_batch_norm(mod.bn, 0)
        x = torch.rand(2, 3, 16, 16)
        assert_same(compile_(mod)(x), mod(x))
        assert_same(compile_(mod)(x), mod(x))


def test_folded_conv_functional_bn_stats_from_inference_mode():
    # test_folded_conv_functional_bn_with_module_sharing, with the statistics
    # computed under inference_mode, as an inference script would.
    with torch.inference_mode():
        x = torch.rand(3, 32, 16, 16)
        stats = torch.mean(x, dim=(0, 2, 3)), torch.var(x, dim=(0, 2, 3))
    mod = ConvFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                           running_mean=stats[0], running_var=stats[1],
                           weight=torch.ones(32), bn_bias=torch.zeros(32)).eval()

    def foo(mod, x):
        mod(x)
        return mod(x)

    check(foo, (mod, x))


def test_conv_bn_with_multi_bn_share_conv():
    mod = train_bn_stats(ConvMultiBN(32, 32, bias=True, kernel_size=3, stride=2), 32)
    x = torch.rand(3, 32, 16, 16)

    def foo(mod, x):
        return mod(x)

    check(foo, (mod, x))


def test_conv_functional_bn_with_multi_bn_share_conv():
    x = torch.rand(3, 32, 16, 16)
    mod = ConvMultiFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                                running_mean=torch.mean(x, dim=(0, 2, 3)),
                                running_var=torch.var(x, dim=(0, 2, 3)),
                                weight=torch.ones(32), bn_bias=torch.zeros(32),
                                running_mean2=torch.mean(x, dim=(0, 2, 3)) * 0.5).eval()

    def foo(mod, x):
        return mod(x)

    check(foo, (mod, x))


def test_dont_change_dtype_folding():
    dtype = torch.bfloat16
    mod = nn.Conv2d(3, 32, bias=None, kernel_size=3, stride=2).eval().to(dtype)
    x = torch.rand(2, 3, 16, 16).to(dtype)

    def foo(mod, x):
        return mod(x) * torch.full([1], 2.0)

    # The output is fp32 (a 1-d fp32 operand promotes) but the conv rounds to
    # bf16 first; a different accumulation order moves some values by one bf16
    # ulp, so the values compare to bf16 tolerance. The dtype still compares exactly.
    check(foo, (mod, x), bf16=True)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_with_as_strided(groups):
    class Model(nn.Module):
        def __init__(self, groups):
            super().__init__()
            self.kv = nn.Conv2d(256, 384, kernel_size=(1, 1), stride=(1, 1), bias=False,
                                groups=groups)

        def forward(self, x):
            convolution = self.kv(x)
            constant_pad_nd = torch.ops.aten.constant_pad_nd.default(convolution,
                                                                     [2, 2, 2, 2], 0.0)
            # as_strided inputs are depend on input's size and stide.
            as_strided = torch.ops.aten.as_strided.default(
                constant_pad_nd, [8, 384, 2, 20, 12], [153600, 400, 160, 1, 20])
            as_strided_1 = torch.ops.aten.as_strided.default(
                as_strided, [8, 384, 2, 2, 12, 12], [153600, 400, 160, 8, 20, 1])
            return torch.ops.aten.clone.default(as_strided_1,
                                                memory_format=torch.contiguous_format)

    def foo(mod, inp):
        return mod(inp)

    x = torch.randn(8, 256, 16, 16)
    check(foo, (Model(groups).eval(), x))


def test_cpp_wrapper():
    # Upstream compiles with options={"cpp_wrapper": True}; here both wrappers
    # run every test, and this one passes the option explicitly too.
    mod = ConvBN(3, 32, kernel_size=3, stride=2).eval()
    randomize_batch_norm(mod.bn, 0)
    x = torch.rand(2, 3, 16, 16)

    def foo(mod, x):
        return mod(x)

    opt = torch.compile(foo, backend="cpu_layout", options={"cpp_wrapper": True})
    out_eager = mod(x)
    with torch.no_grad():
        assert_same(opt(mod, x), out_eager.detach())
        assert_same(opt(mod, x), out_eager.detach())


def test_conv_layout_convert_with_view():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            x = self.bn(x)
            x = self.conv(x)
            return torch.flatten(x, 1)

    mod = Model().eval()
    randomize_batch_norm(mod.bn, 0)

    def foo(mod, inp):
        return mod(inp)

    check(foo, (mod, torch.rand(2, 3, 5, 5)))


@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_conv_weight_layout_convert(in_format):
    # Upstream checks (through an inner-compile hook) that Inductor converts the
    # frozen weight to channels-last. Here: whatever the backend does with the
    # weight, the parameter itself keeps its layout and the output is eager's.
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)

        def forward(self, x):
            return self.conv(x)

    mod = Model().eval()
    w_stride = mod.conv.weight.stride()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    check(mod, (torch.rand(2, 3, 5, 5).contiguous(memory_format=fmt),))
    assert mod.conv.weight.stride() == w_stride
    assert mod.conv.weight.is_contiguous()


def test_redundant_clone_for_layout_convert():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)

        def forward(self, x):
            y = x + 1
            return self.conv(x), y

    mod = Model().eval()
    inp = torch.rand(2, 3, 5, 5)
    opt = check(mod, (inp,))
    with torch.no_grad():
        out = opt(inp)
    assert out[0].is_contiguous(memory_format=torch.contiguous_format)
    assert out[1].is_contiguous(memory_format=torch.contiguous_format)


# --- parameter mutation (extends test_mutation) ----------------------------------------------


@pytest.mark.parametrize("what", ["conv_weight", "bn_running_var", "load_state_dict"])
def test_param_update_between_calls_is_seen(what):
    """Freezing would bake these in; the backend must refold the BN and repack
    the weights when a parameter or buffer changes."""
    mod = ConvBN(3, 16, bias=True, kernel_size=3, stride=2).eval()
    randomize_batch_norm(mod.bn, 0)
    x = torch.rand(2, 3, 16, 16)
    opt = compile_(mod)
    with torch.no_grad():
        assert_same(opt(x), mod(x))
        if what == "conv_weight":
            mod.conv.weight.mul_(-2.0)
        elif what == "bn_running_var":
            mod.bn.running_var.mul_(4.0)
        else:
            other = randomize_batch_norm(ConvBN(3, 16, bias=True, kernel_size=3, stride=2).bn, 0)
            mod.bn.load_state_dict(other.state_dict())
        assert_same(opt(x), mod(x))


class ConvMaskedInForward(nn.Module):
    """A conv whose forward masks its own weight in place (the weight-pruning
    pattern); the mutation must reach the parameter and the conv must use it."""

    def __init__(self, through_data):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.register_buffer("mask", (torch.rand_like(self.conv.weight) > 0.5).float())
        self.through_data = through_data

    def forward(self, x):
        with torch.no_grad():
            if self.through_data:
                self.conv.weight.data *= self.mask
            else:
                self.conv.weight.mul_(self.mask)
        return self.conv(x)


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
def test_param_mutation_in_forward(through_data):
    mod = ConvMaskedInForward(through_data).eval()
    eager = copy.deepcopy(mod)
    x = torch.randn(2, 4, 10, 10).contiguous(memory_format=torch.channels_last)
    opt = compile_(mod)
    with torch.no_grad():
        ref = eager(x)
        assert_same(opt(x), ref)
        assert torch.equal(mod.conv.weight, eager.conv.weight)
        with torch.no_grad():  # change the mask: the next call masks again
            mod.mask.copy_((torch.rand_like(mod.mask) > 0.5).float())
            eager.mask.copy_(mod.mask)
        assert_same(opt(x), eager(x))
        assert torch.equal(mod.conv.weight, eager.conv.weight)
