"""Environment switches, read in one place so every stage agrees on them."""
import os


def _flag(name: str) -> bool:
    """An opt-in switch: on only when set to 1/true/yes/on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _unless_off(name: str) -> bool:
    """An opt-out switch: on unless set to 0/false/no/off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def debug() -> bool:
    """CPU_LAYOUT_DEBUG=1: assert every planned size/stride at run time."""
    return _flag("CPU_LAYOUT_DEBUG")


def strict() -> bool:
    """CPU_LAYOUT_STRICT=1: fallbacks become errors."""
    return _flag("CPU_LAYOUT_STRICT")


def profile() -> bool:
    """CPU_LAYOUT_PROFILE=1: the default wrapper times every call by kind
    (runtime.PROFILE); read when a graph is compiled."""
    return _flag("CPU_LAYOUT_PROFILE")


def autotune() -> bool:
    """CPU_LAYOUT_AUTOTUNE=0: conv layouts priced from the shipped table, not timed here."""
    return _unless_off("CPU_LAYOUT_AUTOTUNE")


def autotune_budget() -> float:
    """CPU_LAYOUT_AUTOTUNE_BUDGET: seconds of conv timing per compiled graph (default 2)."""
    try:
        return float(os.environ.get("CPU_LAYOUT_AUTOTUNE_BUDGET", "2"))
    except ValueError:
        return 2.0


CONV_IMPLS = ("auto", "onednn", "onednn_next", "aten", "winograd", "merge_groups")


def conv_impl() -> str:
    """CPU_LAYOUT_CONV_IMPL: which implementation runs a channels-last conv that
    both can run. auto (default): the faster measured one (plan/measure.py);
    onednn: always cpu_layout's own oneDNN, its first implementation;
    onednn_next: ours on oneDNN's next implementation for every grouped conv
    (for tests); aten: torch's bundled oneDNN wherever it can (for tests);
    winograd: ours on the Winograd kernel wherever it can (for tests);
    merge_groups: ours with the groups merged into groups of 32 channels (or 16)
    wherever ops.merge_candidates offers it (for tests)."""
    v = os.environ.get("CPU_LAYOUT_CONV_IMPL", "auto").strip().lower() or "auto"
    if v not in CONV_IMPLS:
        raise ValueError(f"CPU_LAYOUT_CONV_IMPL={v!r}: choose from {', '.join(CONV_IMPLS)}")
    return v


def pin_threads() -> bool:
    """CPU_LAYOUT_PIN_THREADS=0: leave OpenMP's worker threads where the OS puts
    them (default: pinned one per CPU, the calling thread free; threads.pin_workers)."""
    return _unless_off("CPU_LAYOUT_PIN_THREADS")


def cpp_wrapper_default() -> bool:
    return _flag("CPU_LAYOUT_CPP_WRAPPER")


def log_enabled(topic: str) -> bool:
    """CPU_LAYOUT_LOG is a comma-separated list of topics (plan, build, ...) or 'all'."""
    topics = {t.strip() for t in os.environ.get("CPU_LAYOUT_LOG", "").split(",") if t.strip()}
    return topic in topics or "all" in topics


def cache_dir() -> str:
    """Root of the on-disk artefact cache (content-hashed, shared between processes)."""
    d = os.environ.get("CPU_LAYOUT_CACHE_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cpu_layout")


def arenas() -> bool:
    """CPU_LAYOUT_ARENAS=0: C++ segments keep their buffers in size-classed blocks
    instead of one arena laid out from their first call (slower where large
    buffers are reused). Read when the segment runtime loads."""
    return _unless_off("CPU_LAYOUT_ARENAS")


ARENA_LAYOUTS = {"auto": 0, "recent": 1, "size": 2}


def arena_layout() -> int:
    """CPU_LAYOUT_ARENA_LAYOUT (for measurements): how a segment's arena is laid out,
    `recent` (each buffer where one was released last: warm in cache), `size`
    (largest first, lowest free offset: the smallest arena) or `auto` (recent,
    unless that is more than 1/16 over the largest set of buffers live at once and
    by size is smaller). Read when a graph compiles."""
    v = os.environ.get("CPU_LAYOUT_ARENA_LAYOUT", "auto").strip().lower() or "auto"
    if v not in ARENA_LAYOUTS:
        raise ValueError(f"CPU_LAYOUT_ARENA_LAYOUT must be one of {sorted(ARENA_LAYOUTS)}, got {v!r}")
    return ARENA_LAYOUTS[v]
