"""Loads the oneDNN extension (csrc/, built by setup.py through cffi).

torch is imported first on purpose: it loads its bundled libgomp, and oneDNN
then binds to that same OpenMP runtime, so `torch.set_num_threads` governs
both and the process holds one thread pool.
"""
import torch  # noqa: F401  (must precede the extension; see above)

def _preload_onednn():
    """Load libdnnl.so.3 from this environment's lib/ (where onednn-cpu-gomp
    puts it) when the extension's rpath does not lead there, e.g. a build
    made in one place and installed in another."""
    import ctypes
    import glob
    import os
    import sys

    for prefix in dict.fromkeys((sys.prefix, sys.exec_prefix, sys.base_prefix)):
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libdnnl.so.3*"))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


try:
    try:
        from cpu_layout._dnnl import ffi, lib
    except ImportError as first:
        if "libdnnl" not in str(first) or not _preload_onednn():
            raise
        from cpu_layout._dnnl import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "cpu_layout's oneDNN extension is not built or cannot find libdnnl.so.3 "
        f"({exc}). Reinstall with `pip install .` in an environment that has "
        "onednn-cpu-gomp==2023.2.0."
    ) from exc

EXPECTED_DNNL = (3, 2)


def _check_version():
    v = [ffi.new("int *") for _ in range(3)]
    lib.cl_dnnl_version(*v)
    got = tuple(p[0] for p in v)
    if got[:2] != EXPECTED_DNNL:
        raise ImportError(
            f"cpu_layout was built for oneDNN {EXPECTED_DNNL[0]}.{EXPECTED_DNNL[1]} but loaded "
            f"{got[0]}.{got[1]}.{got[2]}; reinstall onednn-cpu-gomp==2023.2.0"
        )
    return got


DNNL_VERSION = _check_version()

def check(rc):
    """Turn a C ABI failure into a Python exception carrying the reason."""
    if rc != 0:
        msg = ffi.string(lib.cl_last_error()).decode("utf-8", "replace")
        if msg.startswith("oneDNN error") or msg == "out of memory":
            raise RuntimeError(msg)
        raise ValueError(msg)


def cpu_isa() -> str:
    buf = ffi.new("char[]", 64)
    lib.cl_cpu_isa(buf, 64)
    return ffi.string(buf).decode()


def native_bf16() -> bool:
    """True when oneDNN has fast bf16 convolution kernels on this CPU."""
    return bool(lib.cl_native_bf16())
