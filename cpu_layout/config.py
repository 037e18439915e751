"""Environment switches, read in one place so every stage agrees on them."""
import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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
