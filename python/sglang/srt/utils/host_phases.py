"""Where the host's time goes in scheduler steps, by phase, without the profiler (CUPTI would slow every launch).

`time_host_phases(scheduler, steps)` runs `steps` scheduler steps (or `steps` calls of `step`) with wall-clock timers
around the phases of a step and returns their mean milliseconds per step:
- allocate: slots of the step's new positions (`plan_extend`, and `write_slots` outside the decode graphs);
- batch: the forward batch's index arrays and their copy to the device (`ScheduleBatch.to_forward_batch`; eager
  forwards only);
- metadata: the attention backend's metadata of an eager forward (`ModelRunner.attach`);
- forward: the host side of the forward (a graph replay: the input copy and one launch; eager: every launch);
- sample: the sampler's launches, until its read-back;
- wait: the read-back of the sampled tokens, i.e. the host waiting for the device to finish the step (under
  overlap scheduling, the previous step: the current one is already queued behind it);
- finish: committing tokens, stop checks, window release;
- other: the rest of the step (admission, batch building, bookkeeping).
A step whose `wait` is most of it is device-bound; host-bound when the other phases add up to more than the device
time. Without overlap scheduling they all run while the device idles; in an extend step allocate, batch and metadata
come before its first kernel, so the device idles through them whatever else runs.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, fields
from typing import Callable, Optional
from unittest import mock


@dataclass
class HostPhases:
    steps: int
    step_ms: float
    allocate_ms: float
    batch_ms: float
    metadata_ms: float
    forward_ms: float
    sample_ms: float
    wait_ms: float
    finish_ms: float
    other_ms: float

    def columns(self) -> str:
        return " | ".join(f"{f.name[:-3]} {getattr(self, f.name):6.2f}" for f in fields(self)[1:]) + " ms/step"


def time_host_phases(scheduler, steps: int, step: Optional[Callable[[], object]] = None) -> HostPhases:
    """`steps` calls of `step` (default: `scheduler.step`), timed by phase (module docstring)."""
    import sglang.srt.managers.scheduler as scheduler_module
    import sglang.srt.managers.scheduler_output_processor_mixin as output_module
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.utils.device_readback import ReadBack

    spent = {"allocate": 0.0, "batch": 0.0, "metadata": 0.0, "forward": 0.0, "sample": 0.0, "wait": 0.0,
             "finish": 0.0}

    def timed(real, phase: str, minus: tuple = ()):
        def wrapper(*args, **kwargs):
            start, inner = time.perf_counter(), sum(spent[p] for p in minus)
            try:
                return real(*args, **kwargs)
            finally:  # time inside nested phases counts there only
                spent[phase] += time.perf_counter() - start - (sum(spent[p] for p in minus) - inner)
        return wrapper

    runner = scheduler.runner
    with ExitStack() as stack:
        for target, name, phase, minus in [
            (scheduler.allocator, "plan_extend", "allocate", ()), (scheduler.allocator, "write_slots", "allocate", ()),
            (ScheduleBatch, "to_forward_batch", "batch", ()), (runner, "attach", "metadata", ()),
            (runner, "forward_decode", "forward", ()), (runner, "forward", "forward", ("metadata",)),
            (output_module, "sample", "sample", ("wait",)), (scheduler_module, "sample_async", "sample", ()),
            (ReadBack, "wait", "wait", ()),
            (scheduler, "finish_step", "finish", ()),
        ]:
            stack.enter_context(mock.patch.object(target, name, timed(getattr(target, name), phase, minus)))
        step = step or scheduler.step
        start = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - start
    ms = {p: v / steps * 1e3 for p, v in spent.items()}
    step_ms = total / steps * 1e3
    return HostPhases(steps, step_ms, *(ms[p] for p in spent), step_ms - sum(ms.values()))
