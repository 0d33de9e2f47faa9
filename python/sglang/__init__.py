"""sglang: a DeepSeek-V4 inference engine laid out as an SGLang fork."""

from sglang.version import __version__  # noqa: F401


def __getattr__(name):
    # Lazy, so `import sglang` stays cheap for CLI entry points and tests that only need a submodule.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
