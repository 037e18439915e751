"""The layout planner: regressions, constructed graphs vs simple policies, exactness."""
import dataclasses
import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from cpu_layout.layout import (
    CHANNELS_LAST, CONTIGUOUS, LABELS, channels_last_strides, contiguous_strides, hint, is_in_order,
)
from cpu_layout.plan import (
    CostModel, ConvCost, Graph, decision_nodes, default_cost_model, evaluate, materialize, plan,
    uniform_assignment,
)
from cpu_layout.plan.cost import TABLE_PATH
from cpu_layout.plan.mincut import INF, BinaryEnergy

try:
    import cpu_layout.ops as ops
    ops.conv2d(torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1), out_layout="nhwc")
except Exception:  # the oneDNN extension is optional for these tests
    ops = None


class StubCost(CostModel):
    """Deterministic costs: `rule(conv) -> (nchw_us, nhwc_us)`, copies `per_byte` µs/byte."""

    def __init__(self, rule, per_byte=1e-4):
        super().__init__(None)
        self.rule, self.per_byte = rule, per_byte

    def conv_cost(self, conv):
        a, b = self.rule(conv)
        return ConvCost(a, b, "stub")

    def copy_cost(self, nbytes, dtype=torch.float32):
        return nbytes * self.per_byte


PREFER_CL = StubCost(lambda c: (1000.0, 700.0))
PREFER_CF = StubCost(lambda c: (700.0, 1000.0))
MIXED = StubCost(lambda c: (500.0, 1500.0) if c.groups > 1 else (1000.0, 700.0))


class DtypeBlind(CostModel):
    """The shipped table's fp32 costs for every dtype (copies priced per element).

    With real bf16 costs FP32 and AMP may legitimately choose differently; the
    regression is that the *input's strides* must never make them differ."""

    def __init__(self, base):
        super().__init__(None)
        self.base = base

    def conv_cost(self, conv):
        return self.base.conv_cost(dataclasses.replace(conv, dtype=torch.float32))

    def copy_cost(self, nbytes, dtype=torch.float32):
        return self.base.copy_cost(nbytes // dtype.itemsize * 4, torch.float32)


def fake(real, dynamic):
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])
    return env, mode.from_tensor(real, symbolic_context=ctx)


def in_format(x, label):
    """x re-laid in torch's canonical strides for `label` (`.contiguous(memory_format=)` would keep
    [N,1,H,W] at its contiguous strides, which eager conv reads as NCHW)."""
    fmt = torch.channels_last if label == CHANNELS_LAST else torch.contiguous_format
    return torch.empty(x.shape, dtype=x.dtype, memory_format=fmt).copy_(x)


def assert_never_worse(g, cm):
    p = plan(g, cm)
    cf = evaluate(g, uniform_assignment(g, CONTIGUOUS), cm)
    cl = evaluate(g, uniform_assignment(g, CHANNELS_LAST), cm)
    assert p.exact
    assert p.total_cost <= cf + 1e-6 and p.total_cost <= cl + 1e-6, (p.total_cost, cf, cl)
    return p, cf, cl


# ---- maml_omniglot AMP / dynamic regression ------------------------------------------

def maml_graph(x_size, x_stride, amp):
    g = Graph()
    x = g.input("x", x_size, x_stride, torch.float32)
    src = g.cast(x, torch.bfloat16, name="cast") if amp else x
    c = g.conv(src, 64, kernel=3, name="conv")
    y = g.pool(g.pointwise(g.batchnorm(c), op="relu"), 2, 2)
    g.output(y, stride=contiguous_strides(g[y].size))  # eager: contiguous input -> contiguous
    return g


@pytest.mark.parametrize("cm", [PREFER_CL, PREFER_CF, "table"], ids=["prefer_cl", "prefer_cf", "table_fp32_costs"])
@pytest.mark.parametrize("dynamic", [[True, False, False, False], [True, False, True, True]], ids=["s0", "s0_s1_s2"])
def test_maml_fp32_and_amp_same_decision(cm, dynamic):
    cm = DtypeBlind(default_cost_model()) if cm == "table" else cm
    real = torch.randn(5, 1, 28, 28)
    env, x = fake(real, dynamic)
    size, stride = tuple(x.shape), tuple(x.stride())
    assert [hint(s) for s in stride] == [784, 784, 28, 1]
    guards = len(env.guards)
    p32 = plan(maml_graph(size, stride, amp=False), cm)
    pamp = plan(maml_graph(size, stride, amp=True), cm)
    assert len(env.guards) == guards, "planning must not add guards"

    label = p32.label_of["conv"]
    assert pamp.label_of["conv"] == label
    _check_maml_plans(real, p32, pamp)


@pytest.mark.parametrize("dynamic", [[True, False, False, False], [True, False, True, True]], ids=["s0", "s0_s1_s2"])
def test_maml_with_real_table_costs(dynamic):
    """Real (dtype-dependent) costs: whatever each plan picks, its strides are right."""
    real = torch.randn(5, 1, 28, 28)
    env, x = fake(real, dynamic)
    guards = len(env.guards)
    p32 = plan(maml_graph(tuple(x.shape), tuple(x.stride()), amp=False))
    pamp = plan(maml_graph(tuple(x.shape), tuple(x.stride()), amp=True))
    assert len(env.guards) == guards
    _check_maml_plans(real, p32, pamp)


def _check_maml_plans(real, p32, pamp):
    # the conv reads its input as is in both cases: no copy, and the cast is never re-strided
    assert p32.reads[("conv", 0)] == "x"
    assert pamp.reads[("conv", 0)] == "cast"
    assert [hint(s) for s in pamp.layout_of["cast"].stride] == [784, 784, 28, 1]
    assert not any("conv" in c.consumers for c in p32.copies + pamp.copies)
    # planned conv output strides are what eager produces for the input in that layout
    w = torch.randn(64, 1, 3, 3)
    for p, dtype in ((p32, torch.float32), (pamp, torch.bfloat16)):
        label = p.label_of["conv"]
        want = F.conv2d(in_format(real, label), w).stride()
        assert tuple(hint(s) for s in p.layout_of["conv"].stride) == want
        assert tuple(hint(s) for s in p.layout_of["conv"].size) == (5, 64, 26, 26)
        if ops is not None:  # and what our own runtime produces, fed the planned input strides
            src = p.layout_of[p.reads[("conv", 0)]]
            xin = torch.empty_strided([hint(s) for s in src.size], [hint(s) for s in src.stride], dtype=dtype)
            xin.copy_(real)
            assert ops.conv2d(xin, w.to(dtype), out_layout=label).stride() == want


@pytest.mark.parametrize("label", LABELS)
def test_maml_forced_layouts_match_eager(label):
    """Both decisions, forced, give eager's strides (not just the one the cost model picks)."""
    real = torch.randn(5, 1, 28, 28)
    env, x = fake(real, [True, False, False, False])
    for amp in (False, True):
        g = maml_graph(tuple(x.shape), tuple(x.stride()), amp)
        p = materialize(g, {"conv": label}, PREFER_CL)
        assert p.layout_of["conv"].stride == F.conv2d(in_format(real, label), torch.randn(64, 1, 3, 3)).stride()
        assert not any("conv" in c.consumers for c in p.copies)


@pytest.mark.parametrize("size", [(1, 3, 28, 28), (4, 1, 28, 28), (4, 16, 1, 1), (4, 16, 1, 9), (1, 1, 1, 1)],
                         ids=["batch1", "channel1", "spatial1x1", "height1", "all1"])
@pytest.mark.parametrize("cm", [PREFER_CL, PREFER_CF], ids=["prefer_cl", "prefer_cf"])
def test_size_one_dims_everywhere(size, cm):
    real = torch.randn(size)
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = real.contiguous(memory_format=fmt)
        w = torch.randn(8, size[1], 1, 1)
        g = Graph()
        xi = g.input("x", size, x.stride())
        c = g.conv(xi, 8, kernel=1, name="conv")
        g.output(g.pointwise(c, op="relu"), stride=F.conv2d(x, w).stride())
        p, cf, cl = assert_never_worse(g, cm)
        label = p.label_of["conv"]
        assert label == (CHANNELS_LAST if cm is PREFER_CL else CONTIGUOUS)
        planned = p.layout_of["conv"]
        fmt = torch.channels_last if label == CHANNELS_LAST else torch.contiguous_format
        assert planned.stride == torch.empty(planned.size, memory_format=fmt).stride()
        eager = F.conv2d(in_format(x, label), w)
        if size == (1, 1, 1, 1):
            # eager's ambiguity rule calls an all-ones input NCHW whatever its strides; the
            # planned output then differs from eager's only in strides of size-1 dims
            assert all(is_in_order(eager.shape, eager.stride(), o) == planned.is_in_order(o) for o in LABELS)
        else:
            assert planned.stride == eager.stride()
        if ops is not None:
            assert ops.conv2d(x, w, out_layout=label).stride() == planned.stride
        if is_in_order(size, x.stride(), CONTIGUOUS) and is_in_order(size, x.stride(), CHANNELS_LAST):
            assert p.reads[("conv", 0)] == "x"  # a size-1 dim makes the input fit both: never copied
        if size[2:] == (1, 1):
            assert not p.copies  # [N,C,1,1] in and out fit every order


def test_global_pool_then_1x1_conv_flatten_linear():
    g = Graph()
    x = g.input("x", (2, 16, 8, 8))
    c1 = g.conv(x, 32, 3, padding=1, name="c1")
    gp = g.adaptive_pool(g.pointwise(c1, op="relu"), (1, 1), name="gap")
    c2 = g.conv(gp, 48, 1, name="c2")                      # [2, 48, 1, 1]
    fl = g.flatten(c2, 1, name="flat")                     # [2, 48]: free in either layout
    g.output(g.linear(fl, 10))
    p, cf, cl = assert_never_worse(g, PREFER_CL)
    assert p.label_of["c1"] == p.label_of["c2"] == CHANNELS_LAST
    assert [c.source for c in p.copies] == ["x"]            # only the input is converted
    assert p.layout_of["gap"].size == (2, 32, 1, 1)
    assert p.layout_of["c2"].stride == channels_last_strides((2, 48, 1, 1))
    assert p.layout_of["flat"].stride == (48, 1)
    assert p.total_cost < cf


# ---- constructed graphs vs the simple policies ---------------------------------------------

def residual_net(blocks=3, c=64, hw=28, n=2):
    g = Graph()
    x = g.input("x", (n, c, hw, hw))
    y = g.pointwise(g.batchnorm(g.conv(x, c, 3, padding=1)), op="relu")
    for _ in range(blocks):
        a = g.pointwise(g.batchnorm(g.conv(y, c, 3, padding=1)), op="relu")
        a = g.batchnorm(g.conv(a, c, 3, padding=1))
        y = g.pointwise(g.pointwise(a, y, op="add"), op="relu")
    g.output(y)
    return g


def test_residual_net_all_channels_last_two_copies():
    g = residual_net()
    p, cf, cl = assert_never_worse(g, PREFER_CL)
    assert set(d.label for d in p.convs.values()) == {CHANNELS_LAST}
    assert len(p.copies) == 2
    first, last = sorted(p.copies, key=lambda c: c.source != "x")
    assert first.source == "x" and first.consumers == [g.consumers("x")[0]]
    assert len(last.consumers) == 1 and g[last.consumers[0]].kind == "output"
    assert p.total_cost == pytest.approx(cl) and p.total_cost < cf
    assert_never_worse(g, default_cost_model())


def test_residual_input_shared_by_two_consumers_is_copied_once():
    g = Graph()
    x = g.input("x", (2, 64, 28, 28))
    a = g.conv(x, 64, 3, padding=1, name="a")
    b = g.conv(x, 64, 1, name="b")
    g.output(g.pointwise(a, b, op="add"))
    p, cf, cl = assert_never_worse(g, PREFER_CL)
    inputs = [c for c in p.copies if c.source == "x"]
    assert len(inputs) == 1 and sorted(inputs[0].consumers) == ["a", "b"]


def mixed_block(batch=1):
    """MixNet's mixed depthwise convs over a split, ReXNet's partial residual over slices."""
    g = Graph()
    size = (batch, 32, 16, 16)
    x = g.input("x", size, channels_last_strides(size))
    y = g.conv(x, 48, 1, name="expand")
    pieces = [g.slice(y, 1, 16 * i, 16 * (i + 1), name=f"piece{i}") for i in range(3)]
    z = g.cat([g.conv(p, 16, k, padding=k // 2, groups=16, name=f"dw{k}") for p, k in zip(pieces, (3, 5, 7))])
    head = g.pointwise(g.slice(z, 1, 0, 32, name="head"), x, op="add")  # read in place by a kernel
    out = g.cat([head, g.slice(z, 1, 32, 48, name="tail")])  # and by the concatenation
    g.output(out, stride=channels_last_strides((batch, 48, 16, 16)))
    return g


def test_slices_are_views_that_only_convs_copy_dense():
    g = mixed_block()
    p = plan(g, PREFER_CL)
    assert set(d.label for d in p.convs.values()) == {CHANNELS_LAST}
    # Each piece of the channels-last expand conv is a strided view; its conv copies
    # it dense in the same order (a gather, cheaper than a conversion), nothing else does.
    assert sorted((c.source, c.reason) for c in p.copies) == [(f"piece{i}", "dense") for i in range(3)]
    cm = PREFER_CL
    assert p.copies[0].cost_us == pytest.approx(cm.gather_cost(16 * 16 * 16 * 4))
    assert cm.gather_cost(1000) < cm.copy_cost(1000)
    assert p.layout_of["piece1"].stride == channels_last_strides((1, 48, 16, 16))
    assert p.exact and p.total_cost == pytest.approx(_brute_force(g, cm))


@pytest.mark.parametrize("batch", [1, 2])
def test_channel_slices_of_nchw_are_dense_at_batch_one_only(batch):
    g = mixed_block(batch)
    lay = {n: CONTIGUOUS for n in decision_nodes(g)}
    p = materialize(g, lay, PREFER_CF)
    dense = sorted(c.source for c in p.copies if c.reason == "dense")
    assert dense == ([] if batch == 1 else ["piece0", "piece1", "piece2"])
    assert not [c for c in p.copies if c.source in ("head", "tail")]


def grouped_mix():
    g = Graph()
    x = g.input("x", (2, 64, 28, 28))
    y = x
    for i in range(2):
        y = g.pointwise(g.conv(y, 64, 3, padding=1, name=f"reg{i}"), op="relu")
    for i in range(2):
        y = g.pointwise(g.conv(y, 64, 3, padding=1, groups=32, name=f"grp{i}"), op="relu")
    for i in range(2, 4):
        y = g.pointwise(g.conv(y, 64, 3, padding=1, name=f"reg{i}"), op="relu")
    g.output(y)
    return g


def test_grouped_and_regular_mix_beats_both_policies():
    g = grouped_mix()
    p, cf, cl = assert_never_worse(g, MIXED)
    for name, d in p.convs.items():
        assert d.label == (CONTIGUOUS if name.startswith("grp") else CHANNELS_LAST), name
    assert p.total_cost < cf and p.total_cost < cl  # strictly: neither all-or-nothing policy is optimal
    assert len(p.copies) == 4  # in, into the grouped block, out of it, out
    assert_never_worse(g, default_cost_model())


def conv_flatten_linear():
    g = Graph()
    x = g.input("x", (4, 16, 8, 8))
    c = g.conv(x, 32, 3, padding=1, name="conv")
    r = g.pointwise(c, op="relu", name="relu")
    f = g.flatten(r, 1, name="flat")
    g.output(g.linear(f, 10, name="fc"))
    return g


@pytest.mark.parametrize("cm", [PREFER_CL, PREFER_CF, StubCost(lambda c: (1000.0, 700.0), per_byte=1.0)],
                         ids=["prefer_cl", "prefer_cf", "copies_expensive"])
def test_conv_flatten_linear(cm):
    g = conv_flatten_linear()
    p, cf, cl = assert_never_worse(g, cm)
    relu = p.layout_of["relu"]
    view_copy = [c for c in p.copies if c.reason == "view" and c.consumers == ["flat"]]
    assert relu.is_in_order(CONTIGUOUS) or view_copy, "flatten must see contiguous memory or copy"
    assert p.layout_of["flat"].stride == (32 * 64, 1)
    assert p.reads[("fc", 0)] == "flat"
    if cm is PREFER_CF or cm.per_byte == 1.0:
        assert not p.copies and p.label_of["conv"] == CONTIGUOUS


def test_conversion_costs_more_than_it_saves_stays_contiguous():
    g = Graph()
    x = g.input("x", (8, 64, 56, 56))
    y = g.pointwise(g.conv(x, 64, 1, name="conv"), op="relu")
    g.output(y)
    cm = StubCost(lambda c: (100.0, 99.0))  # NHWC 1% faster, but each copy moves 6.4 MB
    p, cf, cl = assert_never_worse(g, cm)
    assert p.label_of["conv"] == CONTIGUOUS and not p.copies
    assert p.total_cost == pytest.approx(cf) and p.total_cost < cl
    assert_never_worse(g, default_cost_model())


def test_eager_follow_policy_matches_conv_rule():
    """Unassigned convs follow eager: NHWC input -> NHWC conv, no copies at all."""
    g = Graph()
    x = g.input("x", (2, 8, 6, 6), channels_last_strides((2, 8, 6, 6)))
    c = g.conv(x, 8, 3, padding=1, name="conv")
    g.output(c, stride=F.conv2d(torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last),
                                torch.randn(8, 8, 3, 3), padding=1).stride())
    p = materialize(g, {}, PREFER_CF)
    assert p.label_of["conv"] == CHANNELS_LAST and not p.copies


def test_convnext_style_permutes_plan_exactly():
    g = Graph()
    x = g.input("x", (2, 32, 8, 8))
    stem = g.conv(x, 32, 1, name="stem")
    dw = g.conv(stem, 32, 7, padding=3, groups=32, name="dw")
    t = g.permute(dw, (0, 2, 3, 1), name="to_nhwc")      # [N,H,W,C]
    t = g.linear(g.pointwise(t, op="ln", name="ln"), 32, name="pw")  # linear over channels
    back = g.permute(g.pointwise(t, op="gelu"), (0, 3, 1, 2), name="to_nchw")
    g.output(g.pointwise(back, stem, op="add", name="add"))
    for cm in (PREFER_CL, PREFER_CF, default_cost_model()):
        p, cf, cl = assert_never_worse(g, cm)
        assert p.total_cost == pytest.approx(_brute_force(g, cm))
    p = plan(g, PREFER_CL)
    assert p.label_of["dw"] == CHANNELS_LAST and p.layout_of["to_nhwc"].is_in_order(CONTIGUOUS)
    assert p.reads[("pw", 0)] == "ln" and p.layout_of["ln"].is_in_order(CONTIGUOUS)  # no copy before linear
    assert p.layout_of["to_nchw"].is_in_order(CHANNELS_LAST) and p.reads[("add", 0)] == "to_nchw"


# ---- exactness: min cut == exhaustive optimum ------------------------------------------------

def _brute_force(g, cm):
    names = decision_nodes(g)
    best = INF
    for labels in itertools.product(LABELS, repeat=len(names)):
        best = min(best, evaluate(g, dict(zip(names, labels)), cm))
    return best


def random_graph(rng):
    g = Graph()
    c = 8
    kind = rng.choice(["contiguous", "channels_last", "channel1"])
    size = (2, 1 if kind == "channel1" else c, 6, 6)
    stride = channels_last_strides(size) if kind == "channels_last" else contiguous_strides(size)
    bufs = [g.input("x", size, stride)]
    if kind == "channel1":
        bufs.append(g.conv(bufs[0], c, 3, padding=1))
    while len(decision_nodes(g)) < rng.randint(5, 9):
        src = rng.choice(bufs[-3:])
        op = rng.random()
        if op < 0.35:
            k = rng.choice([1, 3])
            out = g.conv(src, c, k, padding=k // 2, groups=rng.choice([1, 1, 2, c]))
        elif op < 0.5:
            others = [b for b in bufs if g[b].size == g[src].size and b != src]
            out = g.pointwise(src, rng.choice(others), op="add") if others else g.batchnorm(src)
        elif op < 0.6:
            se = g.conv(g.adaptive_pool(src, (1, 1)), c, 1)     # squeeze-excite: [N,C,1,1] gate
            out = g.pointwise(src, se, op="mul")
        elif op < 0.7:
            out = g.conv(g.cat([src, rng.choice(bufs)]), c, 1)
        elif op < 0.8:
            p = g.permute(src, (0, 2, 3, 1))
            out = g.permute(g.pointwise(p, op="gelu"), (0, 3, 1, 2))
        elif op < 0.85:
            out = g.pointwise(src, op="relu")
        elif op < 0.9:  # a split's pieces, each read by one conv (MixNet): dense copies or none
            half = g[src].size[1] // 2
            out = g.cat([g.conv(g.slice(src, 1, a, b), half, k, padding=k // 2)
                         for a, b, k in ((0, half, 1), (half, 2 * half, 3))]) if half else g.batchnorm(src)
        else:
            out = g.fallback([src], g[src].size, needs_contiguous=rng.random() < 0.5)
        bufs.append(out)
    last = bufs[-1]
    g.output(last, stride=rng.choice([contiguous_strides, channels_last_strides])(g[last].size))
    if rng.random() < 0.5:
        g.output(g.linear(g.flatten(rng.choice(bufs[1:]), 1), 4))
    return g


def test_min_cut_equals_exhaustive_optimum_on_random_graphs():
    rng = random.Random(1234)
    checked = 0
    for trial in range(40):
        g = random_graph(rng)
        costs = {n.name: (rng.uniform(0, 300), rng.uniform(0, 300)) for n in g.of_kind("conv")}
        cm = StubCost(lambda conv, costs=costs: costs[conv.name], per_byte=rng.uniform(1e-3, 0.1))
        p = plan(g, cm)
        best = _brute_force(g, cm)
        assert p.total_cost >= best - 1e-6
        if p.exact:
            assert p.total_cost == pytest.approx(best, rel=1e-9, abs=1e-6), trial
            checked += 1
        cf = evaluate(g, uniform_assignment(g, CONTIGUOUS), cm)
        cl = evaluate(g, uniform_assignment(g, CHANNELS_LAST), cm)
        assert p.total_cost <= min(cf, cl) + 1e-6
    assert checked == 40  # no conflicting permutes in these graphs: every plan is provably optimal


def test_binary_energy_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 7)
        e = BinaryEnergy()
        pol = [rng.randint(0, 1) for _ in range(n)]
        for i in range(n):
            e.var()
            e.add_unary(i, rng.uniform(-5, 5), rng.uniform(-5, 5))
        for _ in range(rng.randint(1, 12)):
            i, j = rng.sample(range(n), 2)
            t = [rng.uniform(0, 5) for _ in range(4)]
            a, b, c, d = t
            if a + d > b + c:  # make it submodular, then hide it behind the planted polarity
                b, c = b + (a + d - b - c), c
            tab = [a, b, c, d]
            flipped = [tab[2 * (x ^ pol[i]) + (y ^ pol[j])] for x in (0, 1) for y in (0, 1)]
            if rng.random() < 0.1:  # a hard constraint, off-diagonal in raw space
                flipped[2 * (0 ^ pol[i]) + (1 ^ pol[j])] = INF
            e.add_pairwise(i, j, *flipped)
        labels, value, exact = e.minimize()
        assert exact
        best = min(e.value(x) for x in itertools.product((0, 1), repeat=n))
        assert value == pytest.approx(best)


# ---- logging and the cost model ------------------------------------------------------------------

def test_log_plan_prints_each_conv_and_copies(monkeypatch, capsys):
    monkeypatch.setenv("CPU_LAYOUT_LOG", "plan")
    g = grouped_mix()
    p = plan(g, MIXED)
    err = capsys.readouterr().err
    for name, d in p.convs.items():
        line = next(l for l in err.splitlines() if f"conv {name} " in l)
        assert d.label in line and f"{d.cost.nchw_us:.1f}" in line and f"{d.cost.nhwc_us:.1f}" in line
    assert "copies kept:" in err
    for c in p.copies:
        assert f"{c.source} -> {c.name}" in err
    assert "policy all channels_last" in err and "policy all contiguous" in err
    monkeypatch.setenv("CPU_LAYOUT_LOG", "")
    plan(g, MIXED)
    assert capsys.readouterr().err == ""


def test_table_is_chosen_by_isa(tmp_path):
    from cpu_layout.plan.cost import table_path_for

    for isa in ("avx2", "avx512_core", "avx512_core_amx"):
        (tmp_path / f"conv_cost_table_{isa}.json").write_text("{}")
    assert table_path_for("avx512_core_amx", str(tmp_path)).endswith("_avx512_core_amx.json")
    assert table_path_for("avx512_core_bf16", str(tmp_path)).endswith("_avx512_core_amx.json") or \
        table_path_for("avx512_core_bf16", str(tmp_path)).endswith("_avx512_core.json")
    assert table_path_for("avx2", str(tmp_path)).endswith("_avx2.json")
    (tmp_path / "conv_cost_table_avx2.json").unlink()
    assert table_path_for("avx2", str(tmp_path)) is None, "no table of the family: heuristics"


def test_shipped_table_metadata_and_lookup():
    with open(TABLE_PATH) as f:
        table = json.load(f)
    assert table["backend"] in ("cpu_layout.ops.conv2d", "torch.nn.functional.conv2d")
    assert table["isa"].split("+")[0].split("_")[0] in ("avx512", "avx512f", "avx2", "other")
    assert {"float32", "bfloat16"} <= {e["dtype"] for e in table["entries"]}
    assert {1, 32} <= {e["groups"] for e in table["entries"]}
    cm = CostModel(table)
    e = next(e for e in table["entries"] if e["dtype"] == "float32" and e["cin"] == 64 and e["kernel"] == 3
             and e["groups"] == 1 and e["spatial"] == 56)
    g = Graph()
    c = g.conv(g.input("x", (1, 64, 56, 56)), e["cout"], 3, padding=1)
    got = cm.conv_cost(g[c])
    per_thread = table.get("threads", 1) / torch.get_num_threads()  # the table's threads, ours
    assert got.nchw_us == pytest.approx(e["nchw_us"] * per_thread)
    assert got.nhwc_us == pytest.approx(e["nhwc_us"] * per_thread)
    assert got.source.startswith("table")
    # twice the batch: twice the time (FLOP scaling)
    g2 = Graph()
    c2 = g2.conv(g2.input("x", (2, 64, 56, 56)), e["cout"], 3, padding=1)
    assert cm.conv_cost(g2[c2]).nchw_us == pytest.approx(2 * e["nchw_us"] * per_thread)
    assert cm.copy_cost(1000) > 0


def test_heuristics_without_table():
    cm = CostModel(None)
    g = Graph()
    x = g.input("x", (1, 1, 28, 28))
    one = cm.conv_cost(g[g.conv(x, 64, 3)])
    assert one.source == "heuristic: in_channels == 1" and one.nchw_us == one.nhwc_us
    y = g.input("y", (1, 64, 28, 28))
    dw = cm.conv_cost(g[g.conv(y, 64, 3, groups=64)])
    grp = cm.conv_cost(g[g.conv(y, 64, 3, groups=16)])   # 4 channels per group
    reg = cm.conv_cost(g[g.conv(y, 64, 3)])
    tiny = cm.conv_cost(g[g.conv(g.input("z", (1, 4, 28, 28)), 4, 3)])
    assert "depthwise" in dw.source and dw.nhwc_us < dw.nchw_us
    assert "grouped" in grp.source and grp.nhwc_us > grp.nchw_us
    assert "regular" in reg.source and reg.nhwc_us < reg.nchw_us
    assert "tiny" in tiny.source
    conv1d = cm.conv_cost(g[g.conv(g.input("w", (1, 64, 100)), 64, 3)])
    assert conv1d.source.startswith("heuristic")


def test_aten_pooling_is_priced_per_layout():
    """A stem conv that is a little cheaper in NCHW still computes channels-last
    when a max pool follows: ATen's NCHW pooling costs ~10x its NHWC kernel."""
    g = Graph()
    x = g.input("x", (1, 3, 112, 112))
    stem = g.conv(x, 64, 7, stride=2, padding=3, name="stem")
    pool = g.pool(stem, 3, 2, 1, op="max", name="pool")
    g.output(g.conv(pool, 64, 1, name="next"))
    cm = StubCost(lambda c: (100.0, 105.0) if c.name == "stem" else (50.0, 50.0))
    p = plan(g, cm)
    assert p.label_of["stem"] == p.label_of["pool"] == CHANNELS_LAST, p.explain()
    cf, cl = cm.pool_cost(g["pool"])
    assert cf > 5 * cl and p.op_cost == pytest.approx(cl)
    no_pool = StubCost(cm.rule)
    no_pool.pool_cost = lambda node: (0.0, 0.0)
    assert plan(g, no_pool).label_of["stem"] == CONTIGUOUS  # the price is what decides
    prev = torch.get_num_threads()
    try:  # both kernels split the pool over the threads (one thread's rates)
        torch.set_num_threads(1)
        one = cm.pool_cost(g["pool"])
        torch.set_num_threads(2)
        assert cm.pool_cost(g["pool"]) == pytest.approx((one[0] / 2, one[1] / 2))
    finally:
        torch.set_num_threads(prev)


def test_other_ops_are_priced_for_the_prediction_but_never_decide():
    g = residual_net(blocks=2, c=32, hw=16, n=1)
    cm = default_cost_model()
    plans = {lab: materialize(g, uniform_assignment(g, lab), cm) for lab in LABELS}
    other = {lab: p.other_cost for lab, p in plans.items()}
    assert other[CONTIGUOUS] == other[CHANNELS_LAST] > 0, "the same in every layout"
    for p in plans.values():
        assert p.total_cost == pytest.approx(p.conv_cost + p.copy_cost + p.op_cost + p.other_cost)
    # Bigger tensors cost more; a kernel over 4x the bytes costs more than 3x as much.
    small, big = Graph(), Graph()
    for gr, hw in ((small, 32), (big, 64)):
        gr.output(gr.pointwise(gr.input("x", (1, 64, hw, hw)), op="relu"))
    ps, pb = (materialize(gr, {}, cm).other_cost for gr in (small, big))
    assert pb > 3 * ps
    # A matmul is priced by its FLOPs.
    assert cm.other_cost(0, 0, torch.float32, flops=2e9) > 10 * cm.other_cost(0, 0, torch.float32, flops=2e7)


def test_an_elementwise_chain_is_priced_as_the_one_kernel_it_becomes():
    """A chain fusion makes one pass (mul -> add -> relu, the first two marked
    fused into their users as plan/ir_plan.py marks them from fuse.py's chains)
    is priced as one read and one write, not three of each; vector math (SiLU)
    costs more than a plain op over the same bytes; unmarked, each op is a pass."""
    cm = default_cost_model()

    def other(ops, fused=True):
        g = Graph()
        v = g.input("x", (1, 64, 32, 32))
        for i, op in enumerate(ops):
            v = g.pointwise(v, op=op)
            g.nodes[v].fused_into_user = fused and i < len(ops) - 1
        g.output(v)
        return materialize(g, {}, cm).other_cost

    one, chain = other(["relu"]), other(["mul", "add", "relu"])
    assert chain == pytest.approx(one), "three fused ops: one pass"
    from cpu_layout.plan import cost

    exp = 64 * 32 * 32 * cost._VECTOR_MATH_NS / 1e3 / torch.get_num_threads()
    assert other(["silu"]) == pytest.approx(one + exp), "the exp, not only the bytes"
    assert other(["mul", "add", "relu"], fused=False) > 2.5 * one, "three passes"
