"""The OpenVINO column of the benchmarks (benchmark.OpenVINOCompiled): what it
computes, and its per-layer counters (scripts/breakdown.py --openvino)."""
import pytest
import torch
import torch.nn as nn

from cpu_layout import benchmark as B

pytest.importorskip("openvino", reason="scripts/test.sh installs it; a bare pytest run may not")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, groups=16, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()


def test_values_and_layer_counters_come_from_separate_compiles():
    model, x = _net(), torch.randn(2, 3, 16, 16)
    ov = B._openvino(model, "float32", False)
    y = ov(x)
    with torch.no_grad():
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
    timed = ov._ov_model
    per = B._openvino(model, "float32", False).layer_profile(x, iters=3)
    assert any(k.startswith("Convolution ") for k in per) and any(k.startswith("GroupConvolution ") for k in per)
    assert all(v > 0 for v in per.values())
    counted = ov.layer_profile(x, iters=2)
    assert any(k.startswith("Convolution ") for k in counted)
    assert ov._ov_model is timed and ov.compiles == 1, "the timed model never counts"


@pytest.mark.parametrize("dtype", ["float32", "amp"])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_openvino_through_torch_compile_runs_openvino_on_the_user_input(grad_mode, dtype):
    """The ovdyn column: Dynamo's frame around OpenVINO's compute, one compile,
    every call through the backend, values as eager's (fp32 eager's; under amp
    OpenVINO computes in bf16 where the machine has it, at bf16's tolerance)."""
    model, x = _net(), torch.randn(2, 3, 16, 16)
    tol = 1e-4 if dtype == "float32" else 3e-2
    c = B.compile_model(model, "openvino_dynamo", dtype)
    other = x * -2.0  # another input's values: not the first call's served again
    with grad_mode():
        want = model(x)
        c.first_call(x)
        c.mark()
        for xi in (x, other):
            torch.testing.assert_close(c(xi), model(xi), rtol=tol, atol=tol)
    torch.testing.assert_close(c.first_output, want, rtol=tol, atol=tol)
    assert c.compiles == 1
    c.check_own_code(expected_calls=2)


def test_openvino_through_torch_compile_refuses_what_it_cannot_measure():
    with pytest.raises(B.NotSupportedYet, match="static shapes"):
        B.compile_model(_net(), "openvino_dynamo", "float32", dynamic=True)

    class TwoInputs(nn.Module):
        def forward(self, a, b):
            return a + b

    c = B.compile_model(TwoInputs(), "openvino_dynamo", "float32")
    with torch.no_grad(), pytest.raises(Exception, match="2 user inputs"):
        c.fn(torch.ones(2), torch.ones(2))
