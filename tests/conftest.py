import os
import zlib

import pytest
import torch

from cpu_layout import config

# The suite compiles into a cache of its own: conv timings taken while it loads
# the machine must not become the measurements the user's own compiles plan with.
if "CPU_LAYOUT_CACHE_DIR" not in os.environ:
    os.environ["CPU_LAYOUT_CACHE_DIR"] = config.cache_dir() + "-tests"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws its random inputs from a seed of its own id, so a
    failure on one machine reproduces on another."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _threads_restored():
    """Torch's thread count as each test found it, whatever the test (or a script it
    runs in-process) set: costs, plans and kernels depend on it, so a leaked count
    made later tests' results depend on their order."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def strict_compile(monkeypatch):
    """Fallbacks are errors (CPU_LAYOUT_STRICT=1); Dynamo starts and ends clean."""
    monkeypatch.setenv("CPU_LAYOUT_STRICT", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def compiled_graphs(monkeypatch):
    """Every wrapper the backend generates, in order."""
    from cpu_layout import backend

    made = []
    real = backend.compile_graph

    def spy(gm, inputs, options, *rest):
        call = real(gm, inputs, options, *rest)
        made.append(call)
        return call

    monkeypatch.setattr(backend, "compile_graph", spy)
    return made


@pytest.fixture(params=["default", "cpp"])
def wrapper(request, monkeypatch):
    """Runs a test under both wrappers (CPU_LAYOUT_CPP_WRAPPER selects); modules
    that want it for every test list it in `pytestmark`."""
    monkeypatch.setenv("CPU_LAYOUT_CPP_WRAPPER", "1" if request.param == "cpp" else "0")
    return request.param
