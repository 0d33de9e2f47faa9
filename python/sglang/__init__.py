"""sglang: a DeepSeek-V4 inference engine laid out as an SGLang fork."""

__version__ = "0.1.0.dev0"


def __getattr__(name):
    # Lazy, so `import sglang` stays cheap for CLI entry points and tests that only need a submodule.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
