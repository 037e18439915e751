"""Generated pointwise and reduction kernels against eager PyTorch.

Tolerances: float32 arithmetic (add/sub/mul/div, comparisons, min/max/clamp family, relu,
hardswish...) must match eager bit for bit (the build uses -ffp-contract=off). Ops that call libm
(exp, log, pow, tanh, sigmoid, silu, gelu) differ from eager's Sleef by a few ulp, and so does
sqrt/rsqrt (ours is the correctly rounded one): rtol 1e-5,
atol 1e-6. bfloat16 outputs are compared with eager computing in float32 and rounding once:
exact for the bit-exact ops, within 1 bf16 ulp for the libm ones. Reductions sum in a different
order than eager: rtol 1e-5 / atol 1e-5 (float32), 1 ulp (bfloat16).
"""
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from cpu_layout import build
from cpu_layout.codegen import Const, Load, Op, PointwiseKernel, ReductionKernel

f32, bf16 = torch.float32, torch.bfloat16
X, Y, Z = Load(0), Load(1), Load(2)


def op(name, *args, params=()):
    return Op(name, args, params)


# ---------------------------------------------------------------- op table: (expr, eager ref)
UNARY = {
    "neg": (op("neg", X), torch.neg),
    "abs": (op("abs", X), torch.abs),
    "exp": (op("exp", X), torch.exp),
    "log": (op("log", X), torch.log),
    "sqrt": (op("sqrt", X), torch.sqrt),
    "rsqrt": (op("rsqrt", X), torch.rsqrt),
    "reciprocal": (op("reciprocal", X), torch.reciprocal),
    "relu": (op("relu", X), torch.relu),
    "sigmoid": (op("sigmoid", X), torch.sigmoid),
    "tanh": (op("tanh", X), torch.tanh),
    "silu": (op("silu", X), F.silu),
    "gelu": (op("gelu", X), F.gelu),
    "gelu_tanh": (op("gelu", X, params=("tanh",)), lambda x: F.gelu(x, approximate="tanh")),
    "hardswish": (op("hardswish", X), F.hardswish),
    "hardsigmoid": (op("hardsigmoid", X), F.hardsigmoid),
    "relu6": (op("relu6", X), F.relu6),
    "leaky_relu": (op("leaky_relu", X, params=(0.2,)), lambda x: F.leaky_relu(x, 0.2)),
    "leaky_relu_default": (op("leaky_relu", X), F.leaky_relu),
    "clamp": (op("clamp", X, params=(-1.0, 0.5)), lambda x: x.clamp(-1.0, 0.5)),
    "clamp_min": (op("clamp", X, params=(-0.5, None)), lambda x: x.clamp(min=-0.5)),
    "clamp_max": (op("clamp", X, params=(None, 0.25)), lambda x: x.clamp(max=0.25)),
}
for e in (2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 2.5, 0.0, 1.0):
    UNARY[f"pow{e}"] = (op("pow", X, params=(e,)), lambda x, e=e: torch.pow(x, e))
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "gt": lambda a, b: (a > b).float(), "lt": lambda a, b: (a < b).float(),
    "ge": lambda a, b: (a >= b).float(), "le": lambda a, b: (a <= b).float(),
    "eq": lambda a, b: (a == b).float(),
}
ALL = dict(UNARY)
ALL.update({n: (op(n, X, Y), f) for n, f in BINARY.items()})
ALL["where"] = (op("where", Z, X, Y), lambda x, y, z: torch.where(z != 0, x, y))
ALL["add_const"] = (op("add", X, Const(0.1)), lambda x: x + 0.1)
# (not `-3.0 / x`: eager's __rtruediv__ is reciprocal(x) * -3, two roundings)
ALL["const_div"] = (op("div", Const(-3.0), X), lambda x: torch.full_like(x, -3.0) / x)
# Not bit-exact vs eager: libm vs Sleef/MKL. (Ours sqrt is correctly rounded; eager's is not.)
LIBM = {"exp", "log", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh", "pow2.5", "sqrt", "rsqrt",
        "pow0.5", "pow-0.5"}
NAMES = list(ALL)


def eager(name, x, y, z):
    fn = ALL[name][1]
    if name == "where":
        return fn(x, y, z)
    return fn(x, y) if name in BINARY else fn(x)


def kernel_for(dtype):
    return PointwiseKernel([dtype] * 3, [(ALL[n][0], dtype) for n in NAMES], 1)


ALL_F32, ALL_BF16 = kernel_for(f32), kernel_for(bf16)
CHAIN = op("relu", op("add", op("mul", X, Y), Z))  # relu(x * scale + bias)
CHAIN4 = {dt: PointwiseKernel([dt] * 3, [(CHAIN, dt)], 4) for dt in (f32, bf16)}
CHAIN_ND = {nd: PointwiseKernel([f32] * 3, [(CHAIN, f32)], nd) for nd in (0, 1, 3, 5)}
MULTI = PointwiseKernel([f32, bf16], [(op("mul", X, Y), f32), (op("add", op("relu", X), Y), bf16),
                                     (op("sigmoid", Y), bf16)], 4)


def chain_ref(x, s, b):
    return torch.relu(x * s + b)


def mean_hw(keepdim, dt=f32, out=f32):
    return ReductionKernel(dt, X, "mean", 4, (2, 3), keepdim, out_dtype=out)


RED = {
    "mean_keep": mean_hw(True), "mean": mean_hw(False),
    "sum_last": ReductionKernel(f32, X, "sum", 3, (-1,), False),
    "sum_first": ReductionKernel(f32, X, "sum", 3, (0,), True),
    "amax": ReductionKernel(f32, X, "amax", 4, (1, 3), False),
    "amin": ReductionKernel(f32, X, "amin", 4, (2, 3), True),
    "sum_all": ReductionKernel(f32, X, "sum", 4, (0, 1, 2, 3), False),
    "bf16_keep": mean_hw(True, bf16, bf16), "bf16_f32": mean_hw(False, bf16, f32),
    # squeeze-excite: sigmoid(mean(x * y)) with a broadcast second input
    "se": ReductionKernel([f32, bf16], op("mul", X, Y), "mean", 4, (2, 3), True,
                          out_dtype=bf16, epilogue=op("sigmoid", X)),
}


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """One cache dir for the module; every kernel above compiled up front, in parallel."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPU_LAYOUT_CACHE_DIR", str(tmp_path_factory.mktemp("kernel_cache")))
        kernels = [ALL_F32, ALL_BF16, MULTI, *CHAIN4.values(), *CHAIN_ND.values(), *RED.values()]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(lambda k: k.compile(), kernels))
        yield


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def special_values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    x[:12] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 100.0,
                           -100.0, 1.0, -1.0, 3.0, -3.0, 1e-30])
    return x


def inputs_for_ops(dtype):
    x = special_values(4096, 0)
    y = special_values(4096, 1).roll(5)
    z = torch.randint(0, 2, (4096,)).float()
    z[::7] = float("nan")
    y[::11] = x[::11]  # equal pairs for eq/ge/le
    return [t.to(dtype) for t in (x, y, z)]


@pytest.fixture(scope="module")
def op_results():
    out = {}
    for dt, k in ((f32, ALL_F32), (bf16, ALL_BF16)):
        ins = inputs_for_ops(dt)
        outs = [torch.empty(4096, dtype=dt) for _ in NAMES]
        k.compile()((4096,), ins, outs)
        out[dt] = (ins, dict(zip(NAMES, outs)))
    return out


def ordered(bits):
    b = bits.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


# Eager's own gelu(+inf) depends on the CPU's vector ISA (inf with AVX2, NaN with
# AVX-512): there either answer matches eager somewhere, so those elements are skipped.
ISA_DEPENDENT_AT_INF = {"gelu"}


def _skip_isa_dependent(name, x, got, ref):
    if name in ISA_DEPENDENT_AT_INF:
        keep = ~x.isinf()
        return got[keep], ref[keep]
    return got, ref


@pytest.mark.parametrize("name", NAMES)
def test_op_float32(op_results, name):
    (x, y, z), outs = op_results[f32]
    ref = eager(name, x, y, z)
    outs = dict(outs)
    outs[name], ref = _skip_isa_dependent(name, x, outs[name], ref)
    if name in LIBM:
        torch.testing.assert_close(outs[name], ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    else:
        torch.testing.assert_close(outs[name], ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_relu_keeps_eagers_signed_zero_and_nan(op_results, dtype):
    # relu(-0) is -0 in eager, and a NaN keeps its bits; compared bit for bit.
    (x, _, _), outs = op_results[dtype]
    ref = torch.relu(x)
    itype = torch.int32 if dtype == f32 else torch.int16
    assert torch.equal(outs["relu"].view(itype), ref.view(itype))


@pytest.mark.parametrize("name", NAMES)
def test_op_bfloat16(op_results, name):
    (x, y, z), outs = op_results[bf16]
    got = outs[name]
    ref = eager(name, x.float(), y.float(), z.float()).to(bf16)
    got, ref = _skip_isa_dependent(name, x, got, ref)
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    ulps = (ordered(got[ok]) - ordered(ref[ok])).abs()
    if name in LIBM:  # 1 ulp, or the float32 atol where cancellation leaves ~0 (gelu_tanh)
        ulps[(got[ok].float() - ref[ok].float()).abs() <= 1e-6] = 0
    worst = ulps.max().item()
    assert worst <= (1 if name in LIBM else 0), f"{name}: {worst} bf16 ulp from eager"


@pytest.mark.parametrize("native", [True, False], ids=["native_isa", "emulated"])
def test_bf16_store_rounds_to_nearest_even_and_keeps_nan(native, monkeypatch):
    """As eager rounds: to nearest even, denormals kept, NaN stays NaN; whether
    the store is the emulated rounding or (AVX512-BF16, `cl::narrow`) the
    instruction, which flushes denormals, so a vector holding one is emulated."""
    from cpu_layout import build

    if native and not build.native_isa("avx512bf16"):
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setattr(build, "native_isa", lambda f, real=build.native_isa: native and real(f))
    k = PointwiseKernel([f32], [(X, bf16)], 1)
    assert ("cl::narrow" in k._body("k")) == native
    k = k.compile()
    # Halfway cases between bf16 neighbours, both parities, plus overflow and NaN payloads,
    # over two vectors of 16 (a denormal in one) and a remainder.
    vals = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38, 1e-40,
                         float("nan"), -float("nan"), float("inf"), -1e-39, 0.0, -0.0])
    vals = torch.cat([vals, torch.randn(40), vals[:4]])
    out = torch.empty(len(vals), dtype=bf16)
    k((len(vals),), [vals], [out])
    ref = vals.to(bf16)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])
    assert torch.equal(out.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])  # -0.0


# ---------------------------------------------------------------- layouts and broadcasting
def nchw(*shape, dtype=f32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


LAYOUTS = {
    "contiguous": lambda t: t.contiguous(),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
    "sliced": lambda t: torch.cat([t, t], 3)[..., ::2],
    "permuted": lambda t: t.permute(2, 0, 3, 1).contiguous().permute(1, 3, 0, 2),
}


def empty_like_layout(t, layout):
    return LAYOUTS[layout](torch.empty_like(t, memory_format=torch.contiguous_format))


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("in_layout", list(LAYOUTS))
@pytest.mark.parametrize("out_layout", ["contiguous", "channels_last", "sliced"])
def test_chain_layouts_with_channel_broadcast(dtype, in_layout, out_layout):
    x = LAYOUTS[in_layout](nchw(2, 16, 5, 7, dtype=dtype))
    s, b = nchw(1, 16, 1, 1, dtype=dtype, seed=1), nchw(16, 1, 1, dtype=dtype, seed=2)
    out = empty_like_layout(x, out_layout)
    CHAIN4[dtype].compile()(x.shape, [x, s, b], [out])
    ref = chain_ref(x.float(), s.float(), b.float()).to(dtype)
    assert torch.equal(out, ref)  # one rounding, no FMA: bit-exact


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_squeeze_excite_broadcast(layout):
    x = LAYOUTS[layout](nchw(2, 8, 6, 6))
    se = nchw(2, 8, 1, 1, seed=3)
    zero = torch.zeros(())
    out = empty_like_layout(x, layout)
    CHAIN4[f32].compile()(x.shape, [se, x, zero], [out])  # relu(se * x + 0)
    assert torch.equal(out, torch.relu(se * x + zero))
    assert out.stride() == x.stride()


@pytest.mark.parametrize("shape", [(1, 3, 4, 5), (2, 1, 4, 5), (2, 3, 1, 5), (2, 3, 4, 1),
                                   (1, 1, 1, 1), (3, 1, 1, 7), (0, 3, 4, 5)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "weird_size1_strides"])
def test_size_one_dims_everywhere(shape, layout):
    base = nchw(*shape)
    if layout == "weird_size1_strides":  # size-1 dims with arbitrary strides (as slicing gives)
        st = [97 if n == 1 else s for n, s in zip(shape, base.stride())]
        x = torch.empty(4000).as_strided(shape, st).copy_(base)
    else:
        x = LAYOUTS[layout](base)
    s = nchw(shape[0], 1, shape[2], 1, seed=4)  # broadcast in two dims
    b = nchw(shape[-1], seed=5)  # lower rank, right-aligned
    out = torch.empty(shape).contiguous(memory_format=torch.channels_last)
    CHAIN4[f32].compile()(shape, [x, s, b], [out])
    assert torch.equal(out, chain_ref(x, s, b))


def test_0d_1d_5d():
    a, b, c = torch.tensor(1.5), torch.tensor(-2.0), torch.tensor(0.25)
    out = torch.empty(())
    CHAIN_ND[0].compile()((), [a, b, c], [out])
    assert out.item() == chain_ref(a, b, c).item()

    x = torch.randn(2001)[::2]  # strided 1-d
    out = torch.empty(1001)
    CHAIN_ND[1].compile()((1001,), [x, torch.tensor(3.0), x], [out])
    assert torch.equal(out, chain_ref(x, torch.tensor(3.0), x))

    x = torch.randn(2, 6, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    s = torch.randn(1, 6, 1, 1, 1)
    y = torch.randn(2, 6, 5, 4, 3).transpose(2, 4)
    out = torch.empty(2, 6, 3, 4, 5)
    CHAIN_ND[5].compile()(x.shape, [x, s, y], [out])
    assert torch.equal(out, chain_ref(x, s, y))


# batch 1: a size-1 dim's broadcast input stride (0) differs from the output's own
@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
def test_in_place(layout, batch):
    x = LAYOUTS[layout](nchw(batch, 8, 9, 11))
    s, b = nchw(1, 8, 1, 1, seed=1), nchw(1, 8, 1, 1, seed=2)
    ref = chain_ref(x, s, b)
    CHAIN4[f32].compile()(x.shape, [x, s, b], [x])
    assert torch.equal(x, ref)


def test_multiple_outputs_different_dtypes_and_layouts():
    x = nchw(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    y = nchw(1, 8, 1, 5, dtype=bf16, seed=1)
    o1 = torch.empty(2, 8, 5, 5)
    o2 = torch.empty(2, 8, 5, 5, dtype=bf16).contiguous(memory_format=torch.channels_last)
    o3 = torch.empty(5, 8, 5, 2, dtype=bf16).transpose(0, 3)
    MULTI.compile()(x.shape, [x, y], [o1, o2, o3])
    yf = y.float()
    assert torch.equal(o1, x * yf)
    assert torch.equal(o2, (torch.relu(x) + yf).to(bf16))
    ulps = (ordered(o3) - ordered(torch.sigmoid(yf).expand(2, 8, 5, 5).to(bf16))).abs().max()
    assert ulps <= 1


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_large_parallel_path_matches_single_thread(threads, dtype, layout):
    x = LAYOUTS[layout](nchw(4, 32, 40, 40, dtype=dtype))  # 204800 elements > threshold
    s, b = nchw(1, 32, 1, 1, dtype=dtype, seed=1), nchw(1, 32, 1, 1, dtype=dtype, seed=2)
    run = CHAIN4[dtype].compile()
    ref = chain_ref(x.float(), s.float(), b.float()).to(dtype)
    for n in (2, 1):
        threads(n)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        run(x.shape, [x, s, b], [out])
        assert torch.equal(out, ref), f"{n} threads"


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_rows_dense_in_channels_with_padded_rows(threads, dtype):
    # Channels innermost and dense (rows long enough for a call per row), rows strided (a
    # channels-last view of a wider buffer), per-channel scale and shift: the kernel runs on
    # the tensors' own memory, 1 and 2 threads, and leaves the padding alone.
    x = torch.empty(2, 17, 19, 168, dtype=dtype)[..., :160].permute(0, 3, 1, 2)
    x.copy_(nchw(2, 160, 17, 19, dtype=dtype))
    s, b = nchw(1, 160, 1, 1, dtype=dtype, seed=1), nchw(1, 160, 1, 1, dtype=dtype, seed=2)
    ref = chain_ref(x.float(), s.float(), b.float()).to(dtype)
    for n in (1, 2):
        threads(n)
        out = torch.full((2, 17, 19, 164), 7.0, dtype=dtype)
        view = out[..., 2:162].permute(0, 3, 1, 2)
        CHAIN4[dtype].compile()(x.shape, [x, s, b], [view])
        assert torch.equal(view, ref), f"{n} threads"
        assert (out[..., :2] == 7).all() and (out[..., 162:] == 7).all()  # padding untouched


# (input shape, memory format, scale's batch): NCHW times a per-channel scale and shift is rows
# of H*W (377, or 1640: three blocks and a part), one scale and shift value each, read from a
# buffer filled with it. Channels-last rows of 200 channels go ten to a call; 63 pixels per
# image leave a group of 3 at each image's end, and a scale per image repeats one row per
# image (its buffer refilled when the image changes).
ROW_CASES = {"nchw_row_in_one_block": ((2, 5, 13, 29), torch.contiguous_format, 1),
             "nchw_rows_of_blocks": ((1, 3, 40, 41), torch.contiguous_format, 1),
             "nhwc_rows_several_to_a_call": ((2, 200, 7, 9), torch.channels_last, 2)}


@pytest.mark.parametrize("case", list(ROW_CASES))
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_rows_with_a_constant_or_repeated_operand(threads, dtype, case):
    # 1 and 2 threads (the second starting mid-image), bit-identical to torch in float32.
    shape, fmt, sn = ROW_CASES[case]
    x = nchw(*shape, dtype=dtype).contiguous(memory_format=fmt)
    s, b = nchw(sn, shape[1], 1, 1, dtype=dtype, seed=1), nchw(1, shape[1], 1, 1, dtype=dtype, seed=2)
    ref = chain_ref(x.float(), s.float(), b.float()).to(dtype)
    for n in (1, 2):
        threads(n)
        out = torch.empty_like(x)
        CHAIN4[dtype].compile()(x.shape, [x, s, b], [out])
        assert torch.equal(out, ref), f"{n} threads"


def test_broadcast_buffers_across_partial_tiles(threads):
    # Rows of 100 go 5 to a tile, so each 7-row plane ends in a 2-row tile; with 2 threads the
    # second starts on such a tile and then needs the scalar's buffer for 5 rows.
    threads(2)
    x = nchw(25, 7, 100)
    s, b = torch.tensor(2.0), nchw(100, seed=1)
    out = torch.empty(25, 8, 200)[:, :7, :100]
    CHAIN_ND[3].compile()(x.shape, [x, s, b], [out])
    assert torch.equal(out, chain_ref(x, s, b))


def test_one_kernel_serves_shapes_and_strides_without_recompiling():
    run = CHAIN4[f32].compile()
    before = build.stats["compiles"]
    for shape, layout in (((2, 3, 4, 5), "contiguous"), ((7, 1, 9, 2), "channels_last"),
                          ((1, 33, 17, 3), "sliced")):
        x = LAYOUTS[layout](nchw(*shape))
        s = nchw(1, shape[1], 1, 1, seed=1)
        out = torch.empty(shape)
        run(shape, [x, s, s], [out])
        assert torch.equal(out, chain_ref(x, s, s))
    again = PointwiseKernel([f32] * 3, [(CHAIN, f32)], 4)  # structurally equal: same library
    assert again.source() == CHAIN4[f32].source()
    assert again.compile().library is run.library
    assert build.stats["compiles"] == before


# ---------------------------------------------------------------- expressions
def test_expressions_are_structural_values():
    a = op("add", op("mul", X, Const(2.0)), Load(1))
    b = op("add", op("mul", Load(0), Const(2)), Y)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert Const(0.0) != Const(-0.0) and Const(float("nan")) == Const(float("nan"))
    assert op("gelu", X) == op("gelu", X, params=("none",)) != op("gelu", X, params=("tanh",))
    k1 = PointwiseKernel([f32, f32], [(a, f32)], 2)
    k2 = PointwiseKernel([f32, f32], [(b, f32)], 2)
    assert k1.source() == k2.source() and k1.name == k2.name
    assert "add(mul(in0, 2.0), in1)" in k1.describe()


@pytest.mark.parametrize("bad", [
    lambda: Op("softmax", (X,)), lambda: Op("add", (X,)), lambda: Op("gelu", (X,), ("fast",)),
    lambda: Op("clamp", (X,), (1.0,)), lambda: Load(-1), lambda: Op("neg", (3.0,)),
    lambda: PointwiseKernel([f32], [(Load(1), f32)], 1),
    lambda: PointwiseKernel([torch.float16], [(X, f32)], 1),
    lambda: PointwiseKernel([f32], [], 1),
    lambda: PointwiseKernel([f32], [("x", f32)], 1),
    lambda: ReductionKernel(f32, X, "prod", 2, (0,)),
    lambda: ReductionKernel(f32, X, "sum", 2, (2,)),
    lambda: ReductionKernel(f32, X, "sum", 2, (0,), epilogue=Load(1)),
])
def test_invalid_construction_raises_value_error(bad):
    with pytest.raises(ValueError):
        bad()


# ---------------------------------------------------------------- bad input at run time
def test_bad_run_arguments_raise_value_error():
    run = CHAIN4[f32].compile()
    x, s = torch.randn(2, 3, 4, 5), torch.randn(1, 3, 1, 1)
    out = torch.empty(2, 3, 4, 5)
    cases = [
        (lambda: run(x.shape, [x, s], [out]), "expected 3 input"),
        (lambda: run(x.shape, [x, s, s], []), "expected 3 input and 1 output"),
        (lambda: run(x.shape, [x, s, s.double()], [out]), "input 2 has dtype torch.float64"),
        (lambda: run(x.shape, [x, s, s], [out.to(bf16)]), "output 0 has dtype"),
        (lambda: run(x.shape, [x, torch.randn(1, 4, 1, 1), s], [out]), "does not broadcast"),
        (lambda: run(x.shape, [x, s, s], [torch.empty(2, 3, 4, 6)]), "output 0 has shape"),
        (lambda: run((2, 3, 4), [x, s, s], [out]), "sizes must have 4"),
        (lambda: run((2, 3, 4, -5), [x, s, s], [out]), "non-negative"),
        (lambda: run((2, 3, 4, "5"), [x, s, s], [out]), "non-negative ints"),
        (lambda: run(x.shape, [x, s, torch.randn(1, 2, 3, 4, 5)], [out]), "more than"),
        (lambda: run(x.shape, [x, s, 1.0], [out]), "not a tensor"),
        (lambda: run(x.shape, [x, s, s], [torch.empty(1, 3, 4, 5).expand(2, 3, 4, 5)]),
         "broadcast"),
        # output on the input's memory with other strides: not in place, a race
        (lambda: run(x.shape, [x, s, s], [x.as_strided(x.shape, (60, 20, 1, 4))]),
         "overlaps input 0"),
    ]
    for case, msg in cases:
        with pytest.raises(ValueError, match=msg):
            case()
    two = MULTI.compile()
    o = torch.empty(2, 8, 5, 5)
    with pytest.raises(ValueError, match="overlap"):
        two(o.shape, [torch.randn(2, 8, 5, 5), torch.randn(1, 8, 1, 5).to(bf16)],
            [o, torch.empty(2, 8, 5, 5, dtype=bf16), o.view(bf16)[..., :5]])
    red = RED["mean"].compile()
    with pytest.raises(ValueError, match="shape"):
        red(x.shape, [x], [torch.empty(2, 3, 1, 1)])
    with pytest.raises(ValueError):
        RED["amax"].compile()((2, 0, 4, 5), [torch.empty(2, 0, 4, 5)], [torch.empty(2, 4)])


# ---------------------------------------------------------------- reductions
RED_CASES = {
    "mean_keep": lambda x: x.mean((2, 3), keepdim=True),
    "mean": lambda x: x.mean((2, 3)),
    "amax": lambda x: x.amax((1, 3)),
    "amin": lambda x: x.amin((2, 3), keepdim=True),
    "sum_all": lambda x: x.sum(),
}


def run_red(name, x, *extra):
    k = RED[name]
    out = torch.empty(k.output_shape(x.shape), dtype=k.out_dtype)
    k.compile()(x.shape, [x, *extra], [out])
    return out


@pytest.mark.parametrize("name", list(RED_CASES))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_reductions_float32(name, layout):
    x = LAYOUTS[layout](nchw(3, 40, 9, 10))
    x[0, 0, 0, 0] = 100.0
    torch.testing.assert_close(run_red(name, x), RED_CASES[name](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_amax_amin_propagate_nan(layout):
    x = LAYOUTS[layout](nchw(2, 4, 3, 5))
    x[1, 2, 1, 3] = float("nan")
    torch.testing.assert_close(run_red("amax", x), x.amax((1, 3)), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(run_red("amin", x), x.amin((2, 3), keepdim=True), equal_nan=True,
                               rtol=0, atol=0)


def test_sum_last_and_first_dims():
    x = torch.randn(5, 7, 300)
    torch.testing.assert_close(run_red("sum_last", x), x.sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run_red("sum_first", x), x.sum(0, keepdim=True), rtol=1e-5,
                               atol=1e-5)
    xt = torch.randn(300, 7, 5).transpose(0, 2)  # reduced dim strided
    torch.testing.assert_close(run_red("sum_last", xt), xt.sum(-1), rtol=1e-5, atol=1e-5)
    e = torch.empty(4, 0, 3)
    assert torch.equal(run_red("sum_first", e), torch.zeros(1, 0, 3))
    e = torch.empty(0, 2, 3)
    assert torch.equal(run_red("sum_first", e), torch.zeros(1, 2, 3))
    assert run_red("mean", torch.empty(2, 3, 0, 4)).isnan().all()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("name", ["bf16_keep", "bf16_f32"])
def test_reductions_bfloat16(name, layout):
    x = LAYOUTS[layout](nchw(2, 24, 14, 14, dtype=bf16))
    got = run_red(name, x)
    ref = x.float().mean((2, 3), keepdim=name == "bf16_keep")
    if got.dtype == f32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (ordered(got) - ordered(ref.to(bf16))).abs().max() <= 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_squeeze_excite_prologue_epilogue(layout):
    x = LAYOUTS[layout](nchw(2, 24, 7, 7))
    w = nchw(1, 24, 1, 7, dtype=bf16, seed=2)
    got = run_red("se", x, w)
    ref = torch.sigmoid((x * w.float()).mean((2, 3), keepdim=True))
    assert got.dtype == bf16 and got.shape == (2, 24, 1, 1)
    assert (ordered(got) - ordered(ref.to(bf16))).abs().max() <= 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_large_reduction_is_thread_count_independent(threads, layout):
    x = LAYOUTS[layout](nchw(4, 64, 32, 32))
    results = []
    for n in (1, 2):
        threads(n)
        results.append(run_red("mean_keep", x))
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], x.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)
    threads(2)
    one = LAYOUTS[layout](nchw(1, 64, 56, 56))  # few outputs: narrower blocks, still correct
    torch.testing.assert_close(run_red("mean", one), one.mean((2, 3)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 64, 56, 56), (1, 2500, 23, 23), (2, 3, 160, 160)],
                         ids=["one_block", "wider_than_a_block", "few_channels"])
def test_channels_last_reduction_shares_rows_among_threads(threads, shape):
    # One image, channels innermost: too few output blocks for two threads, so the rows
    # are shared in chunks and their sums combined in order: the same bits as one thread.
    x = LAYOUTS["channels_last"](nchw(*shape))
    x[0, 1, 0, 1] = 1e4  # a large value early in the sum: a different order would show
    results = []
    for n in (1, 2):
        threads(n)
        results.append(run_red("mean_keep", x))
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], x.double().mean((2, 3), keepdim=True).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "permuted"])
def test_channels_last_reduction_with_a_per_channel_input(threads, layout):
    # sigmoid(mean(x * s)) with s one value per channel: s repeats one row over H and W.
    x = LAYOUTS[layout](nchw(2, 40, 31, 33))
    s = nchw(2, 40, 1, 1, dtype=bf16, seed=3)
    for n in (1, 2):
        threads(n)
        got = run_red("se", x, s)
        ref = torch.sigmoid((x * s.float()).mean((2, 3), keepdim=True))
        assert (ordered(got) - ordered(ref.to(bf16))).abs().max() <= 1


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils")
def test_generated_code_needs_no_openmp_newer_than_torchs_libgomp():
    # torch's bundled libgomp stops at GOMP_5.0; a newer symbol would fail to load in torch.
    for k in (CHAIN4[bf16], RED["se"], RED["mean_keep"]):
        syms = subprocess.run(["objdump", "-T", k.compile().library.path], capture_output=True,
                              text=True, check=True).stdout
        versions = {tuple(map(int, v.split("."))) for v in re.findall(r"\(G?OMP_([\d.]+)\)", syms)}
        assert versions and max(versions) <= (5, 0), versions


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils")
@pytest.mark.parametrize("name,fn", [("silu", "expf"), ("gelu", "erff"), ("gelu_tanh", "tanhf"), ("log", "logf")])
def test_transcendental_kernels_call_vector_math(name, fn):
    # A scalar call per element made a silu kernel 7x slower than ATen's.
    from cpu_layout.codegen import cpp_kernels

    if f" {fn}(float)" not in cpp_kernels._simd_math()[0]:
        pytest.skip(f"this glibc's libmvec has no vector {fn}")
    k = PointwiseKernel([f32], [(ALL[name][0], f32)], 4)
    syms = subprocess.run(["objdump", "-T", k.compile().library.path], capture_output=True,
                          text=True, check=True).stdout
    assert re.search(rf"_ZGV\w+_{fn}\b", syms), f"{name}: no vector {fn} called"


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_exp_sigmoid_silu_over_the_whole_float_range(dtype):
    # libmvec's vector exp: at most a few float ulp from the exact value on every normal
    # result, within 2 denormal steps below e^-87.3, inf past e^88.72 (its slow path for
    # large inputs included). sigmoid and silu, whose formulas underflow as eager's do,
    # against eager. bf16: 1 ulp.
    x = torch.cat([torch.linspace(-110, 95, 200_003), torch.tensor([88.72, 88.73, -87.33, -103.0, -104.0])])
    x = x.to(dtype)
    k = PointwiseKernel([dtype], [(op("exp", X), dtype), (op("sigmoid", X), dtype),
                                  (op("silu", X), dtype)], 1)
    outs = [torch.empty_like(x) for _ in range(3)]
    k.compile()(x.shape, [x], outs)
    xf = x.float()
    if dtype == bf16:
        for got, ref in zip(outs, (xf.exp(), torch.sigmoid(xf), F.silu(xf))):
            assert (ordered(got) - ordered(ref.to(bf16))).abs().max().item() <= 1
        return
    exact = x.double().exp()
    normal = (exact >= 1.1754944e-38) & (exact < 3.4e38)
    assert ((outs[0].double() - exact) / exact)[normal].abs().max().item() <= 4e-7
    assert (outs[0].double() - exact)[exact < 1.1754944e-38].abs().max().item() <= 2 ** -148
    assert outs[0][x > 88.7229].isinf().all()
    torch.testing.assert_close(outs[1], torch.sigmoid(x), rtol=1e-6, atol=1e-37)
    torch.testing.assert_close(outs[2], F.silu(x), rtol=1e-6, atol=1e-37)


# ---- layer_norm -----------------------------------------------------------------------

# A normalisation's activation and weight dtypes: ATen's mixed form is bf16 activations with
# fp32 weight and bias (autocast).
NORM_DTYPES = pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32),
                                                            (torch.bfloat16, torch.bfloat16),
                                                            (torch.bfloat16, torch.float32)],
                                      ids=["fp32", "bf16", "bf16_fp32_params"])


@NORM_DTYPES
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)],
                         ids=["weight_bias", "weight", "none"])
def test_layer_norm_kernel_matches_aten(dtype, param_dtype, affine):
    from cpu_layout.codegen.cpp_kernels import LayerNormKernel

    has_w, has_b = affine
    k = LayerNormKernel(dtype, 1, has_w, has_b, 1e-6, param_dtype).compile()
    x = (torch.randn(3, 5, 7, 96) * 3 + 10).to(dtype)  # a large mean: two-pass statistics
    w = torch.randn(96).to(param_dtype) if has_w else None
    b = torch.randn(96).to(param_dtype) if has_b else None
    out = torch.empty_like(x)
    k(x, w, b, out)
    ref = F.layer_norm(x, (96,), w, b, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_layer_norm_kernel_over_two_dims_and_empty_rows():
    from cpu_layout.codegen.cpp_kernels import LayerNormKernel

    k = LayerNormKernel(torch.float32, 2, True, True, 1e-5).compile()
    x, w, b = torch.randn(4, 6, 10), torch.randn(6, 10), torch.randn(6, 10)
    out = torch.empty_like(x)
    k(x, w, b, out)
    torch.testing.assert_close(out, F.layer_norm(x, (6, 10), w, b))
    empty = torch.empty(0, 6, 10)
    k(empty, w, b, torch.empty_like(empty))  # nothing to do, nothing touched


def test_layer_norm_kernel_refuses_bad_arguments():
    from cpu_layout.codegen.cpp_kernels import LayerNormKernel

    k = LayerNormKernel(torch.float32, 1, True, False, 1e-5).compile()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        k(x, torch.randn(7), None, torch.empty_like(x))
    with pytest.raises(ValueError, match="contiguous"):
        k(x.t(), torch.randn(4), None, torch.empty(8, 4))
    with pytest.raises(ValueError, match="weight"):
        k(x, torch.randn(8, dtype=torch.bfloat16), None, torch.empty_like(x))


# ---- group_norm -----------------------------------------------------------------------

def _channels_innermost(x):
    return x.permute(0, *range(2, x.dim()), 1).contiguous().permute(0, x.dim() - 1, *range(1, x.dim() - 1))


GROUP_NORMS = [((2, 64, 56, 56), 1), ((3, 32, 7, 9), 8), ((4, 96, 14, 14), 32), ((2, 48, 5), 4),
               ((1, 16, 3, 4, 5), 4), ((5, 6), 3), ((2, 12, 1, 1), 12)]


@NORM_DTYPES
@pytest.mark.parametrize("affine", [(True, True), (False, True), (False, False)],
                         ids=["weight_bias", "bias", "none"])
@pytest.mark.parametrize("order,shape,groups", [(o, s, g) for o in ("contiguous", "channels_innermost")
                                                 for s, g in GROUP_NORMS if o == "contiguous" or len(s) > 2],
                         ids=str)
def test_group_norm_kernel_matches_aten(order, shape, groups, affine, dtype, param_dtype):
    """Values against ATen's group_norm in float64 on the same input (bf16: the float32
    result rounded, one bf16 step at most); the result in x's order. (ATen's own float32
    kernel is 2e-4 off where a group is one element: it computes x * a + (b - mean * a).)"""
    from cpu_layout.codegen.cpp_kernels import GroupNormKernel

    has_w, has_b = affine
    k = GroupNormKernel(dtype, has_w, has_b, 1e-5, param_dtype).compile()
    x = torch.randn(shape) * 3 + 10  # a large mean: two-pass statistics
    x = (_channels_innermost(x) if order == "channels_innermost" else x).to(dtype)
    w = (torch.rand(shape[1]) + 0.5).to(param_dtype) if has_w else None
    b = torch.randn(shape[1]).to(param_dtype) if has_b else None
    out = torch.empty_like(x)
    k(x, w, b, out, groups)
    ref = F.group_norm(x.double(), groups, None if w is None else w.double(),
                       None if b is None else b.double()).float()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=8e-3, atol=8e-3)
    assert out.stride() == x.stride()


@pytest.mark.parametrize("order", ["contiguous", "channels_innermost"])
def test_group_norm_kernel_same_bits_on_any_thread_count(threads, order):
    """One image, one group: the positions are shared among threads in chunks whose sums
    join in order, so two threads give one thread's bits."""
    from cpu_layout.codegen.cpp_kernels import GroupNormKernel

    k = GroupNormKernel(torch.float32, True, True, 1e-5).compile()
    x = torch.randn(1, 64, 56, 56)
    x = _channels_innermost(x) if order == "channels_innermost" else x
    x[0, 1, 0, 1] = 1e4  # a large value early in the sums: another order would show
    w, b = torch.rand(64) + 0.5, torch.randn(64)
    results = []
    for n in (1, 2):
        threads(n)
        out = torch.empty_like(x)
        k(x, w, b, out, 1)
        results.append(out)
    assert torch.equal(results[0], results[1])
    ref = F.group_norm(x.double(), 1, w.double(), b.double()).float()
    torch.testing.assert_close(results[0], ref, rtol=1e-5, atol=1e-5)


def test_group_norm_kernel_refuses_bad_arguments():
    from cpu_layout.codegen.cpp_kernels import GroupNormKernel

    k = GroupNormKernel(torch.float32, True, False, 1e-5).compile()
    x = torch.randn(2, 8, 4, 4)
    with pytest.raises(ValueError, match="groups"):
        k(x, torch.randn(8), None, torch.empty_like(x), 3)
    with pytest.raises(ValueError, match="weight"):
        k(x, torch.randn(7), None, torch.empty_like(x), 2)
    with pytest.raises(ValueError, match="both"):
        k(x, torch.randn(8), None, torch.empty_like(x).to(memory_format=torch.channels_last), 2)
    with pytest.raises(ValueError, match="both"):
        k(x[:, :, :, :3], torch.randn(8), None, torch.empty(2, 8, 4, 3), 2)  # a slice: not dense
    empty = torch.empty(0, 8, 4, 4)
    k(empty, torch.randn(8), None, torch.empty_like(empty), 2)  # nothing to do, nothing touched


# ---- softmax ------------------------------------------------------------------------------

SOFTMAXES = [((4, 49, 49), -1), ((3, 197), 1), ((1, 2, 1, 64), 1), ((2, 5, 70, 3), 2),
             ((2, 3, 130), 0), ((7,), 0), ((0, 5), 1), ((), 0)]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,dim", SOFTMAXES, ids=str)
def test_softmax_kernel_matches_aten(shape, dim, dtype, log):
    """Along the last dim (dense rows) and an inner one (lanes across the dims after
    it), against float64 (bf16: the float32 result rounded, one bf16 step at most)."""
    from cpu_layout.codegen.cpp_kernels import SoftmaxKernel

    k = SoftmaxKernel(dtype, log).compile()
    x = (torch.randn(shape) * 4).to(dtype)
    out = torch.empty_like(x)
    k(x, out, dim)
    ref = (F.log_softmax if log else F.softmax)(x.double(), dim)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [0, 1], ids=["inner_lanes", "rows"])
def test_softmax_kernel_special_values_as_aten(dim, log):
    """NaN anywhere, all -inf, +inf, and values whose exp under- and overflows."""
    from cpu_layout.codegen.cpp_kernels import SoftmaxKernel

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1., nan, 2.], [-inf, -inf, -inf], [inf, 1., 2.], [-1e30, 0., 1e30], [88., 89., -104.]])
    x = x if dim == 1 else x.t().contiguous()
    out = torch.empty_like(x)
    SoftmaxKernel(torch.float32, log).compile()(x, out, dim)
    ref = (F.log_softmax if log else F.softmax)(x, dim)
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-6, atol=1e-6)


def test_softmax_kernel_refuses_bad_arguments():
    from cpu_layout.codegen.cpp_kernels import SoftmaxKernel

    k = SoftmaxKernel(torch.float32, False).compile()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        k(x.t(), torch.empty(8, 4), 1)
    with pytest.raises(ValueError, match="dim"):
        k(x, torch.empty_like(x), 2)
    with pytest.raises(ValueError, match="dtype"):
        k(x.bfloat16(), torch.empty_like(x.bfloat16()), 1)


# ---- pooling ----------------------------------------------------------------------------

POOLS = [((3, 3), (2, 2), (1, 1), (1, 1), False), ((3, 3), (2, 2), (1, 1), (1, 1), True),
         ((3, 3), (1, 1), (1, 1), (1, 1), True), ((2, 2), (2, 2), (0, 0), (1, 1), False),
         ((3, 2), (2, 1), (1, 0), (2, 1), False), ((5, 5), (3, 3), (2, 2), (1, 1), True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,s,p,d,ceil", POOLS)
@pytest.mark.parametrize("channels", [37, 150])  # 150: two register-width blocks and a rest
def test_pool_kernel_matches_aten(dtype, k, s, p, d, ceil, channels):
    from cpu_layout.codegen.cpp_kernels import PoolKernel

    x = torch.randn(2, channels, 17, 13).to(dtype).contiguous(memory_format=torch.channels_last)
    x[0, 3, 4, 5] = float("nan")  # max propagates NaN as ATen does
    x[1, channels - 30, 6, 7] = float("nan")  # in the last block
    aten = torch.ops.aten
    cases = [("max", {}, aten.max_pool2d(x, k, s, p, d, ceil))]
    if d == (1, 1):
        cases += [("avg", dict(count_include_pad=incl, divisor=div), aten.avg_pool2d(x, k, s, p, ceil, incl, div))
                  for incl, div in ((True, None), (False, None), (True, 3))]
    for kind, kw, ref in cases:
        kern = PoolKernel(dtype, kind, k, s, p, d, ceil, **kw).compile()
        assert kern.kernel.output_shape(tuple(x.shape)) == tuple(ref.shape)
        out = torch.empty(ref.shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
        kern(x, out)
        tol = 1e-5 if dtype == torch.float32 or kind == "max" else 1e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)


def test_bf16_max_pool_special_values():
    # bf16 max pooling compares order keys of the bits: infinities, zeros of either sign,
    # NaNs of either sign and the largest finite values must come out as ATen's.
    from cpu_layout.codegen.cpp_kernels import PoolKernel

    x = torch.randn(1, 70, 9, 9).to(torch.bfloat16)
    bits = x.view(torch.int16)
    specials = [0x7F80, 0xFF80, 0x0000, 0x8000, 0x7FC1, 0xFFC1, 0x7F7F, 0xFF7F, 0x0001, 0x8001]
    g = torch.Generator().manual_seed(5)
    for v in specials:
        idx = torch.randint(0, x.numel(), (12,), generator=g)
        bits.view(-1)[idx] = torch.tensor(v, dtype=torch.int32).to(torch.int16)
    x[0, :, 0:3, 0:3] = float("-inf")  # a window of only -inf
    x[0, 5, 3:6, 3:6] = -0.0  # a window of only negative zeros: the value is zero
    x = x.contiguous(memory_format=torch.channels_last)
    ref = torch.ops.aten.max_pool2d(x, (3, 3), (3, 3))
    out = torch.empty(ref.shape, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    PoolKernel(torch.bfloat16, "max", (3, 3), (3, 3), (0, 0)).compile()(x, out)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def test_pool_kernel_refuses_other_layouts():
    from cpu_layout.codegen.cpp_kernels import PoolKernel

    kern = PoolKernel(torch.float32, "max", (2, 2), (2, 2), (0, 0)).compile()
    x = torch.randn(1, 4, 8, 8)  # NCHW
    with pytest.raises(ValueError, match="channels-last"):
        kern(x, torch.empty(1, 4, 4, 4))


# ---------------------------------------------------------------- bf16 math staged through floats
STAGED = [  # (input dtypes, outputs): each has vector math and a bf16 operand
    ([bf16], [(op("silu", X), bf16)]),
    ([bf16, f32], [(op("mul", op("sigmoid", Y), X), bf16), (op("exp", X), f32)]),
    ([f32], [(op("gelu", X, params=("tanh",)), bf16)]),
    # no vector math: staged only where the bf16 store is one instruction (cl::narrow)
    ([bf16, f32, f32], [(op("relu", op("add", op("mul", X, Y), Z)), bf16), (op("add", X, Z), f32)]),
]


@pytest.mark.parametrize("case", range(len(STAGED)))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_staged_bf16_math_equals_the_direct_loop(case, layout, monkeypatch):
    """Kernels with vector math over bf16, or a bf16 output where AVX512-BF16
    rounds in one instruction, run a block at a time through float
    buffers (faster); the values are the direct loop's over several blocks and
    a remainder, in any layout, and in place: the same float operations, except
    that the loops' scalar remainders (libm's, not libmvec's) fall on other
    elements, last-ulp differences there."""
    from cpu_layout.codegen import cpp_kernels

    ins, outs = STAGED[case]
    if not any(cpp_kernels._calls_vector_math(e) for e, _ in outs) and not cpp_kernels.build.native_isa(
            "avx512bf16"):
        pytest.skip("staged only with AVX512-BF16")
    staged = PointwiseKernel(ins, outs, 4)
    assert "[cl::BLOCK]" in staged._body("k"), "the staged loop is generated"
    monkeypatch.setattr(cpp_kernels, "_calls_vector_math", lambda e: False)
    monkeypatch.setattr(cpp_kernels.build, "native_isa", lambda feature: False)
    direct = PointwiseKernel(ins, outs, 4)
    assert "[cl::BLOCK]" not in direct._body("k")
    direct = direct.compile()
    monkeypatch.undo()
    staged = staged.compile()
    shape = (2, 7, 13, 23)  # 4186 elements: 8 blocks and a remainder when flat
    xs = [LAYOUTS[layout](nchw(*shape, dtype=d, seed=i)) for i, d in enumerate(ins)]
    want = [torch.empty(shape, dtype=d) for _, d in outs]
    got = [torch.empty(shape, dtype=d) for _, d in outs]
    direct(shape, xs, want)
    staged(shape, xs, got)
    for w, g in zip(want, got):  # libm and libmvec expf: within 2 float ulp, 1 bf16 ulp
        if w.dtype == bf16:
            # tanh-GELU's tail is x * (1 + tanh(u)) with tanh(u) near -1: libm's and
            # libmvec's last float ulp there (6e-8, times |x|) are many bf16 ulps of a
            # value near zero (seen on Sapphire Rapids), so those may differ absolutely
            ulps = (ordered(w) - ordered(g)).abs()
            near_zero = (w.float() - g.float()).abs() <= 1e-6
            assert (ulps <= 1).logical_or(near_zero).all(), ulps.max()
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    if outs[0][1] == ins[0]:  # in place: output 0 over input 0
        x0 = xs[0].clone()
        staged(shape, [x0] + xs[1:], [x0] + got[1:])
        assert torch.equal(x0, got[0])
