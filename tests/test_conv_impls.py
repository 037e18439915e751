"""A channels-last conv runs on cpu_layout's oneDNN (its first or next
implementation), on cpu_layout's Winograd kernel or on torch's bundled oneDNN,
whichever was measured faster (plan/measure.py, schedule.choose_conv_impls).
Every candidate must give eager's values and strides in both wrappers, follow
weight changes, and run from several threads; CPU_LAYOUT_CONV_IMPL forces one."""
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_layout import ir, ops
from cpu_layout._native import ffi
from cpu_layout.plan import measure

IMPLS = ["onednn", "onednn_next", "aten", "winograd"]
MODES = [False, True]


class Mixed(nn.Module):
    """conv+BN+SiLU, depthwise+hardswish, strided+ReLU6, two residual convs (not
    torch's): a 3x3 stride-1 one (Winograd's) and a 1x1."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 32, 1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.c2 = nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1)
        self.c3 = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        y = F.silu(self.bn(self.c1(x)))
        y = F.hardswish(self.dw(y))
        y = F.relu6(self.c2(y))
        y = F.relu(self.c4(y) + y)
        return F.relu(self.c3(y) + y)


def _model(cls=Mixed):
    """The model in eval mode, its batch-norm's statistics non-trivial."""
    m = cls().eval()
    m.bn.running_mean.uniform_(-0.5, 0.5)
    m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _compile(model, cpp):
    torch._dynamo.reset()
    return torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})


def _runs_as_eager(model, cpp, amp, grad_mode):
    """Compiled, over batches 2, 2, 3 (a static graph, then a dynamic one): eager's
    sizes, strides and values (bf16 tolerance under autocast)."""
    mode = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    fn = _compile(model, cpp)
    with mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        for n in (2, 2, 3):
            x = torch.randn(n, 8, 12, 12)
            y, ref = fn(x), model(x)
            assert y.shape == ref.shape and y.stride() == ref.stride()
            tol = 5e-2 if amp else 1e-4
            torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)


def _impls(graph):
    """The impl of each conv of one compiled graph (inside segments in cpp_wrapper mode)."""
    nodes = graph.cpu_layout_graph.nodes
    members = [m for n in nodes if isinstance(n, ir.Segment) for m in n.members] + list(nodes)
    return sorted(m.impl + (f":{m.impl_rank}" if m.impl_rank else "")
                  for m in members if isinstance(m, ir.Conv))


@pytest.mark.parametrize("post_ops, ref", [
    ([], lambda t: t),
    (["relu"], F.relu),
    (["silu"], F.silu),
    (["hardswish"], F.hardswish),
    (["sigmoid"], torch.sigmoid),
    (["tanh"], torch.tanh),
    (["gelu"], F.gelu),
    (["gelu_tanh"], lambda t: F.gelu(t, approximate="tanh")),
    (["relu6"], F.relu6),
    ([("clamp", -1.0, 2.0)], lambda t: t.clamp(-1.0, 2.0)),
    ([("leaky_relu", 0.2)], lambda t: F.leaky_relu(t, 0.2)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_conv_fuses_each_post_op_it_is_offered_for(post_ops, ref, dtype):
    x = torch.randn(2, 16, 9, 9).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(16, 4, 3, 3) * 0.3).to(dtype)
    b = torch.randn(16).to(dtype)
    attr = ops.aten_conv_attr(post_ops)
    y = ops.aten_conv2d(x, w, b, (1, 1), (1, 1), (1, 1), 4, attr)
    want = ref(F.conv2d(x.float(), w.float(), b.float(), 1, 1, 1, 4))
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)


def test_post_ops_torchs_conv_cannot_fuse_keep_it_out():
    assert ops.aten_conv_attr(["relu", "silu"]) is None
    assert ops.aten_conv_attr([("add", object())]) is None
    assert ops.aten_conv_attr([("clamp", float("-inf"), 1.0)]) is None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cpp", MODES, ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_each_candidate_gives_eagers_values_and_strides(impl, cpp, amp, grad_mode, monkeypatch, compiled_graphs):
    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", impl)
    _runs_as_eager(_model(), cpp, amp, grad_mode)
    assert len(compiled_graphs) == 2  # batch 2, then a dynamic batch
    native = bool(ops.lib.cl_native_bf16())
    wino = f"onednn:{ops.WINOGRAD}" if native or not amp else "onednn"  # bf16 only where native
    for g in compiled_graphs:
        # The residual convs (two post-ops: add, relu) stay on ours whatever is forced.
        want = {"aten": ["aten"] * 3 + ["onednn"] * 2, "onednn_next": ["onednn"] * 4 + ["onednn:1"],
                "onednn": ["onednn"] * 5,  # onednn_next: the depthwise conv; winograd: the 3x3 stride-1 one
                "winograd": sorted(["onednn"] * 4 + [wino])}[impl]
        assert _impls(g) == want


@pytest.mark.parametrize("impl", ["onednn_next", "aten", "winograd"])
@pytest.mark.parametrize("cpp", MODES, ids=["py", "cpp"])
def test_each_candidate_follows_weight_changes(cpp, impl, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", impl)
    model = _model()
    fn = _compile(model, cpp)
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        fn(x)
        model.dw.weight.mul_(-2.0)                # in place
        model.c4.weight.mul_(-0.5)
        model.bn.running_var.add_(1.0)            # a folded source
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
        model.c2.weight = nn.Parameter(torch.randn_like(model.c2.weight))  # replaced
        model.c4.weight = nn.Parameter(torch.randn_like(model.c4.weight) * 0.1)
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["onednn_next", "aten", "winograd"])
@pytest.mark.parametrize("cpp", MODES, ids=["py", "cpp"])
def test_each_candidate_runs_from_several_threads(cpp, impl, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", impl)
    model = _model()
    fn = _compile(model, cpp)
    xs = [torch.randn(2, 8, 12, 12) for _ in range(4)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
        fn(xs[0])
    errors = []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(5):
                    torch.testing.assert_close(fn(xs[i]), refs[i], rtol=1e-4, atol=1e-4)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_measured_faster_candidate_is_chosen_beyond_the_margin():
    beyond = 80.0 * (1 - measure.ATEN_MARGIN) - 1.0
    within = 80.0 * (1 - measure.ATEN_MARGIN) + 1.0
    assert measure.measured_cost([100.0, 80.0, beyond]).nhwc_impl == "aten"
    assert measure.measured_cost([100.0, 80.0, beyond]).nhwc_us == beyond
    assert measure.measured_cost([100.0, 80.0, within]).nhwc_impl == "onednn", "within the margin: ours"
    assert measure.measured_cost([100.0, 80.0, None]).nhwc_impl == "onednn"
    assert measure.measured_cost([100.0, 80.0]).nhwc_impl == "onednn", "an entry from before the candidate"
    assert f"torch's oneDNN NHWC {beyond:.0f} us" in measure.measured_cost([100.0, 80.0, beyond]).source


def test_onednns_next_implementation_is_chosen_beyond_its_margin():
    nxt = 80.0 * (1 - measure.NEXT_MARGIN) - 1.0
    cost = measure.measured_cost([100.0, 80.0, None, nxt])
    assert (cost.nhwc_impl, cost.nhwc_rank, cost.nhwc_us) == ("onednn", 1, nxt)
    assert "next implementation" in cost.source
    assert measure.measured_cost([100.0, 80.0, None, 80.0 * (1 - measure.NEXT_MARGIN) + 1.0]).nhwc_rank == 0
    assert measure.measured_cost([100.0, 80.0, None, None]).nhwc_rank == 0
    # torch's must beat the better of ours by its own margin
    aten_wins = nxt * (1 - measure.ATEN_MARGIN) - 1.0
    assert measure.measured_cost([100.0, 80.0, aten_wins, nxt]).nhwc_impl == "aten"
    assert measure.measured_cost([100.0, 80.0, nxt * (1 - measure.ATEN_MARGIN) + 1.0, nxt]).nhwc_rank == 1


def test_winograd_is_chosen_beyond_its_margin():
    wino = 80.0 * (1 - measure.WINOGRAD_MARGIN) - 1.0
    cost = measure.measured_cost([100.0, 80.0, None, None, wino])
    assert (cost.nhwc_impl, cost.nhwc_rank, cost.nhwc_us) == ("onednn", ops.WINOGRAD, wino)
    assert "Winograd" in cost.source
    assert measure.measured_cost([100.0, 80.0, None, None, 80.0 * (1 - measure.WINOGRAD_MARGIN) + 1.0]).nhwc_rank == 0
    assert measure.measured_cost([100.0, 80.0, None, None, None]).nhwc_rank == 0


@pytest.mark.parametrize("n, c, k, h, w", [(1, 64, 64, 14, 14), (2, 5, 7, 7, 9), (3, 16, 24, 1, 1),
                                           (1, 32, 48, 2, 3), (2, 17, 33, 6, 5)])
@pytest.mark.parametrize("post_ops", [[], ["relu"], [("leaky_relu", 0.1)], ["relu6"], [("clamp", -0.5, 0.7)],
                                      ["add", "relu"], ["relu", "add"], ["add", "add"]])
@pytest.mark.parametrize("bias", [True, False])
def test_winograd_gives_the_direct_convs_values(n, c, k, h, w, post_ops, bias):
    gen = torch.Generator().manual_seed(n * 1000 + c * 10 + h)
    x = torch.randn(n, c, h, w, generator=gen).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(k, c, 3, 3, generator=gen) * 0.2
    b = torch.randn(k, generator=gen) if bias else None
    res = [torch.randn(n, k, h, w, generator=gen).contiguous(memory_format=torch.channels_last)
           for p in post_ops if p == "add"]
    it = iter(res)
    post = [("add", next(it)) if p == "add" else p for p in post_ops]
    it = iter(res)
    ref = F.conv2d(x, wt, b, padding=1)
    for p in post_ops:
        name = p if isinstance(p, str) else p[0]
        ref = {"relu": F.relu, "relu6": F.relu6, "add": lambda t: t + next(it),
               "leaky_relu": lambda t: F.leaky_relu(t, 0.1), "clamp": lambda t: t.clamp(-0.5, 0.7)}[name](ref)
    for w_layout in (torch.contiguous_format, torch.channels_last):  # OIHW or OHWI weights
        y = ops.conv2d(x, wt.contiguous(memory_format=w_layout), b, padding=1, post_ops=post, out_layout="nhwc",
                       impl_rank=ops.WINOGRAD)
        assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ops.lib.cl_native_bf16(), reason="bf16 Winograd needs native bf16")
@pytest.mark.parametrize("n, c, k, h, w", [(1, 64, 64, 14, 14), (2, 5, 7, 7, 9), (2, 17, 33, 6, 5)])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, None])
def test_winograd_in_bfloat16_is_as_close_to_exact_as_eagers_bf16_conv(n, c, k, h, w, bias_dtype):
    # Transformed in float32, rounded once for the products, accumulated in float32: the
    # error against float64 stays within 2x eager's own bf16 conv (measured 1.2x).
    gen = torch.Generator().manual_seed(n + c + k)
    x = torch.randn(n, c, h, w, generator=gen).contiguous(memory_format=torch.channels_last).bfloat16()
    wt = (torch.randn(k, c, 3, 3, generator=gen) / (3 * c ** 0.5)).bfloat16()
    b = None if bias_dtype is None else torch.randn(k, generator=gen).to(bias_dtype)
    res = torch.randn(n, k, h, w, generator=gen).contiguous(memory_format=torch.channels_last).bfloat16()
    exact = F.relu(F.conv2d(x.double(), wt.double(), None if b is None else b.double(), padding=1) + res.double())
    y = ops.conv2d(x, wt, b, padding=1, post_ops=[("add", res), "relu"], out_layout="nhwc", impl_rank=ops.WINOGRAD)
    eager = F.relu(F.conv2d(x, wt, None if b is None else b.bfloat16(), padding=1) + res)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)

    def rms(t):
        return ((t.double() - exact) ** 2).mean().sqrt().item()

    assert rms(y) <= 2 * rms(eager) + 1e-6
    torch.testing.assert_close(y.float(), exact.float(), rtol=3e-2, atol=3e-2)


def test_winograd_over_several_blocks_of_tiles_gives_the_direct_convs_values():
    # 512 in and out channels: 64 KiB of scratch per tile, so 24x24 tiles run in two
    # blocks (csrc/winograd.h, SCRATCH_BYTES), the second padded past the last tile.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 512, 48, 48, generator=gen).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(512, 512, 3, 3, generator=gen) * 0.02
    res = torch.randn(1, 512, 48, 48, generator=gen).contiguous(memory_format=torch.channels_last)
    y = ops.conv2d(x, wt, padding=1, post_ops=[("add", res), "relu"], out_layout="nhwc", impl_rank=ops.WINOGRAD)
    torch.testing.assert_close(y, F.relu(F.conv2d(x, wt, padding=1) + res), rtol=1e-5, atol=2e-5)


def test_winograd_refuses_what_it_cannot_run_with_the_reason():
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3)
    assert ops.winograd_candidate(torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 1, ["relu", "add"])
    assert ops.winograd_candidate(torch.bfloat16, (3, 3), (1, 1), (1, 1), (1, 1), 1, []) == bool(
        ops.lib.cl_native_bf16())
    assert not ops.winograd_candidate(torch.float32, (3, 3), (2, 2), (1, 1), (1, 1), 1, [])
    assert not ops.winograd_candidate(torch.float32, (3, 3), (1, 1), (1, 1), (1, 1), 1, ["silu"])
    for kw, why in [(dict(stride=2, padding=1), "stride 1"), (dict(padding=0), "padding 1"),
                    (dict(padding=1, post_ops=["silu"]), "ReLU, clamp"),
                    (dict(padding=1, out_layout="nchw"), "channels-last")]:
        with pytest.raises(ValueError, match=why):
            ops.conv2d(x, w, impl_rank=ops.WINOGRAD, **{"out_layout": "nhwc", **kw})
    if not ops.lib.cl_native_bf16():
        with pytest.raises(ValueError, match="native bf16"):
            ops.conv2d(x.bfloat16(), w.bfloat16(), padding=1, out_layout="nhwc", impl_rank=ops.WINOGRAD)
    assert "winograd" in ops.impl_name(x, w, padding=1, out_layout="nhwc", impl_rank=ops.WINOGRAD)


def test_winograd_is_timed_for_the_convs_it_can_run():
    from cpu_layout.plan import graph as pg

    def conv(dtype=torch.float32, k=3, post_ops=("relu", "add")):
        return pg.Conv("c", (), (1, 16, 10, 10), dtype, in_size=(1, 16, 10, 10), out_channels=16,
                       kernel=(k, k), stride=(1, 1), padding=(k // 2, k // 2), dilation=(1, 1), groups=1,
                       post_ops=post_ops)

    assert measure._measure(conv(), rounds=1)[4] > 0
    assert (measure._measure(conv(dtype=torch.bfloat16), rounds=1)[4] is None) != bool(ops.lib.cl_native_bf16())
    assert measure._measure(conv(dtype=torch.float32, post_ops=("relu",)), rounds=1)[4] > 0
    assert measure._measure(conv(k=1), rounds=1)[4] is None
    assert measure._measure(conv(post_ops=("silu",)), rounds=1)[4] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_implementation_rank_gives_the_same_conv(dtype):
    x = torch.randn(2, 32, 14, 14).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(32, 1, 3, 3) * 0.3).to(dtype)
    b = torch.randn(32).to(dtype)
    kw = dict(stride=1, padding=1, groups=32, post_ops=["relu"], out_layout="nhwc")
    ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), 1, 1, 1, 32))
    names = [ops.impl_name(x, w, b, impl_rank=r, **kw) for r in range(9)]
    assert names[8] == names[0], "a rank beyond oneDNN's list runs its first implementation"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for r in range(9):
        y = ops.conv2d(x, w, b, impl_rank=r, **kw)
        assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="impl_rank"):
        ops.conv2d(x, w, b, impl_rank=9, **kw)


def test_torchs_conv_is_timed_for_grouped_convs_only():
    """Dense convs are not offered to torch's oneDNN (it never won on them)."""
    from cpu_layout.plan import graph as pg

    def conv(groups):
        return pg.Conv("c", (), (1, 16, 8, 8), torch.float32, in_size=(1, 16, 8, 8), out_channels=16,
                       kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=groups,
                       post_ops=("relu",))

    dense, depthwise = measure._measure(conv(1)), measure._measure(conv(16))
    assert dense[2] is None and dense[3] is None and dense[0] > 0 and dense[1] > 0
    assert depthwise[2] is not None and depthwise[2] > 0
    assert depthwise[3] is None or depthwise[3] > 0  # oneDNN's next implementation, when it has one


@pytest.mark.parametrize("faster", [True, False])
def test_the_plan_runs_a_conv_where_it_measured_faster(faster, monkeypatch, compiled_graphs, tmp_path):
    monkeypatch.setenv("CPU_LAYOUT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CPU_LAYOUT_CONV_IMPL", raising=False)
    monkeypatch.delenv("CPU_LAYOUT_AUTOTUNE", raising=False)
    monkeypatch.setattr(measure, "_DEFAULT", None)  # a fresh model: this test's timings
    monkeypatch.setattr(measure, "_measure",
                        lambda conv: [100.0, 50.0, 20.0 if faster else 60.0 if conv.groups > 1 else None])
    model = _model()
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(_compile(model, True)(x), model(x), rtol=1e-4, atol=1e-4)
    assert _impls(compiled_graphs[0]) == (["aten"] * 3 + ["onednn"] * 2 if faster else ["onednn"] * 5)


def test_an_unknown_conv_impl_setting_is_an_error(monkeypatch):
    from cpu_layout import config

    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", "fastest")
    with pytest.raises(ValueError, match="CPU_LAYOUT_CONV_IMPL"):
        config.conv_impl()


def test_an_error_in_torchs_conv_inside_a_segment_is_a_python_exception():
    from cpu_layout import runtime as R
    from cpu_layout.codegen import program

    p = program.Program()
    p.n_in = 2
    x, w, out = p.reg(), p.reg(), p.reg()
    p.op("ATEN_CONV", out, x, w, -1, [1, 1], [1, 1], [1, 1], 1, p.name("relu"), 0, [], -1, p.name("conv7"))
    p.op("OUT", 0, out)
    call = R.SegmentCall("aten", 1)
    call.bind(p, [])
    pack = program.runtime().ffi.new("int64_t[]", [0])
    xs = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(4, 8, 3, 3)
    (y,) = call([xs, wt], pack)
    torch.testing.assert_close(y, F.relu(F.conv2d(xs, wt, padding=1)), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="conv7"):
        call([xs, torch.randn(4, 5, 3, 3)], pack)  # 8 input channels, a weight for 5
    (y,) = call([xs, wt], pack)  # and the segment still works afterwards
    assert y.shape == (1, 4, 6, 6)


# ---- grouped convs with their groups merged (impl_rank MERGE_GROUPS + m) ------------

class Grouped(nn.Module):
    """ResNeXt-like: groups of 4 and of 8 input channels (merge candidates), a residual."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 32, 1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.g4 = nn.Conv2d(32, 32, 3, padding=1, groups=8)
        self.g8 = nn.Conv2d(32, 64, 3, stride=2, padding=1, groups=4, bias=False)
        self.c3 = nn.Conv2d(64, 64, 1)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = F.relu(self.g4(y))
        y = F.silu(self.g8(y))
        return F.relu(self.c3(y) + y)


def test_merge_candidates_widen_narrow_groups_only():
    f32 = torch.float32
    assert ops.merge_candidates(f32, 128, 128, 32) == (4, 8)    # 4 channels a group -> 16, 32
    assert ops.merge_candidates(f32, 256, 256, 32) == (2, 4)    # 8 -> 16, 32
    assert ops.merge_candidates(f32, 32, 64, 4) == (2, 4)       # 8 in, 16 out: the narrower side
    assert ops.merge_candidates(f32, 48, 48, 12) == (4,)        # 4 -> 16 (12 has no factor 8)
    assert ops.merge_candidates(f32, 512, 512, 32) == ()        # 16 already
    assert ops.merge_candidates(f32, 64, 64, 64) == ()          # depthwise
    assert ops.merge_candidates(f32, 64, 64, 1) == ()
    assert ops.merge_candidates(torch.float16, 128, 128, 32) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_cl", [False, True], ids=["w_oihw", "w_ohwi"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_merged_groups_give_the_grouped_convs_values(dtype, w_cl, layout):
    for n, cin, cout, hw, k, s, g in [(2, 64, 64, 9, 3, 1, 16), (1, 32, 64, 8, 3, 2, 4), (3, 48, 24, 7, 1, 1, 12)]:
        x = torch.randn(n, cin, hw, hw).to(dtype)
        w = (torch.randn(cout, cin // g, k, k) * 0.2).to(dtype)
        if w_cl:
            w = w.contiguous(memory_format=torch.channels_last)
        b = torch.randn(cout).to(dtype)
        kw = dict(stride=s, padding=k // 2, groups=g, out_layout=layout, post_ops=["relu"])
        ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), s, k // 2, 1, g))
        base = ops.conv2d(x, w, b, **kw)
        for m in ops.merge_candidates(dtype, cin, cout, g) + (2,):
            rank = ops.MERGE_GROUPS + m
            y = ops.conv2d(x, w, b, impl_rank=rank, **kw)
            assert f"groups merged {m} at a time" in ops.impl_name(x, w, b, impl_rank=rank, **kw)
            assert y.shape == base.shape and y.stride() == base.stride() and y.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
            else:  # no further from exact than the grouped conv itself (bf16 output rounding)
                assert (y.float() - ref).abs().max() <= 2 * (base.float() - ref).abs().max() + 1e-2


def test_a_merge_factor_must_divide_groups():
    x, w = torch.randn(1, 12, 5, 5), torch.randn(12, 4, 3, 3)
    with pytest.raises(ValueError, match="must divide groups"):
        ops.conv2d(x, w, groups=3, impl_rank=ops.MERGE_GROUPS + 2)
    with pytest.raises(ValueError, match="impl_rank"):
        ops.conv2d(x, w, groups=3, impl_rank=ops.MERGE_GROUPS + 3)
    # The C ABI refuses it too (a problem built without the Python checks).
    a = ffi.new("cl_conv_args *")
    a.nsp, a.dtype, a.n, a.ic, a.oc, a.groups = 2, ops.lib.CL_F32, 1, 12, 12, 3
    for i in range(2):
        a.in_sp[i], a.k_sp[i], a.out_sp[i], a.stride[i], a.dilation[i] = 5, 3, 3, 1, 1
    a.impl_rank = ops.MERGE_GROUPS + 2
    out = ffi.new("char[]", 256)
    assert ops.lib.cl_conv_impl_name(a, out, 256) != 0
    assert "dividing groups" in ffi.string(ops.lib.cl_last_error()).decode()


@pytest.mark.parametrize("cpp", MODES, ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_merged_groups_in_a_graph_give_eagers_values_and_strides(cpp, amp, grad_mode, monkeypatch,
                                                                 compiled_graphs):
    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", "merge_groups")
    _runs_as_eager(_model(Grouped), cpp, amp, grad_mode)
    assert len(compiled_graphs) == 2
    merged = [f"onednn:{ops.MERGE_GROUPS + 8}", f"onednn:{ops.MERGE_GROUPS + 4}"]  # to 32 channels a group
    for g in compiled_graphs:
        assert _impls(g) == sorted(["onednn", "onednn"] + merged)


@pytest.mark.parametrize("cpp", MODES, ids=["py", "cpp"])
def test_merged_groups_follow_weight_changes(cpp, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_CONV_IMPL", "merge_groups")
    model = _model(Grouped)
    fn = _compile(model, cpp)
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
        model.g4.weight.mul_(-2.0)                                            # in place
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
        model.g8.weight = nn.Parameter(torch.randn_like(model.g8.weight) * 0.1)  # replaced
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)


def test_merged_groups_are_timed_and_chosen_beyond_their_margin():
    from cpu_layout.plan import graph as pg

    def conv(cin, groups):
        return pg.Conv("c", (), (1, cin, 8, 8), torch.float32, in_size=(1, cin, 8, 8), out_channels=cin,
                       kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=groups,
                       post_ops=("relu",))

    got = measure._measure(conv(64, 16), rounds=1)  # 4 channels a group: merged 4 and 8 at a time
    assert len(got) == 7 and got[5] > 0 and got[6] in (4, 8)
    assert measure._measure(conv(64, 64), rounds=1)[5:] == [None, None]  # depthwise: not offered
    assert measure._measure(conv(64, 1), rounds=1)[5:] == [None, None]
    beyond, within = 80.0 * (1 - measure.MERGE_MARGIN) - 1.0, 80.0 * (1 - measure.MERGE_MARGIN) + 1.0
    cost = measure.measured_cost([100.0, 80.0, None, None, None, beyond, 8])
    assert cost.nhwc_rank == ops.MERGE_GROUPS + 8 and cost.nhwc_us == beyond
    assert "groups merged 8 at a time" in cost.source
    assert measure.measured_cost([100.0, 80.0, None, None, None, within, 8]).nhwc_rank == 0
    assert measure.measured_cost([100.0, 80.0, None, None, None]).nhwc_rank == 0, "an entry from before"
    aten = beyond * (1 - measure.ATEN_MARGIN)
    assert measure.measured_cost([100.0, 80.0, aten + 1.0, None, None, beyond, 8]).nhwc_impl == "onednn", \
        "torch's must beat the merged time by its own margin"
    assert measure.measured_cost([100.0, 80.0, aten - 1.0, None, None, beyond, 8]).nhwc_impl == "aten"
