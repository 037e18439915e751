"""Convolution, stride and memory-format reproducers ported from PyTorch.

Upstream: pytorch/pytorch, test/inductor/test_cpu_repro.py at commit
000b3bd8434fa6ef1e081def6931e5eda4020118 (the conv / stride / channels-last
tests of `CPUReproTests`). The conv2d/conv3d channels-last and
`test_convolution*` / `test_alexnet_prefix` tests at the end of this file come
from test/inductor/test_torchinductor.py at commit
82bdbe7fd5cd136dc9f9bd42631a830ae5547fcd (test_cpu_repro.py has no conv3d or
channels-last conv tests of its own).

Adaptation: backend="cpu_layout" instead of Inductor, CPU only, inference only
(no backward: the backend does not compile training graphs), small shapes.
Upstream's checks of Inductor internals (generated code, layouts seen by
aten.convolution) become checks of what the backend promises: eager's values
and eager's output sizes and strides, graph inputs untouched.

Every test runs under both wrappers (CPU_LAYOUT_CPP_WRAPPER=0/1) with
CPU_LAYOUT_STRICT=1 (a whole-graph fallback to eager is an error), under
torch.no_grad() and then, where cheap, again under torch.inference_mode().
Tolerances: fp32 to rtol 1e-4 and atol 1e-4 * max|ref|; bf16 / AMP outputs to
3e-2 relative and 3e-2 * max|ref| absolute (both round to bf16, at different
points).
"""
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ported_support import compile_, autocast, clone, assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_compile", "wrapper")

aten = torch.ops.aten


def check(model, inputs, amp=False, dynamic=False, fullgraph=False, inference_mode=True,
          more_inputs=()):
    """Compile `model`, compare with eager under no_grad; compile it afresh under
    inference_mode and compare again."""
    with torch.no_grad(), autocast(amp):
        ref = model(*clone(inputs))
        fn = compile_(model, dynamic=dynamic, fullgraph=fullgraph)
        assert_same(fn(*clone(inputs)), ref, amp)
        for other in more_inputs:
            assert_same(fn(*clone(other)), model(*clone(other)), amp)
    if inference_mode:  # a fresh compile, under inference_mode only
        torch._dynamo.reset()
        with torch.inference_mode(), autocast(amp):
            ref = model(*clone(inputs))
            assert_same(compile_(model, dynamic=dynamic, fullgraph=fullgraph)(*clone(inputs)),
                        ref, amp)
    return fn


FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


# --- test_conv_in_channel_1_dynamic_shapes: the maml_omniglot reproducer -------------------


class ConvRelu(nn.Module):
    def __init__(self, in_channel, out_channel):
        super().__init__()
        self.conv = nn.Conv2d(in_channel, out_channel, 3)

    def forward(self, x):
        return F.relu(self.conv(x))


@pytest.mark.parametrize("in_format", list(FORMATS))
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_conv_in_channel_1_dynamic_shapes(amp, in_format, compiled_graphs):
    # Channels dim of the input is 1, shapes dynamic: a [s0, 1, H, W] input has
    # the same strides in both memory formats, the case that crashed Inductor.
    mod = ConvRelu(1, 3).eval()
    fmt = FORMATS[in_format]
    v = torch.randn(5, 1, 15, 15).contiguous(memory_format=fmt)
    others = [(torch.randn(n, 1, 15, 15).contiguous(memory_format=fmt),) for n in (2, 7)]
    fn = check(mod, (v,), amp=amp, dynamic=True, more_inputs=others, inference_mode=False)
    assert len(compiled_graphs) == 1, "new batch sizes must not recompile"
    torch._dynamo.reset()
    with torch.inference_mode(), autocast(amp):
        assert_same(compile_(mod, dynamic=True)(v), mod(v), amp)


# --- test_conv_stride_constraints ----------------------------------------------------------


@pytest.mark.parametrize("in_format", list(FORMATS))
@pytest.mark.parametrize("w_format", list(FORMATS))
def test_conv_stride_constraints(w_format, in_format):
    # Upstream checks the layouts aten.convolution receives; here the weight is a
    # plain graph input in either memory format and what is checked is the
    # result, its strides, and that the inputs keep their own strides.
    m = nn.Conv2d(5, 6, [3, 3])

    def fn(inp, weight):
        return (F.conv2d(inp, weight, None, m.stride, m.padding, m.dilation, m.groups),)

    inp = torch.randn([2, 5, 16, 16]).contiguous(memory_format=FORMATS[in_format])
    weight = m.weight.detach().clone().contiguous(memory_format=FORMATS[w_format])
    in_strides, w_strides = inp.stride(), weight.stride()
    check(fn, (inp, weight))
    with torch.no_grad():
        compile_(fn)(inp, weight)
    assert inp.stride() == in_strides and weight.stride() == w_strides


def test_conv_bias_flattened_view():
    def fn(x):
        bias = x.to(torch.bool).float().flatten()
        return F.conv2d(x, x, bias, stride=1, padding=0)

    check(fn, (torch.ones(1, 1, 1, 1),), fullgraph=True)


# --- test_conv2d_bn_mixed_dtype --------------------------------------------------------------


class ConvBnMixedDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1, bias=False,
                              dtype=torch.bfloat16)
        self.bn = nn.BatchNorm2d(16, eps=0.001, momentum=0.1, affine=True,
                                 track_running_stats=True)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_conv2d_bn_mixed_dtype():
    mod = ConvBnMixedDtype().eval()
    with torch.no_grad():
        mod.bn.running_mean.uniform_(-1, 1)
        mod.bn.running_var.uniform_(0.5, 2)
        mod.bn.weight.uniform_(0.5, 1.5)
        mod.bn.bias.uniform_(-1, 1)
    v = torch.randn(1, 3, 24, 24, dtype=torch.bfloat16)
    check(mod, (v,))


# --- test_conv2d_packed: batched/unbatched, padding 0 and (0,) -------------------------------


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("padding", [0, (0,)], ids=["int", "tuple1"])
def test_conv2d_packed(padding, train):
    mod = nn.Sequential(nn.Conv2d(3, 64, 3, 3, padding=padding)).train(mode=train)
    v = torch.randn(3, 20, 20)  # unbatched, as upstream
    check(mod, (v,))


def test_conv2d_autocast():
    v = torch.randn(1, 3, 28, 18)
    mod = nn.Sequential(nn.Conv2d(3, 64, 3, 3)).eval()
    check(mod, (v,), amp=True)


# --- test_conv1d_strided_weight_torch_compile (inference half) -------------------------------


def test_conv1d_strided_weight_torch_compile():
    def fn(x, w):
        wt = w.transpose(2, 1)  # a non-contiguous weight
        y = F.conv1d(x, wt)
        return y.clone()

    x = torch.randn(2, 3, 5)
    w = torch.randn(4, 2, 3)
    check(fn, (x, w), dynamic=True, fullgraph=True,
          more_inputs=[(torch.randn(3, 3, 7), torch.randn(4, 2, 3))])


# --- test_unsupported_conv_transpose ---------------------------------------------------------


def test_unsupported_conv_transpose():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose2d(3, 6, 3, stride=1, padding=1,
                                                     output_padding=1)

        def forward(self, x):
            return torch.tanh(self.conv_transpose(x))

    m = Model().eval()
    x = torch.randn(1, 3, 12, 12)
    msg = "output padding must be smaller than either stride or dilation"
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=msg):
            m(x)
        with pytest.raises(RuntimeError, match=msg):
            compile_(m)(x)


# --- test_conv_used_from_multiple_places -----------------------------------------------------


def test_conv_used_from_multiple_places():
    class M(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, (3, 3))

        def forward(self, x):
            res = F.relu(self.conv(x))
            return self.conv(res)

    for fmt in FORMATS.values():
        torch._dynamo.reset()
        check(M(3, 3).eval(), (torch.randn(1, 3, 32, 32).contiguous(memory_format=fmt),))


# --- transposed convolutions (may run as ATen ops inside the graph) --------------------------


@pytest.mark.parametrize("padding", [0, (0,)], ids=["int", "tuple1"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_conv_transpose2d_packed_cpu(batched, padding):
    mod = nn.Sequential(nn.ConvTranspose2d(3, 64, 3, 3, padding=padding)).eval()
    v = torch.randn([1, 3, 10, 10] if batched else [3, 10, 10])
    check(mod, (v,))


def test_conv_transpose2d_has_output_size_input():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose2d(in_channels=3, out_channels=1,
                                                     kernel_size=3, stride=1, padding=1)

        def forward(self, x):
            return self.conv_transpose(x, output_size=(10, 10))

    check(M().eval(), (torch.randn(1, 3, 10, 10),))


# --- test_set_source_Tensor: a conv whose forward masks its weight through .data -------------


class MaskedConv2d(nn.Conv2d):
    def __init__(self, *, in_channels, out_channels, kernel_size, padding=0):
        super().__init__(in_channels, out_channels, kernel_size, padding=padding)
        mask = torch.zeros_like(self.weight)
        mask[:, :, : kernel_size // 2, :] = 1
        mask[:, :, kernel_size // 2, : kernel_size // 2] = 1
        self.register_buffer("mask", mask)

    def forward(self, x):
        with torch.no_grad():
            self.weight.data *= self.mask
        return super().forward(x)


class PixelCnnStem(nn.Module):
    def __init__(self, num_channels):
        super().__init__()
        kernel_size = 7
        self.model = nn.Sequential(MaskedConv2d(in_channels=num_channels, out_channels=16,
                                                kernel_size=kernel_size,
                                                padding=(kernel_size - 1) // 2))

    def forward(self, x):
        x = x.permute(0, 3, 1, 2)  # NHWC data seen as NCHW: a channels-last-strided input
        return self.model(x)


def test_set_source_Tensor():
    model = PixelCnnStem(num_channels=4)
    eager = copy.deepcopy(model)
    v = (torch.rand(2, 16, 16, 4) > 0.5).to(torch.float32)
    with torch.no_grad():
        ref = eager(v.clone())
        y = compile_(model)(v.clone())
    assert_same(y, ref)
    conv, conv_ref = model.model[0], eager.model[0]
    assert torch.equal(conv.weight, conv_ref.weight), "the mask was applied to the parameter"
    assert torch.equal(conv.weight * (1 - conv.mask), torch.zeros_like(conv.weight))
    with torch.no_grad():  # a second call, on the already-masked weight
        assert_same(compile_(model)(v.clone()), eager(v.clone()))


# --- test_require_stride_order_non_owning: cat of channels-last inputs + conv on one ---------


def test_require_stride_order_non_owning():
    # Upstream draws the tensors inside the compiled function (fallback_random);
    # here they are inputs, so eager and compiled see the same values.
    def fn(x1, x2, conv_weight):
        cat_result = torch.cat([x1, x2], dim=1)
        x1_conv = F.conv2d(x1, conv_weight, padding=1)
        return cat_result, x1_conv

    x1 = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    x2 = torch.randn(2, 5, 4, 4).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    check(fn, (x1, x2, w))


# --- test_parallel_reduction_vectorization: conv -> (hardshrink) -> view -> mv --------------


@pytest.mark.parametrize("masked_tail", [True, False])
def test_parallel_reduction_vectorization(masked_tail):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, kernel_size=(1, 7), stride=(2, 1), padding=0)

        def forward(self, x, weight):
            x = self.conv(x)
            if not masked_tail:
                x = F.hardshrink(x, lambd=0)
            x = x.view(x.size(0), -1)
            return torch.mv(weight, x[0])

    x = torch.randn(2, 3, 15, 31)
    weight = torch.randn(10, 16 * 8 * 25)
    check(Model().eval(), (x, weight))


# --- test_non_contiguous_reduction_store -----------------------------------------------------


def test_non_contiguous_reduction_store():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(39, 1, kernel_size=(1, 17), stride=(2, 2))

        def forward(self, x):
            return self.conv(x.max(3).values)

    check(M().eval(), (torch.randn(1, 39, 1, 18, 17),))


# --- test_fused_attention_conv ---------------------------------------------------------------


def test_fused_attention_conv():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_conv = nn.Conv2d(4, 4, 1)
            self.k_conv = nn.Conv2d(4, 4, 1)
            self.v_conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            q = self.q_conv(x).permute(0, 2, 1, 3)
            k = self.k_conv(x).permute(0, 2, 1, 3)
            v = self.v_conv(x).permute(0, 2, 1, 3)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)

    check(Model().eval(), (torch.randn(1, 4, 2, 2),))


# --- test_nn_param_assign / test_nn_param_assign_wrapped -------------------------------------


class ParamAssign(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(in_channels=3, out_channels=5, kernel_size=3)
        self.batchnorm = nn.BatchNorm2d(num_features=5)
        self.conv_weight = torch.randn(5, 3, 3, 3)
        self.conv_bias = torch.randn(5)

    def forward(self, x):
        self.conv.weight = nn.Parameter(self.conv_weight)
        self.conv.bias = nn.Parameter(self.conv_bias, requires_grad=False)
        self.conv.eval()
        return F.relu(self.batchnorm(self.conv(x)))


@pytest.mark.parametrize("wrapped", [False, True], ids=["module", "wrapped"])
def test_nn_param_assign(wrapped):
    func = ParamAssign().train(False)
    fn = func
    if wrapped:
        @functools.wraps(func)
        def fn(*args, **kwargs):
            return func(*args, **kwargs)

    check(fn, (torch.randn(1, 3, 10, 10),), fullgraph=True)


# === From test/inductor/test_torchinductor.py (82bdbe7): convolutions and memory formats ===


class ToTuple(nn.Module):
    def forward(self, x):
        return (x,)


def test_convolution1():
    m = nn.Sequential(nn.Conv2d(5, 6, [3, 3]), nn.ReLU(), ToTuple()).eval()
    check(m, (torch.randn([2, 5, 16, 16]),))


def test_convolution2():
    def fn(x, w, b):  # a transposed conv1d through aten.convolution
        return (aten.convolution(x, w, b, [4], [0], [1], True, [0], 1),)

    check(fn, (torch.randn([2, 8, 20]), torch.randn([8, 4, 8]), torch.randn([4])))


def test_convolution3():
    # stride, padding and dilation given as one-element lists
    m = nn.Sequential(nn.Conv2d(5, 6, [3, 3], stride=[1], padding=[0], dilation=[1]),
                      nn.ReLU(), ToTuple()).eval()
    check(m, (torch.randn([2, 5, 16, 16]),))


@pytest.mark.parametrize("which", ["weight", "activation", "both"])
@pytest.mark.parametrize("dim", [2, 3], ids=["conv2d", "conv3d"])
def test_conv_channels_last(dim, which):
    # test_conv2d_channels_last / test_conv3d_channels_last: only the weight, only
    # the activation, or both in channels-last.
    conv = nn.Conv2d(3, 3, 1, 1) if dim == 2 else nn.Conv3d(3, 3, 1, 1)
    cl = torch.channels_last if dim == 2 else torch.channels_last_3d
    m = nn.Sequential(conv, ToTuple()).eval()
    x = torch.randn([2, 3, 16, 16] if dim == 2 else [2, 3, 6, 8, 8])
    if which in ("weight", "both"):
        m = m.to(memory_format=cl)
    if which in ("activation", "both"):
        x = x.to(memory_format=cl)
    check(m, (x,))


@pytest.mark.parametrize("in_format", list(FORMATS))
def test_conv1d_channels_last_input(in_format):
    # A conv1d fed a (N, L, C) tensor transposed to (N, C, L): the 1-d analogue
    # of a channels-last activation (upstream covers conv1d only through
    # test_conv1d_strided_weight_torch_compile above).
    m = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 20, 8)
    x = x.transpose(1, 2) if in_format == "channels_last" else x.transpose(1, 2).contiguous()
    check(m, (x,))


def test_alexnet_prefix():
    from torch._dynamo.testing import rand_strided

    def forward(arg6, arg7, arg16):
        convolution = aten.convolution(arg16, arg7, arg6, [4, 4], [2, 2], [1, 1], False,
                                       [0, 0], 1)
        relu = aten.relu(convolution)
        return (aten.max_pool2d_with_indices(relu, [3, 3], [2, 2])[0],)

    check(forward, (rand_strided((64,), (1,), torch.float32, "cpu"),
                    rand_strided((64, 3, 11, 11), (363, 121, 11, 1), torch.float32, "cpu"),
                    rand_strided((2, 3, 63, 63), (11907, 3969, 63, 1), torch.float32, "cpu")))
