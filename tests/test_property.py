"""Property test: random small conv nets, compiled with cpu_layout, against eager.

Hypothesis draws a net as a list of layers, computing each layer's output
shape as it goes so that only valid nets are built, then writes the net as a
standalone Python script (an ``nn.Module`` subclass, its random parameters and
batch-norm statistics, and the input) and executes it.  On a failure the
script, with the lines that compile and compare it, is printed in the
"Falsifying example" report: copy it to a file to reproduce.

What the nets cover:

- conv1d/conv2d/conv3d (mostly 2-D); kernel 1..5, square or not; stride 1..3;
  padding as an int, a tuple, a 1-tuple (broadcast by ATen), ``'same'``
  (stride 1 only: torch's rule) or ``'valid'``; dilation 1..3; groups 1,
  depthwise (groups == in_channels) or another common divisor; bias on/off;
- size-1 dims: batch 1, one channel, spatial 1xN;
- inputs contiguous, channels-last, non-dense (a spatial ``::2`` slice, a
  channel slice of a contiguous or channels-last tensor) or with a stride-0
  (expanded) batch; mid-net slices and H/W transposes feed non-dense
  tensors to the next layer;
- activations: relu (also in place), silu, gelu (erf, tanh), hardswish,
  sigmoid, tanh, relu6, hardtanh (infinite bounds included), leaky_relu;
- batch-norm in eval mode with random running statistics and affine params;
- residual adds (to any earlier tensor of the same shape), ``torch.cat``
  along channels, squeeze-and-excite (mean, 1x1 convs, sigmoid, mul);
- max/avg pooling (padding, dilation, ceil_mode, count_include_pad),
  adaptive avg/max pooling;
- views: channel shuffle (view -> transpose -> contiguous -> view/flatten,
  or transpose -> reshape), ``permute(0, 2, 3, 1)`` -> Linear/LayerNorm/
  pointwise -> permute back, pixel (un)shuffle, flatten/reshape;
- outputs: the last tensor as is (N-D, whatever its layout), flattened,
  flattened -> Linear, mean -> Linear, permuted channels-last, and
  sometimes an intermediate tensor as a second output.

Each example resets Dynamo, compiles with ``options={"debug": True}`` (planned
layouts asserted at run time) under CPU_LAYOUT_STRICT=1 (a whole-graph
fallback is an error), runs the compiled net twice, and checks shape, dtype,
strides (exactly eager's) and values (fp32: rtol 1e-4, atol 1e-4 * max|ref|)
under both wrappers (default and C++).

The example count per wrapper is CPU_LAYOUT_PROPERTY_EXAMPLES (default
DEFAULT_EXAMPLES = 50: about 75 s for both wrappers on two busy cores with
an empty CPU_LAYOUT_CACHE_DIR, 15 s with a warm one; a failure adds minutes of
shrinking); raise it for a deeper run, e.g.

    CPU_LAYOUT_PROPERTY_EXAMPLES=300 .venv/bin/python -m pytest -p no:cacheprovider tests/test_property.py

The examples are derandomized (the same nets on every run) and no example
database is written.
"""
import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_grad", "strict_compile")

DEFAULT_EXAMPLES = 50
EXAMPLES = int(os.environ.get("CPU_LAYOUT_PROPERTY_EXAMPLES", DEFAULT_EXAMPLES))

MAX_CHANNELS = 32
MAX_SPATIAL = {1: 16, 2: 10, 3: 5}
CONV = {1: "nn.Conv1d", 2: "nn.Conv2d", 3: "nn.Conv3d"}
BN = {1: "nn.BatchNorm1d", 2: "nn.BatchNorm2d", 3: "nn.BatchNorm3d"}

INF = math.inf
HARDTANH_BOUNDS = [(-1.0, 1.0), (0.0, 6.0), (-INF, 0.5), (-0.5, INF), (0.0, INF), (-INF, INF), (-2.0, -1.0)]


def _num(v):
    """A float as Python source (inf spelled so the script runs standalone)."""
    if v == INF:
        return "math.inf"
    if v == -INF:
        return "-math.inf"
    return repr(v)


def _spatial(nd, first=2):
    return tuple(range(first, first + nd))


def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(size, k, s, p, d, ceil):
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _per_dim(draw, nd, elements, uniform_p=0.6):
    """One value for every dim (as an int) or one per dim (as a tuple)."""
    if nd == 1 or draw(st.integers(0, 9)) < uniform_p * 10:
        v = draw(elements)
        return [v] * nd
    return [draw(elements) for _ in range(nd)]


def _fmt(values, style="auto"):
    """Conv/pool argument as source: an int when all equal (unless a tuple is
    asked for), a 1-tuple when asked and all equal, else a tuple."""
    same = all(v == values[0] for v in values)
    if style == "one" and same:
        return f"({values[0]},)"
    if same and style != "tuple":
        return str(values[0])
    return "(" + ", ".join(map(str, values)) + ("," if len(values) == 1 else "") + ")"


class Net:
    """A net under construction: __init__ lines, forward lines, tensor shapes."""

    def __init__(self, nd, shape):
        self.nd = nd
        self.init = []
        self.fwd = []
        self.shapes = [tuple(shape)]
        self.fresh = [False]        # produced by a computing op (safe to modify in place)
        self.n_modules = 0
        self.outputs = None

    @property
    def i(self):
        return len(self.shapes) - 1

    @property
    def shape(self):
        return self.shapes[-1]

    @property
    def t(self):
        return f"t{self.i}"

    def module(self, ctor):
        name = f"self.m{self.n_modules}"
        self.n_modules += 1
        self.init.append(f"{name} = {ctor}")
        return name

    def emit(self, expr, shape, fresh=True):
        self.fwd.append(f"t{self.i + 1} = {expr}")
        self.shapes.append(tuple(shape))
        self.fresh.append(fresh)


# ---------------------------------------------------------------- layers


def conv(draw, net):
    n, c, *sp = net.shape
    nd = len(sp)
    kinds = ["1", "depthwise"] + (["divisor"] if any(c % g == 0 for g in range(2, c)) else [])
    gk = draw(st.sampled_from(kinds))
    if gk == "1":
        g, cout = 1, draw(st.integers(1, 8))
    elif gk == "depthwise":
        g, cout = c, c * (draw(st.sampled_from([1, 2])) if 2 * c <= MAX_CHANNELS else 1)
    else:
        g = draw(st.sampled_from([d for d in range(2, c) if c % d == 0]))
        cout = g * draw(st.integers(1, max(1, min(3, MAX_CHANNELS // g))))
    k = _per_dim(draw, nd, st.integers(1, 5), 0.6)
    s = _per_dim(draw, nd, st.sampled_from([1, 1, 2, 3]), 0.8)
    d = _per_dim(draw, nd, st.sampled_from([1, 1, 1, 2, 3]), 0.8)
    pk = draw(st.sampled_from(["int", "tuple", "same", "valid", "one"]))
    if pk == "same" and any(v != 1 for v in s):
        pk = "int"
    if pk in ("int", "one"):
        p = [draw(st.integers(0, 3))] * nd
    elif pk == "tuple":
        p = [draw(st.integers(0, 3)) for _ in range(nd)]
    else:
        p = [0] * nd
    if pk != "same":   # shrink the window to fit the (padded) input
        for j in range(nd):
            if d[j] * (k[j] - 1) + 1 > sp[j] + 2 * p[j]:
                d[j] = 1
                k[j] = min(k[j], sp[j] + 2 * p[j])
    out = list(sp) if pk == "same" else [_conv_out(sp[j], k[j], s[j], p[j], d[j]) for j in range(nd)]
    assert min(out) >= 1
    pad = {"same": "'same'", "valid": "'valid'", "one": _fmt(p, "one"), "tuple": _fmt(p, "tuple")}.get(pk, _fmt(p))
    sstyle = draw(st.sampled_from(["auto", "auto", "auto", "one", "tuple"]))
    bias = draw(st.booleans())
    m = net.module(f"{CONV[nd]}({c}, {cout}, {_fmt(k)}, stride={_fmt(s, sstyle)}, padding={pad}, "
                   f"dilation={_fmt(d)}, groups={g}, bias={bias})")
    net.emit(f"{m}({net.t})", (n, cout, *out))


def batchnorm(draw, net):
    c = net.shape[1]
    affine = draw(st.sampled_from([True, True, False]))
    m = net.module(f"{BN[net.nd]}({c}, affine={affine})")
    net.emit(f"{m}({net.t})", net.shape)


ACTS = ["relu", "silu", "gelu", "hardswish", "sigmoid", "hardtanh", "leaky_relu",
        "gelu_tanh", "tanh", "relu6", "relu_"]


def activation_expr(draw, t, inplace_ok):
    a = draw(st.sampled_from(ACTS))
    if a == "relu_" and not inplace_ok:
        a = "relu"
    if a == "hardtanh":
        lo, hi = draw(st.sampled_from(HARDTANH_BOUNDS))
        return f"F.hardtanh({t}, {_num(lo)}, {_num(hi)})"
    if a == "leaky_relu":
        slope = draw(st.sampled_from([0.01, 0.2, 0.0, 1.5, -0.3]))
        return f"F.leaky_relu({t}, {slope})"
    if a == "gelu_tanh":
        return f"F.gelu({t}, approximate='tanh')"
    if a == "relu_":
        return f"F.relu({t}, inplace=True)"
    if a in ("sigmoid", "tanh"):
        return f"torch.{a}({t})"
    return f"F.{a}({t})"


def activation(draw, net):
    net.emit(activation_expr(draw, net.t, net.fresh[-1]), net.shape)


def add(draw, net):
    same = [j for j, s in enumerate(net.shapes) if s == net.shape]
    j = draw(st.sampled_from(same))
    net.emit(f"{net.t} + t{j}", net.shape)


def cat(draw, net):
    n, c, *sp = net.shape
    cands = [j for j, s in enumerate(net.shapes)
             if s[0] == n and tuple(s[2:]) == tuple(sp) and s[1] + c <= MAX_CHANNELS]
    j = draw(st.sampled_from(cands))
    parts = [net.t, f"t{j}"]
    if draw(st.booleans()):
        parts.reverse()
    net.emit(f"torch.cat([{', '.join(parts)}], 1)", (n, c + net.shapes[j][1], *sp))


def pool(draw, net):
    n, c, *sp = net.shape
    nd = len(sp)
    kind = draw(st.sampled_from(["max", "avg", "adaptive_avg", "adaptive_max"]))
    if kind.startswith("adaptive"):
        sizes = _per_dim(draw, nd, st.sampled_from([1, 1, 2, 3, None]), 0.6)
        if kind == "adaptive_max" or all(v is None for v in sizes):   # max: no None in F's signature checks
            sizes = [sp[j] if v is None else v for j, v in enumerate(sizes)]
        out = [sp[j] if v is None else v for j, v in enumerate(sizes)]
        arg = str(sizes[0]) if len(set(sizes)) == 1 and sizes[0] is not None else \
            "(" + ", ".join(map(str, sizes)) + ("," if nd == 1 else "") + ")"
        net.emit(f"F.{kind}_pool{nd}d({net.t}, {arg})", (n, c, *out))
        return
    k = _per_dim(draw, nd, st.integers(1, 3), 0.8)
    s = _per_dim(draw, nd, st.sampled_from([None, 1, 2, 3]), 1.0)
    s = [k[j] if v is None else v for j, v in enumerate(s)]
    d = _per_dim(draw, nd, st.sampled_from([1, 1, 2]), 0.8) if kind == "max" else [1] * nd
    p = _per_dim(draw, nd, st.integers(0, 1), 0.8)
    for j in range(nd):   # the window fits the unpadded input (pool3d checks that)
        if d[j] * (k[j] - 1) + 1 > sp[j]:
            d[j] = 1
            k[j] = min(k[j], sp[j])
        p[j] = min(p[j], (d[j] * (k[j] - 1) + 1) // 2)
    ceil = draw(st.booleans())
    out = [_pool_out(sp[j], k[j], s[j], p[j], d[j], ceil) for j in range(nd)]
    assert min(out) >= 1
    args = f"{_fmt(k)}, stride={_fmt(s)}, padding={_fmt(p)}, ceil_mode={ceil}"
    if kind == "max":
        args += f", dilation={_fmt(d)}"
    else:
        args += f", count_include_pad={draw(st.booleans())}"
    net.emit(f"F.{kind}_pool{nd}d({net.t}, {args})", (n, c, *out))


def shuffle(draw, net):
    n, c, *sp = net.shape
    g = draw(st.sampled_from([d for d in range(2, c) if c % d == 0]))
    t = net.t
    style = draw(st.sampled_from(["view", "flatten", "reshape"]))
    if style == "view":
        e = f"{t}.view({t}.shape[0], {g}, {c // g}, *{t}.shape[2:]).transpose(1, 2).contiguous().view({t}.shape)"
    elif style == "flatten":
        e = f"{t}.view({n}, {g}, {c // g}, *{t}.shape[2:]).transpose(1, 2).contiguous().flatten(1, 2)"
    else:
        e = f"{t}.unflatten(1, ({g}, {c // g})).transpose(1, 2).reshape({t}.shape)"
    net.emit(e, net.shape)


def permute(draw, net):
    """permute(0, 2, .., 1) -> op over channels -> permute back."""
    n, c, *sp = net.shape
    nd = len(sp)
    fwd = (0, *_spatial(nd), 1)
    back = (0, nd + 1, *range(1, nd + 1))
    op = draw(st.sampled_from(["linear", "layernorm", "act", "affine"]))
    u = f"{net.t}.permute{fwd}"
    cout = c
    if op == "linear":
        cout = draw(st.integers(1, 8))
        inner = f"{net.module(f'nn.Linear({c}, {cout}, bias={draw(st.booleans())})')}({u})"
    elif op == "layernorm":
        inner = f"{net.module(f'nn.LayerNorm({c})')}({u})"
    elif op == "act":
        inner = activation_expr(draw, u, False)
    else:
        inner = f"{u} * 0.5 + 1.0"
    e = f"({inner}).permute{back}"
    if draw(st.booleans()):
        e += ".contiguous()"
    net.emit(e, (n, cout, *sp))


def pixel_unshuffle(draw, net):
    n, c, h, w = net.shape
    t = net.t
    if draw(st.booleans()):
        e = f"{t}.view({n}, {c}, {h // 2}, 2, {w // 2}, 2).permute(0, 1, 3, 5, 2, 4).reshape({n}, {4 * c}, {h // 2}, {w // 2})"
    else:
        e = f"F.pixel_unshuffle({t}, 2)"
    net.emit(e, (n, 4 * c, h // 2, w // 2))


def pixel_shuffle(draw, net):
    n, c, h, w = net.shape
    net.emit(f"F.pixel_shuffle({net.t}, 2)", (n, c // 4, 2 * h, 2 * w))


def squeeze_excite(draw, net):
    n, c, *sp = net.shape
    nd = len(sp)
    r = draw(st.integers(1, 4))
    f1 = net.module(f"{CONV[nd]}({c}, {r}, 1)")
    f2 = net.module(f"{CONV[nd]}({r}, {c}, 1)")
    t = net.t
    net.emit(f"{t} * torch.sigmoid({f2}(F.relu({f1}({t}.mean({_spatial(nd)}, keepdim=True)))))", net.shape)


def slice_(draw, net):
    """A non-dense view fed to what follows: a channel slice or a spatial step."""
    n, c, *sp = net.shape
    t = net.t
    opts = (["channels"] if c > 1 else []) + (["spatial"] if max(sp) > 1 else [])
    kind = draw(st.sampled_from(opts))
    if kind == "channels":
        a = draw(st.integers(0, c - 1))
        b = draw(st.integers(a + 1, c))
        if a == 0 and b == c:
            b = c - 1
        net.emit(f"{t}[:, {a}:{b}]", (n, b - a, *sp), fresh=False)
    else:
        j = draw(st.sampled_from([j for j in range(len(sp)) if sp[j] > 1]))
        idx = ", ".join([":", ":"] + [("::2" if q == j else ":") for q in range(len(sp))])
        out = list(sp)
        out[j] = (sp[j] + 1) // 2
        net.emit(f"{t}[{idx}]", (n, c, *out), fresh=False)


def transpose_hw(draw, net):
    n, c, *sp = net.shape
    a, b = len(sp), len(sp) + 1
    out = list(sp)
    out[-1], out[-2] = out[-2], out[-1]
    net.emit(f"{net.t}.transpose({a}, {b})", (n, c, *out), fresh=False)


def layers_for(net):
    n, c, *sp = net.shape
    nd = len(sp)
    ks = ["conv", "conv", "conv", "activation", "activation", "batchnorm", "add", "pool", "cat",
          "permute", "slice"]
    if any(c % d == 0 for d in range(2, c)):
        ks.append("shuffle")
    if nd == 2 and sp[0] % 2 == 0 and sp[1] % 2 == 0 and 4 * c <= MAX_CHANNELS:
        ks.append("pixel_unshuffle")
    if nd == 2 and c % 4 == 0 and max(sp) <= MAX_SPATIAL[2]:
        ks.append("pixel_shuffle")
    if nd >= 2:
        ks += ["transpose_hw", "squeeze_excite"]
    if not any(s[0] == n and tuple(s[2:]) == tuple(sp) and s[1] + c <= MAX_CHANNELS for s in net.shapes):
        ks.remove("cat")
    if c == 1 and max(sp) == 1:
        ks.remove("slice")
    return ks


LAYERS = {f.__name__.rstrip("_"): f for f in
          (conv, batchnorm, activation, add, cat, pool, shuffle, permute, pixel_unshuffle,
           pixel_shuffle, squeeze_excite, slice_, transpose_hw)}


INPUTS = ["contiguous", "channels_last", "slice_spatial", "slice_channels",
          "slice_channels_last", "expand_batch"]


def input_source(draw, nd, n, c, sp):
    kind = draw(st.sampled_from(INPUTS))
    dims = ", ".join(map(str, sp))
    cl = (0, nd + 1, *range(1, nd + 1))
    if kind == "expand_batch" and n == 1:
        kind = "contiguous"
    if kind == "contiguous":
        return f"x = torch.randn({n}, {c}, {dims})"
    if kind == "channels_last":
        if nd == 2:
            return f"x = torch.randn({n}, {c}, {dims}).contiguous(memory_format=torch.channels_last)"
        if nd == 3:
            return f"x = torch.randn({n}, {c}, {dims}).contiguous(memory_format=torch.channels_last_3d)"
        return f"x = torch.randn({n}, {dims}, {c}).permute{cl}"
    if kind == "slice_spatial":
        big = ", ".join(map(str, [*sp[:-1], 2 * sp[-1]]))
        return f"x = torch.randn({n}, {c}, {big})[..., ::2]"
    if kind == "slice_channels":
        return f"x = torch.randn({n}, {c + 3}, {dims})[:, 1:{c + 1}]"
    if kind == "slice_channels_last":
        return f"x = torch.randn({n}, {dims}, {c + 3}).permute{cl}[:, 2:{c + 2}]"
    return f"x = torch.randn(1, {c}, {dims}).expand({n}, {c}, {dims})"


HEADER = """\
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
"""

FOOTER = """\
net = Net().eval()
for m in net.modules():
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        m.running_mean.normal_(0, 0.5)
        m.running_var.uniform_(0.5, 2.0)
        if m.affine:
            m.weight.data.normal_(1, 0.3)
            m.bias.data.normal_(0, 0.3)
"""


class Case:
    def __init__(self, source, desc, shapes):
        self.source = source
        self.desc = desc
        self.shapes = shapes     # the output shapes the generator computed

    def __repr__(self):   # what hypothesis prints as the falsifying example
        return f"Case({self.desc})"

    def repro(self, wrapper):
        env = "CPU_LAYOUT_CPP_WRAPPER" + ("=1" if wrapper == "cpp" else "=0")
        return (f"# {env} CPU_LAYOUT_STRICT=1 python repro.py\n{self.source}"
                "with torch.no_grad():\n"
                "    ref = net(x)\n"
                "    y = torch.compile(net, backend='cpu_layout', options={'debug': True})(x)\n"
                "print([(r.shape, r.stride()) for r in (ref if isinstance(ref, tuple) else (ref,))])\n"
                "print([(r.shape, r.stride()) for r in (y if isinstance(y, tuple) else (y,))])\n"
                "torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)\n")


@st.composite
def nets(draw):
    nd = draw(st.sampled_from([2, 2, 2, 2, 2, 2, 1, 3]))
    n = draw(st.sampled_from([1, 2, 3]))
    c = draw(st.one_of(st.just(1), st.integers(1, 8)))
    sp = [draw(st.one_of(st.just(1), st.integers(1, MAX_SPATIAL[nd]))) for _ in range(nd)]
    seed = draw(st.integers(0, 2 ** 16 - 1))
    x_src = input_source(draw, nd, n, c, sp)
    net = Net(nd, (n, c, *sp))
    kinds = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(layers_for(net)))
        LAYERS[kind](draw, net)
        kinds.append(kind)

    n, c, *sp = net.shape
    head = draw(st.sampled_from(["as_is", "flatten", "flatten_linear", "mean_linear",
                                 "permute", "reshape"]))
    t = net.t
    if head == "flatten":
        net.emit(f"{t}.flatten(1)", (n, c * math.prod(sp)))
    elif head == "flatten_linear":
        m = net.module(f"nn.Linear({c * math.prod(sp)}, 5)")
        net.emit(f"{m}(torch.flatten({t}, 1))", (n, 5))
    elif head == "mean_linear":
        m = net.module(f"nn.Linear({c}, 5)")
        net.emit(f"{m}({t}.mean({_spatial(len(sp))}))", (n, 5))
    elif head == "permute":
        net.emit(f"{t}.permute(0, {', '.join(map(str, _spatial(len(sp))))}, 1)", (n, *sp, c))
    elif head == "reshape":
        net.emit(f"{t}.reshape({n}, {c}, -1)", (n, c, math.prod(sp)))
    outs = [net.t]
    if net.i > 1 and draw(st.integers(0, 4)) == 0:
        outs.append(f"t{draw(st.integers(1, net.i - 1))}")

    lines = [HEADER, f"torch.manual_seed({seed})", "", "", "class Net(nn.Module):",
             "    def __init__(self):", "        super().__init__()"]
    lines += [f"        {ln}" for ln in net.init] or ["        pass"]
    lines += ["", "    def forward(self, t0):"]
    lines += [f"        {ln}" for ln in net.fwd]
    lines += [f"        return {outs[0]}" if len(outs) == 1 else f"        return {', '.join(outs)}", "", ""]
    src = "\n".join(lines) + "\n" + FOOTER + x_src + "\n"
    desc = f"{nd}d {tuple(net.shapes[0])} {x_src.split('= ', 1)[1]} {' '.join(kinds)} -> {head}"
    shapes = [net.shapes[int(o[1:])] for o in outs]
    return Case(src, desc, shapes)


def _check(y, ref):
    assert type(y) is type(ref)
    ys, refs = (y, ref) if isinstance(ref, tuple) else ((y,), (ref,))
    assert len(ys) == len(refs)
    for a, b in zip(ys, refs):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        assert a.stride() == b.stride(), f"strides {a.stride()} != eager's {b.stride()} (shape {tuple(b.shape)})"
        scale = b.abs().max().item() if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * (scale or 1.0))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(case=nets())
def test_random_conv_net_matches_eager(case, wrapper):
    note(case.repro(wrapper))
    ns = {}
    exec(compile(case.source, "<generated net>", "exec"), ns)
    net, x = ns["net"], ns["x"]
    torch._dynamo.reset()
    with torch.no_grad():
        ref = net(x)
        assert [r.shape for r in (ref if isinstance(ref, tuple) else (ref,))] == case.shapes, "generator's shapes"
        fn = torch.compile(net, backend="cpu_layout", options={"debug": True})
        _check(fn(x), ref)
        _check(fn(x), ref)   # second call: cached weights / prologue state
