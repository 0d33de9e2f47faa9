"""The compile variants of the Triton kernels a block of code launches, on a CPU under Triton's interpreter.

On a GPU, Triton compiles a kernel once per variant: its constexprs, its launch options and the specialisation of its
other arguments (pointer dtypes and 16-byte alignment, ints equal to 1 or divisible by 16). The interpreter compiles
nothing, so it cannot tell when a GPU would. Inside `watching(target)` every interpreted launch still runs, and is
also keyed as `target`'s backend would key it (aot_check.Recorder: the same binder Triton's JITFunction.run uses), so
a test can ask whether the launches of one phase (a server's requests) all have variants an earlier phase (its
start-up and warm-up) already launched: the ones that did not would compile inside a request on that GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from sgl_kernel.aot_check import Recorder
from sgl_kernel.aot_targets import AotTarget


@dataclass
class VariantLog:
    """The variants launched so far (key -> first phase's label) and the current phase's label."""
    phase: str = ""
    first_seen: dict = field(default_factory=dict)  # Launch.key() -> phase that launched it first
    names: dict = field(default_factory=dict)  # Launch.key() -> kernel name

    def new_in(self, phase: str) -> list:
        """The kernel names of the variants first launched in `phase`, one entry a variant, sorted."""
        return sorted(self.names[k] for k, p in self.first_seen.items() if p == phase)


@contextlib.contextmanager
def watching(target: AotTarget):
    """Interpreted launches inside run as usual and are recorded into the yielded VariantLog under its current
    `phase`; needs TRITON_INTERPRET=1 (the kernels defined as InterpretedFunctions)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    log = VariantLog()
    recorder = Recorder(target)
    jit_of: dict = {}  # the interpreted function's Python function -> a JITFunction of it (its binder's signature)
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = jit_of.get(self.fn)
        if fn is None:
            fn = jit_of[self.fn] = JITFunction(self.fn, **self.kwargs)
        seen = len(recorder.launches)
        recorder.run(fn, args, dict(kwargs))
        for key in list(recorder.launches)[seen:]:  # a new variant is appended (dicts keep insertion order)
            log.first_seen[key] = log.phase
            log.names[key] = self.fn.__name__
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield log
    finally:
        InterpretedFunction.run = real
