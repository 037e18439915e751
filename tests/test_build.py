"""cpu_layout.build: disk cache, atomic publication, rebuilds, errors, OpenMP runtime sharing."""
import multiprocessing as mp
import os

import pytest
import torch

from cpu_layout import build

SRC = 'extern "C" int answer(int x) { return x + 42; }\n'
CDEF = "int answer(int x);"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    build.clear_memory_cache()
    yield tmp_path / "cache"
    build.clear_memory_cache()


def compiles(fn):
    before = build.stats["compiles"]
    result = fn()
    return result, build.stats["compiles"] - before


def test_cache_dir_respected_and_layout(cache):
    lib, n = compiles(lambda: build.load_library(SRC, CDEF))
    assert n == 1 and lib.lib.answer(1) == 43
    assert os.path.dirname(lib.path) == str(cache / "kernels" / lib.key[:2])
    assert lib.path.endswith(lib.key + ".so") and os.path.exists(lib.path[:-3] + ".cpp")
    leftovers = [f for f in os.listdir(os.path.dirname(lib.path)) if f.startswith(".tmp-")]
    assert leftovers == []


def test_second_load_hits_memory_then_disk(cache):
    first, n = compiles(lambda: build.load_library(SRC, CDEF))
    assert n == 1
    mtime = os.stat(first.path).st_mtime_ns
    again, n = compiles(lambda: build.load_library(SRC, CDEF))
    assert n == 0 and again is first
    build.clear_memory_cache()
    disk, n = compiles(lambda: build.load_library(SRC, CDEF))
    assert n == 0 and disk is not first and disk.path == first.path
    assert os.stat(disk.path).st_mtime_ns == mtime and disk.lib.answer(0) == 42


def test_flags_and_source_change_the_key(cache):
    a = build.load_library(SRC, CDEF)
    b = build.load_library(SRC.replace("42", "7"), CDEF)
    c = build.load_library(SRC, CDEF, flags=build.CXXFLAGS + ("-DVARIANT",))
    assert len({a.path, b.path, c.path}) == 3
    assert (a.lib.answer(0), b.lib.answer(0), c.lib.answer(0)) == (42, 7, 42)


def test_key_covers_compiler_and_format_version(monkeypatch):
    k = build.cache_key(SRC)
    monkeypatch.setattr(build, "FORMAT_VERSION", build.FORMAT_VERSION + 1)
    assert build.cache_key(SRC) != k
    monkeypatch.undo()
    monkeypatch.setattr(build, "_toolchain_id", "g++ (other) 1.0\n-march=x")
    assert build.cache_key(SRC) != k


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "wrong_library"])
def test_corrupt_cached_library_is_rebuilt(cache, tmp_path, monkeypatch, damage):
    # Damage the file in a cache this process has not loaded it from (as a crashed or foreign
    # writer would leave it; dlopen would otherwise hand back the already-mapped copy).
    good = build.load_library(SRC, CDEF)
    other = build.load_library('extern "C" int other(void) { return 1; }', "int other(void);")
    fresh_dir = tmp_path / "cache2"
    monkeypatch.setenv("CPU_LAYOUT_CACHE_DIR", str(fresh_dir))
    path = str(fresh_dir / "kernels" / good.key[:2] / (good.key + ".so"))
    os.makedirs(os.path.dirname(path))
    data = open(good.path, "rb").read()
    damaged = {"truncate": data[: len(data) // 2], "garbage": b"\x7fELF not really",
               "empty": b"", "wrong_library": open(other.path, "rb").read()}[damage]
    open(path, "wb").write(damaged)
    fresh, n = compiles(lambda: build.load_library(SRC, CDEF))
    assert n == 1 and fresh.path == path and fresh.lib.answer(1) == 43
    assert open(path, "rb").read() != damaged


def test_syntax_error_raises_build_error_with_message(cache):
    with pytest.raises(build.BuildError) as ei:
        build.load_library('extern "C" int broken( { return 0 }', "int broken(void);")
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert "error" in str(err) and "broken" in str(err)
    assert err.source_path and os.path.exists(err.source_path)
    assert "broken" in open(err.source_path).read()
    assert not any(f.endswith(".so") for _, _, fs in os.walk(cache) for f in fs)


def test_build_log(cache, monkeypatch, capfd):
    monkeypatch.setenv("CPU_LAYOUT_LOG", "build")
    build.load_library(SRC, CDEF)
    build.clear_memory_cache()
    build.load_library(SRC, CDEF)
    err = capfd.readouterr().err
    assert "compile: g++ -O3 -march=native" in err and "cache hit" in err


def _child(cache_dir, src, barrier, q):
    os.environ["CPU_LAYOUT_CACHE_DIR"] = cache_dir
    from cpu_layout import build as b
    b.toolchain_id()
    barrier.wait(timeout=60)  # start the builds together so they really race
    lib = b.load_library(src, CDEF)
    q.put((lib.path, lib.lib.answer(1), b.stats["compiles"]))


def test_two_processes_build_concurrently(cache):
    src = SRC + "// concurrent\n"
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_child, args=(str(cache), src, barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][:2] == results[1][:2] and results[0][1] == 43
    assert sum(r[2] for r in results) == 1  # the lock made the loser reuse the winner's build
    # The published file is complete and loads here without a compile.
    lib, n = compiles(lambda: build.load_library(src, CDEF))
    assert n == 0 and lib.path == results[0][0]


OMP_SRC = r"""
#include <omp.h>
extern "C" int max_threads(void) { return omp_get_max_threads(); }
extern "C" int team_size(void) {
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
}
"""


def test_openmp_follows_torch_set_num_threads(cache):
    lib = build.load_library(OMP_SRC, "int max_threads(void); int team_size(void);").lib
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert (lib.max_threads(), lib.team_size()) == (1, 1)
        torch.set_num_threads(2)
        assert (lib.max_threads(), lib.team_size()) == (2, 2)
    finally:
        torch.set_num_threads(old)
    # One OpenMP runtime in the process: torch's bundled libgomp serves our library too.
    maps = open("/proc/self/maps").read()
    gomps = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    assert len(gomps) == 1 and "torch" in next(iter(gomps))
