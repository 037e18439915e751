"""Compile generated C++ into a shared library (content-hashed disk cache) and load it with cffi.

Cache layout: ``<config.cache_dir()>/kernels/<h[:2]>/<h>.so`` (with ``<h>.cpp`` beside it for
inspection), where ``h`` hashes the source, the compiler flags, the compiler's version and the
exact target ISA ``-march=native`` resolved to, and FORMAT_VERSION. Files are written to a temp
file in the same directory and published with ``os.replace``, so processes sharing the cache only
ever see complete files; an advisory lock keeps two of them from compiling the same thing twice.
"""
import fcntl
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass

# torch first: it loads its bundled libgomp (soname libgomp.so.1), and our -fopenmp libraries
# then bind to that copy at dlopen time, so torch.set_num_threads governs generated kernels too.
import torch  # noqa: F401
import cffi

from cpu_layout import config

# Bump when the cache layout or anything the key does not capture changes.
FORMAT_VERSION = 1

CXX = "g++"
# -ffp-contract=off: GCC's default (fast) fuses a*b+c into one FMA, which rounds once where eager's
# separate mul and add kernels round twice; with it off, fused chains of add/sub/mul/div are
# bit-identical to eager (tested). -fno-math-errno lets sqrt vectorise and changes no result.
CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            "-ffp-contract=off", "-fno-math-errno")

_STDERR_LIMIT = 4000


def torch_link_flags() -> tuple:
    """Link against libtorch_cpu (the ATen C shim cpp_wrapper segments call).
    torch has already loaded it, so the rpath only matters outside torch."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return (f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")


class BuildError(RuntimeError):
    """The compiler rejected generated code. ``source_path`` is kept for inspection."""

    def __init__(self, message, source_path=None, stderr=""):
        super().__init__(message)
        self.source_path = source_path
        self.stderr = stderr


@dataclass(frozen=True)
class Library:
    lib: object  # cffi ABI-mode handle with the cdef declared
    ffi: cffi.FFI
    path: str
    key: str


# Counters for tests and logging: compiles run, libraries loaded from disk, in-process hits.
stats = {"compiles": 0, "disk_hits": 0, "memo_hits": 0}

_memo = {}
_memo_lock = threading.Lock()
_toolchain_id = None


def _log(msg):
    if config.log_enabled("build"):
        print(f"[cpu_layout.build] {msg}", file=sys.stderr, flush=True)


def toolchain_id() -> str:
    """Compiler version line plus the options -march=native expands to on this CPU (computed once).

    The expansion is in the key so a cache shared between machines never hands one CPU code built
    for another's ISA (that would be SIGILL, not an exception).
    """
    global _toolchain_id
    if _toolchain_id is None:
        try:
            ver = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
            version = ver.stdout.splitlines()[0].strip()
            probe = subprocess.run([CXX, "-march=native", "-E", "-v", "-"], input="",
                                   capture_output=True, text=True)
            cc1 = [ln for ln in probe.stderr.splitlines() if " -march=" in ln]
            march = " ".join(t for t in (cc1[0].split() if cc1 else [])
                             if t.startswith(("-m", "--param")) or "cache" in t)
        except (OSError, subprocess.CalledProcessError, IndexError) as exc:
            raise BuildError(f"C++ compiler {CXX!r} is not usable: {exc}") from exc
        _toolchain_id = version + "\n" + march
    return _toolchain_id


def native_isa(feature: str) -> bool:
    """Whether -march=native enables `feature` (e.g. "avx512bf16") for the code built here."""
    return f"-m{feature} " in toolchain_id().split("\n", 1)[-1] + " "


def cache_key(source: str, flags=CXXFLAGS) -> str:
    h = hashlib.sha256()
    for part in (f"format={FORMAT_VERSION}", toolchain_id(), " ".join(flags), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def clear_memory_cache():
    """Forget in-process handles (tests use this to exercise the disk cache)."""
    with _memo_lock:
        _memo.clear()


def _atomic_write(path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _elf_complete(path) -> bool:
    """True if the file is a 64-bit ELF whose segments and section table all lie inside it.

    dlopen maps segments without checking the file is long enough, and touching a page past
    EOF is SIGBUS, so a truncated file must be caught before it is loaded.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            hdr = f.read(64)
            if len(hdr) < 64 or hdr[:5] != b"\x7fELF\x02":
                return False
            phoff, shoff = struct.unpack_from("<QQ", hdr, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", hdr, 54)
            if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
                return False
            f.seek(phoff)
            ph = f.read(phnum * phentsize)
            for i in range(phnum):
                _, _, off, _, _, filesz = struct.unpack_from("<IIQQQQ", ph, i * phentsize)
                if off + filesz > size:
                    return False
    except (OSError, struct.error):
        return False
    return True


def _open(path, cdef):
    """dlopen and resolve every declared symbol; None if the file is missing or unusable."""
    if not os.path.exists(path):
        return None
    if not _elf_complete(path):
        _log(f"cached {path} is not a complete ELF file; rebuilding")
        return None
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    try:
        lib = ffi.dlopen(path)
    except OSError as exc:
        _log(f"cached {path} is unloadable ({exc}); rebuilding")
        return None
    try:
        for name in dir(lib):  # ABI mode resolves lazily; force it so a bad file is caught now
            getattr(lib, name)
    except (AttributeError, cffi.FFIError) as exc:
        _log(f"cached {path} lacks declared symbols ({exc}); rebuilding")
        ffi.dlclose(lib)  # else dlopen of the rebuilt file would return this stale handle
        return None
    return ffi, lib


def _compile(source, src_path, so_path, flags):
    _atomic_write(src_path, source.encode())
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(so_path), prefix=".tmp-", suffix=".so")
    os.close(fd)
    # Libraries after the source, or the linker drops them as unneeded.
    libs = [f for f in flags if f.startswith(("-l", "-L", "-Wl,"))]
    cmd = [CXX, *[f for f in flags if f not in libs], src_path, "-o", tmp, *libs]
    _log("compile: " + " ".join(cmd))
    stats["compiles"] += 1
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        _unlink(tmp)
        raise BuildError(f"cannot run {CXX}: {exc}", src_path) from exc
    if proc.returncode != 0:
        _unlink(tmp)
        err = proc.stderr.strip()
        if len(err) > _STDERR_LIMIT:
            err = err[:_STDERR_LIMIT] + "\n... (truncated)"
        raise BuildError(f"compiling {src_path} failed:\n{err}", src_path, proc.stderr)
    os.replace(tmp, so_path)


class Once:
    """What `make()` returns, made once per process on first use. `prefetch()`
    starts making it in a background thread, so that a first compile traces
    while g++ runs; `get()` makes it or waits for it. A failure is not
    remembered: `get()` tries again and raises it where the value is needed."""

    _all: "weakref.WeakSet[Once]" = weakref.WeakSet()

    def __init__(self, make, name: str):
        self._make = make
        self._name = name
        self._lock = threading.Lock()
        self._done = False
        self._value = None
        Once._all.add(self)

    @classmethod
    def _after_fork_in_child(cls):
        # A child forked while a background build held the lock would wait on it forever.
        for once in list(cls._all):
            once._lock = threading.Lock()

    def get(self):
        if not self._done:
            with self._lock:
                if not self._done:
                    self._value = self._make()
                    self._done = True
        return self._value

    def prefetch(self) -> None:
        if self._done or self._lock.locked():
            return

        def quietly():
            try:
                self.get()
            except Exception:  # noqa: BLE001 - get() raises it again where it is needed
                pass

        threading.Thread(target=quietly, name=f"cpu_layout {self._name} build", daemon=True).start()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=Once._after_fork_in_child)


def load_library(source: str, cdef: str, *, name_hint: str = "k", flags=CXXFLAGS) -> Library:
    """Compile ``source`` (or reuse the cached build) and dlopen it with ``cdef`` declared.

    ``name_hint`` only labels log lines. Raises BuildError if the compiler fails.
    """
    flags = tuple(flags)
    key = cache_key(source, flags)
    d = os.path.join(config.cache_dir(), "kernels", key[:2])
    so_path = os.path.join(d, key + ".so")
    memo_key = (so_path, cdef)
    with _memo_lock:
        hit = _memo.get(memo_key)
    if hit is not None:
        stats["memo_hits"] += 1
        return hit

    os.makedirs(d, exist_ok=True)
    opened = _open(so_path, cdef)
    if opened is not None:
        stats["disk_hits"] += 1
        _log(f"cache hit {name_hint}: {so_path}")
    else:
        # Serialise builders of the same key across processes; the loser of the race finds the
        # finished file. If locking is unavailable (some network filesystems) just build.
        with open(os.path.join(d, key + ".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:
                pass
            opened = _open(so_path, cdef)
            if opened is None:
                _compile(source, os.path.join(d, key + ".cpp"), so_path, flags)
                opened = _open(so_path, cdef)
                if opened is None:
                    raise BuildError(f"freshly built {so_path} cannot be loaded",
                                     os.path.join(d, key + ".cpp"))
            else:
                stats["disk_hits"] += 1
                _log(f"cache hit {name_hint} (built concurrently): {so_path}")
    ffi, lib = opened
    result = Library(lib=lib, ffi=ffi, path=so_path, key=key)
    with _memo_lock:
        result = _memo.setdefault(memo_key, result)
    return result


def csrc(name: str) -> str:
    """Text of csrc/<name>: the source tree's, or the copy an installed package carries."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "..", "..", "csrc"), os.path.join(here, "..", "csrc")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
    raise FileNotFoundError(f"cpu_layout needs csrc/{name} (install cpu_layout from its source tree)")
