"""cffi build script for the oneDNN extension `cpu_layout._dnnl`.

Used by setup.py (`cffi_modules`). oneDNN comes from the pip packages
`onednn-cpu-gomp` (library, installed as data under `<prefix>/lib`) and
`onednn-devel-cpu-gomp` (headers under `<prefix>/include`). Under pip's build
isolation these live in a temporary prefix, so we search every prefix that
Python can see rather than assuming `sys.prefix`.
"""
import glob
import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "cl_api.h")


def _candidate_prefixes():
    seen = []

    def add(p):
        p = os.path.abspath(p)
        if p not in seen:
            seen.append(p)

    if os.environ.get("CPU_LAYOUT_DNNL_ROOT"):
        add(os.environ["CPU_LAYOUT_DNNL_ROOT"])
    for p in (sys.prefix, sys.exec_prefix, sys.base_prefix):
        add(p)
    # <prefix>/lib/pythonX.Y/site-packages -> <prefix>; covers build-isolation
    # environments, which pip puts on sys.path.
    for entry in sys.path:
        parts = os.path.abspath(entry or ".").split(os.sep)
        if "site-packages" in parts:
            i = parts.index("site-packages")
            add(os.sep.join(parts[: i - 2]) or os.sep)
    return seen


def find_onednn():
    """Return (include_dir, lib_dir) of an installed oneDNN 3.2 (GNU OpenMP build)."""
    tried = []
    for prefix in _candidate_prefixes():
        inc = os.path.join(prefix, "include")
        lib = os.path.join(prefix, "lib")
        tried.append(prefix)
        if os.path.isfile(os.path.join(inc, "oneapi", "dnnl", "dnnl.hpp")) and glob.glob(
            os.path.join(lib, "libdnnl.so*")
        ):
            return inc, lib
    raise RuntimeError(
        "oneDNN not found. Install it with\n"
        "  pip install onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0\n"
        "or set CPU_LAYOUT_DNNL_ROOT to a prefix holding include/oneapi/dnnl and lib/libdnnl.so.\n"
        "Searched: " + ", ".join(tried)
    )


def _link_name(lib_dir):
    # The runtime package ships only the versioned file; link it by name.
    if os.path.exists(os.path.join(lib_dir, "libdnnl.so")):
        return ["dnnl"], []
    versioned = sorted(glob.glob(os.path.join(lib_dir, "libdnnl.so.*")))
    return [], ["-l:" + os.path.basename(versioned[0])]


def _build_rpath(lib_dir):
    # An in-place (editable) build sits outside site-packages, so $ORIGIN does
    # not lead to the library; point at the build-time copy unless that is
    # pip's throw-away build-isolation prefix (named pip-build-env-*).
    if "pip-build-env-" in os.path.abspath(lib_dir):
        return []
    return ["-Wl,-rpath," + lib_dir]


def _cdef_source():
    # cffi's cdef takes plain declarations; strip the comment blocks.
    import re

    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return text


inc_dir, lib_dir = find_onednn()
libs, extra_link = _link_name(lib_dir)

ffibuilder = FFI()
ffibuilder.cdef(_cdef_source())
ffibuilder.set_source(
    "cpu_layout._dnnl",
    '#include <stdint.h>\nextern "C" {\n#include "cl_api.h"\n}\n',
    source_extension=".cpp",
    sources=[os.path.relpath(os.path.join(HERE, f)) for f in ("conv.cpp", "qconv.cpp", "qpool.cpp", "winograd.cpp", "shuffle.cpp", "threads.cpp")],
    # oneDNN's include dir first, so no other copy of its headers can win.
    include_dirs=[inc_dir, HERE],
    library_dirs=[lib_dir],
    libraries=libs + ["stdc++"],
    # -fopenmp: the dtype-cast loops; libgomp.so.1 resolves to torch's copy,
    # which is loaded first (see cpu_layout/_native.py).
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-fopenmp"],
    # site-packages/cpu_layout/_dnnl*.so -> <prefix>/lib holds libdnnl.so.3.
    extra_link_args=extra_link + ["-fopenmp", "-Wl,-rpath,$ORIGIN/../../.."] + _build_rpath(lib_dir),
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
