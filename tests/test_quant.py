"""INT8: PT2E-quantized graphs on the int8 conv and pool (cpu_layout/quant, csrc/qconv.cpp, csrc/qpool.cpp).

Reference: the same computation in eager PyTorch (the quantized graph run as it is, or
QConv.reference, which follows quantized_decomposed's formulas). An int8 result may sit
one quantization step from eager's where the float value lands on a rounding boundary
(oneDNN sums in int32 and rescales once; eager sums dequantized floats)."""
import warnings

import pytest
import torch
import torch.nn as nn

from cpu_layout.quant import ops as qops
from cpu_layout.quant.ops import QConv, QLinear, QMaxPool, SymmetricWeight, channels_last

U8, S8 = torch.uint8, torch.int8


def _rand_q(size, dtype, cl=True):
    lo, hi = (0, 256) if dtype is U8 else (-128, 128)
    t = torch.randint(lo, hi, size, dtype=dtype)
    return channels_last(t) if cl else t


def _assert_int8_close(y, ref):
    """At most one quantization step apart, on at most 1% of the values."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    d = (y.int() - ref.int()).abs()
    assert d.max().item() <= 1, d.max()
    assert (d > 0).float().mean().item() <= 0.01


CASES = [  # ic, oc, k, stride, pad, groups, post_ops, out dtype, x zero point
    (16, 32, 3, 1, 1, 1, ("relu",), U8, 0),
    (16, 32, 3, 1, 1, 1, (), U8, 7),
    (32, 32, 3, 2, 1, 32, (("clamp", 0.0, 6.0),), U8, 0),  # depthwise, relu6
    (24, 48, 3, 1, 1, 4, ("hardswish",), S8, 3),             # grouped, signed output
    (16, 64, 1, 1, 0, 1, ("add", "relu"), U8, 0),            # residual add as oneDNN's sum
    (16, 64, 1, 2, 0, 1, ("add",), U8, 5),
    (3, 16, 7, 2, 3, 1, ("relu",), U8, 120),                 # a stem on an NCHW input
    (16, 8, 1, 1, 0, 1, ("silu",), torch.float32, 0),        # dequantized output
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-k{c[2]}s{c[3]}g{c[5]}-{c[7]}-{'+'.join(map(str, c[6]))}"
                                             for c in CASES])
def test_qconv_matches_the_dequantized_conv(case):
    ic, oc, k, s, p, g, post, od, xzp = case
    x = _rand_q((2, ic, 15, 13), U8, cl=ic != 3)
    w = torch.randint(-128, 128, (oc, ic // g, k, k), dtype=S8)
    ws, wz, b = torch.rand(oc) * 0.01 + 1e-3, torch.zeros(oc, dtype=torch.int64), torch.randn(oc)
    q = QConv((s, s), (p, p), (1, 1), g, 0.02, xzp, U8, od, 0.05, 3 if od in (U8, S8) else 0, post, 0.04, 7)
    oh, ow = (15 + 2 * p - k) // s + 1, (13 + 2 * p - k) // s + 1
    r = _rand_q((2, oc, oh, ow), od) if "add" in post else None
    y = q(x, w, ws, b, r)
    ref = q.reference(x, w, ws, wz, b, r)
    assert y.stride() == channels_last(torch.empty(y.shape)).stride()
    if od in (U8, S8):
        _assert_int8_close(y, ref)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert "ref" not in q.impl_name(x, w)


@pytest.mark.parametrize("out", [torch.float32, U8], ids=["dequantized", "requantized"])
def test_qlinear_matches_the_dequantized_linear(out):
    x = _rand_q((37, 48), U8, cl=False)
    w = torch.randint(-128, 128, (20, 48), dtype=S8)
    ws, b = torch.rand(20) * 0.01 + 1e-3, torch.randn(20)
    q = QLinear(0.02, 9, U8, out, 0.05, 4, ("gelu",))
    y = q(x, w, ws, b)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear((x.float() - 9) * 0.02, w.float() * ws[:, None], b))
    assert y.shape == (37, 20) and y.is_contiguous()
    if out is U8:
        _assert_int8_close(y, qops.quantize(ref, 0.05, 4, U8))
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [U8, S8])
@pytest.mark.parametrize("cl", [True, False], ids=["nhwc", "nchw"])
def test_generated_quantize_and_dequantize_match_the_decomposed_ops(dtype, cl):
    """The element-wise ops "quant" and "dequant" in a generated kernel (what a graph's
    quantize and dequantize nodes become), against torch's own quantized_decomposed ops."""
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed)

    from cpu_layout.codegen import expr as E
    from cpu_layout.codegen.cpp_kernels import PointwiseKernel

    qd = torch.ops.quantized_decomposed
    lo, hi = (0, 255) if dtype is U8 else (-128, 127)
    scale, zp = 0.037, 3 if dtype is U8 else -2
    x = torch.randn(2, 8, 5, 7) * 3
    x.view(-1)[:200] = (torch.arange(200, dtype=torch.float32) - 100 + 0.5) * scale  # ties: half to even
    x.view(-1)[200:204] = torch.tensor([1e30, -1e30, 1e9, -1e9])
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    quant = PointwiseKernel([torch.float32], [(E.Op("quant", (E.Load(0),), (scale, zp, lo, hi)), dtype)], 4).compile()
    q = torch.empty_like(x, dtype=dtype)
    quant(tuple(x.shape), [x], [q])
    assert torch.equal(q, qd.quantize_per_tensor(x, scale, zp, lo, hi, dtype))
    # dequantize -> relu -> quantize again: one kernel, int8 in and out
    chain = E.Op("quant", (E.Op("relu", (E.Op("dequant", (E.Load(0),), (scale, zp)),)),), (0.05, 1, lo, hi))
    requant = PointwiseKernel([dtype], [(chain, dtype), (E.Op("dequant", (E.Load(0),), (scale, zp)), torch.float32)],
                              4).compile()
    r, y = torch.empty_like(q), torch.empty_like(q, dtype=torch.float32)
    requant(tuple(q.shape), [q], [r, y])
    deq = qd.dequantize_per_tensor(q, scale, zp, lo, hi, dtype)
    assert torch.equal(y, deq)
    assert torch.equal(r, qd.quantize_per_tensor(torch.relu(deq), 0.05, 1, lo, hi, dtype))


def test_qconv_repacks_a_weight_changed_in_place():
    x = _rand_q((1, 16, 8, 8), U8)
    w = torch.randint(-128, 128, (32, 16, 3, 3), dtype=S8)
    ws, wz = torch.full((32,), 0.01), torch.zeros(32, dtype=torch.int64)
    q = QConv((1, 1), (1, 1), (1, 1), 1, 0.02, 0, U8, torch.float32)
    before = q(x, w, ws)
    w.copy_(torch.randint(-128, 128, w.shape, dtype=S8))
    after = q(x, w, ws)
    torch.testing.assert_close(after, q.reference(x, w, ws, wz, None), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(before, after)


def test_asymmetric_int8_weights_are_refused_with_the_reason():
    w = torch.randint(-128, 128, (8, 8, 1, 1), dtype=S8)
    with pytest.raises(ValueError, match="zero points are not all 0"):
        SymmetricWeight("conv_3")(w, torch.arange(8))
    assert SymmetricWeight("conv_3")(w, torch.zeros(8, dtype=torch.int64)) is w


def test_qconv_rejects_bad_input_with_a_reason():
    q = QConv((1, 1), (0, 0), (1, 1), 1, 0.02, 0, U8, U8, 0.05, 0)
    w, ws = torch.zeros(8, 4, 1, 1, dtype=S8), torch.ones(8)
    with pytest.raises(TypeError, match="uint8"):
        q(torch.zeros(1, 4, 3, 3), w, ws)
    with pytest.raises(ValueError, match="channels"):
        q(torch.zeros(1, 5, 3, 3, dtype=U8), w, ws)
    with pytest.raises(RuntimeError, match="scales must be positive"):
        QConv((1, 1), (0, 0), (1, 1), 1, -1.0, 0, U8, U8, 0.05, 0)(torch.zeros(1, 4, 3, 3, dtype=U8), w, ws)


def test_the_int8_conv_checks_its_geometry_as_the_float_conv_does():
    """The C ABI refuses an output size that does not follow from the input (the float
    convs' one geometry check), here a kernel wider than the padded input."""
    from cpu_layout._native import ffi, lib

    a = ffi.new("cl_qconv_args *")
    a.nsp, a.src_dt, a.dst_dt, a.n, a.ic, a.oc, a.groups = 2, lib.CL_U8, lib.CL_U8, 1, 4, 4, 1
    # (3 - 4) // 2 + 1 == 1 in C's truncating division: only the padded-span check refuses it
    a.in_sp[0:2], a.k_sp[0:2], a.out_sp[0:2] = [3, 3], [4, 4], [1, 1]
    a.stride[0:2], a.dilation[0:2] = [2, 2], [1, 1]
    buf = ffi.new("char[]", 256)
    assert lib.cl_qconv_impl_name(a, buf, 256) == 1
    assert "int8 conv: output size 1 in spatial dim 0 does not follow" in ffi.string(lib.cl_last_error()).decode()


@pytest.mark.parametrize("cl", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("ceil", [False, True], ids=["floor", "ceil"])
@pytest.mark.parametrize("dtype", [U8, S8])
def test_qmax_pool_matches_atens_float_pool(cl, ceil, dtype):
    x = _rand_q((2, 24, 29, 30), dtype, cl=cl)
    y = QMaxPool([3, 3], [2, 2], [1, 1], [1, 1], ceil)(x)
    ref = torch.nn.functional.max_pool2d(x.float(), 3, 2, 1, 1, ceil_mode=ceil).to(dtype)
    assert torch.equal(y, ref)
    assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


# ---- whole graphs from PT2E --------------------------------------------------------


class _Net(nn.Module):
    """A stem, max pool, a residual block with ReLU, a depthwise-separable block with a
    residual add and no activation, an inception-style cat, an average pool, a pre-activation batch norm, hardswish, the classifier head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.c1 = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1), nn.BatchNorm2d(16))
        self.relu = nn.ReLU()
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU6())
        self.pw = nn.Sequential(nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16))
        self.ba = nn.Sequential(nn.Conv2d(16, 8, 1), nn.ReLU())
        self.bb = nn.Sequential(nn.Conv2d(16, 8, 3, 1, 1), nn.ReLU())
        self.pre = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU())  # DenseNet's pre-activation
        self.hs = nn.Sequential(nn.Conv2d(16, 32, 1), nn.Hardswish())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(self.stem(x))
        x = self.relu(self.c2(self.c1(x)) + x)
        x = self.pw(self.dw(x)) + x
        x = torch.cat([self.ba(x), self.bb(x)], 1)
        x = self.hs(self.pre(nn.functional.avg_pool2d(x, 2)))  # float ops between int8 ops
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _quantized(model, example, calib):
    pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    from cpu_layout import zoo

    return zoo.quantize_pt2e(model, example, calib)


@pytest.fixture(scope="module")
def quantized_net():
    torch.manual_seed(0)
    model = _Net().eval()
    calib = [torch.randn(2, 3, 32, 32) for _ in range(4)]
    return model, _quantized(model, calib[0], calib)


def _rel_rms(y, ref):
    return ((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_pt2e_model_runs_its_convs_in_int8(quantized_net, cpp, mode, strict_compile, compiled_graphs):
    from cpu_layout import ir, runtime

    model, qm = quantized_net
    x = torch.randn(2, 3, 32, 32)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        fp32, eager_q = model(x), qm(x)
        compiled = torch.compile(qm, backend="cpu_layout", options={"cpp_wrapper": cpp})
        y = compiled(x)
        copies = qops.COPIES["count"] + runtime.COPIES["count"]
        y2 = compiled(x)
    # int8 tensors stay channels-last between int8 ops: one layout copy per call, of the
    # quantized NCHW input (the wrapper's conversions and the int8 ops' own counted).
    assert qops.COPIES["count"] + runtime.COPIES["count"] - copies == 1
    assert y.shape == eager_q.shape and y.stride() == eager_q.stride() and y.dtype == eager_q.dtype
    assert torch.equal(y, y2)
    # As accurate as the quantized graph run eagerly (against the float model), and close to it.
    assert _rel_rms(y, fp32) <= 1.1 * _rel_rms(eager_q, fp32) + 1e-3
    assert _rel_rms(y, eager_q) <= 0.05
    # Every conv and the linear ran in int8, the max pool and the cat on int8 tensors;
    # in the C++ wrapper all of them inside segments, none as a Python node between them.
    graph = compiled_graphs[-1].cpu_layout_graph
    top = [n for n in graph.nodes if isinstance(n, ir.Aten)]
    members = [m for n in graph.nodes if isinstance(n, ir.Segment) for m in n.members]
    kinds = [type(n.target).__name__ for n in top + [m for m in members if isinstance(m, ir.Aten)]]
    assert kinds.count("QConv") == 8, kinds
    calls = [n.target for n in top + [m for m in members if isinstance(m, ir.Aten)]]
    assert sum("add" in c.post_ops for c in calls if type(c).__name__ == "QConv") == 2  # both residuals fused
    assert kinds.count("QMaxPool") == 1 and kinds.count("QCat") == 1 and kinds.count("QLinear") == 1
    if cpp:
        assert not [n for n in top if type(n.target).__name__ in ("QConv", "QMaxPool", "QCat")]
    # The pre-activation batch norm and ReLU between two int8 convs: dequantize, the float ops
    # and quantize in one kernel that writes uint8.
    kernels = [str(k.expr) for k in graph.nodes + members if isinstance(k, ir.Kernel) and k.out.dtype is torch.uint8]
    assert [e for e in kernels if e.startswith("quant(relu(") and "dequant(" in e], kernels
    assert not [n for n in graph.nodes + members if isinstance(n, ir.Conv) and len(n.weight.size) == 4
                and n.weight.size[2] > 1]


def _int8_state(qm, dtype, dim):
    return [t for t in qm.state_dict(keep_vars=True).values() if t.dtype is dtype and t.dim() == dim]


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_a_weight_changed_in_place_reaches_the_compiled_int8_model(quantized_net, cpp, strict_compile):
    _model, qm = quantized_net
    x = torch.randn(2, 3, 32, 32)
    w = _int8_state(qm, torch.int8, 4)[1]
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            compiled = torch.compile(qm, backend="cpu_layout", options={"cpp_wrapper": cpp})
            before = compiled(x)
            w.copy_(torch.randint(-128, 128, w.shape, dtype=torch.int8))
            y, ref = compiled(x), qm(x)
        assert _rel_rms(y, ref) <= 0.05 and _rel_rms(before, ref) > 0.1
    finally:
        with torch.no_grad():
            w.copy_(saved)


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_asymmetric_weights_in_a_compiled_graph_raise_the_reason(quantized_net, cpp, strict_compile):
    _model, qm = quantized_net
    x = torch.randn(2, 3, 32, 32)
    zps = [t for t in _int8_state(qm, torch.int64, 1) if t.numel() > 1]
    assert zps
    try:
        with torch.no_grad():
            compiled = torch.compile(qm, backend="cpu_layout", options={"cpp_wrapper": cpp})
            compiled(x)
            zps[0].fill_(3)
            with pytest.raises(ValueError, match="zero points are not all 0"):
                compiled(x)
    finally:
        with torch.no_grad():
            zps[0].zero_()


def test_unfused_quantization_is_named_under_the_plan_log(quantized_net, monkeypatch, capfd, strict_compile):
    monkeypatch.setenv("CPU_LAYOUT_LOG", "plan")
    _model, qm = quantized_net
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback of the whole graph
        torch.compile(qm, backend="cpu_layout")(torch.randn(2, 3, 32, 32))
    err = capfd.readouterr().err
    assert "cpu_layout: int8: 11 patterns rewritten" in err
    assert "quantize/dequantize nodes as element-wise ops, 0 left as ATen ops" in err
