"""Triton kernels that compile (or load from the on-disk cache) after the server's warm-up, logged and counted.

The warm-up (managers/server_warmup.py) runs the launch variants a prefill can pick, so that no user's request waits
for a compile. Where it misses one, that request stalls for the compile, and so does every request decoding beside
it (one H100 step of 2.4 s against a median of 0.23 s while ten variants compiled: RESULTS.md, "Serving"). The watch
makes such a miss visible where it happens: Triton calls its `jit_cache_hook` whenever a kernel's in-memory cache has
no entry for a launch's variant, and the watch logs the kernel and the variant (its argument types with their
specialisations, warps, stages) once each, as a warning.
`scripts/gpu_flash_12l256e.sh` counts those lines in the server's log.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

logger = logging.getLogger(__name__)

LOG_PREFIX = "Triton kernel variant compiled after the warm-up"


class CompileWatch:
    """Counts the kernel variants compiled while installed (`counts`: kernel name -> variants) and logs each."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._previous = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __call__(self, *, key=None, repr=None, fn=None, **kwargs) -> bool:
        name = getattr(fn, "name", "?")
        self.counts[name] += 1
        try:
            variant = describe_variant(name, kwargs["compile"])
        except (KeyError, TypeError, AttributeError, IndexError):  # another Triton's hook arguments
            variant = repr or name
        logger.warning("%s: %s", LOG_PREFIX, variant)
        previous = self._previous
        return bool(previous(key=key, repr=repr, fn=fn, **kwargs)) if previous is not None else False  # False: compile


def describe_variant(name: str, compile: dict) -> str:
    """`name[warps, stages](args)` of the variant Triton is about to compile: every runtime argument with its
    specialisation (`/16`: divisible by 16; `=1`: an int passed as 1, compiled as a constant) and the tile
    constexprs (upper-case names), from the hook's `compile` argument."""
    signature, constants = compile["signature"], compile.get("constants") or {}
    attrs = (compile.get("configs") or [{}])[0] or {}
    args = []
    for i, (arg, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            value = constants.get((i,))
            if arg[:1].isupper() or value == 1:
                args.append(f"{arg}={value}")
            continue
        divisible = any(a[0] == "tt.divisibility" and a[1] >= 16 for a in attrs.get((i,), ()))
        args.append(f"{arg}:{ty}{'/16' if divisible else ''}")
    return f"{name}[warps={compile.get('num_warps')}, stages={compile.get('num_stages')}]({', '.join(args)})"


def watch_compiles() -> Optional[CompileWatch]:
    """Install a CompileWatch as Triton's jit_cache_hook (chaining the hook already there); None where this Triton
    has no such hook."""
    try:
        import triton
        runtime = triton.knobs.runtime
    except (ImportError, AttributeError):
        return None
    if not hasattr(runtime, "jit_cache_hook"):
        return None
    watch = CompileWatch()
    watch._previous = runtime.jit_cache_hook
    runtime.jit_cache_hook = watch
    return watch


def unwatch(watch: CompileWatch) -> None:
    """Put back the hook that was there before `watch`."""
    import triton
    if triton.knobs.runtime.jit_cache_hook is watch:
        triton.knobs.runtime.jit_cache_hook = watch._previous
