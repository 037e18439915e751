"""The benchmark harness (cpu_layout/benchmark.py): a guard filter reaches Dynamo
and the filtered compile still runs our code with eager's values."""
import torch

from cpu_layout import benchmark as B
from cpu_layout import models


def test_guard_filter_reaches_dynamo_and_our_code_runs():
    model, x = models.build("resnet18", batch_size=2)
    seen = []

    def keep_input_guards(entries):
        seen.append(len(entries))
        return torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe(entries)

    with torch.no_grad():
        c = B.compile_model(model, "cpu_layout", wrapper="cpp", guard_filter_fn=keep_input_guards)
        xi = c.prepare_input(x)
        c.first_call(xi)
        y = c.fn(xi)
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
        assert y.stride() == model(x).stride()
        c.check_own_code(2)
    assert seen and seen[0] > 0, "Dynamo asked the filter about its guards"
    torch._dynamo.reset()
