"""Where a step's time goes: GPU-busy fraction, kernel launches and host syncs per step, from torch.profiler.

profile_steps() runs a step function under torch.profiler (one unrecorded warm-up step, then `steps` recorded ones,
each inside a STEP_MARK range) and summarize() turns the trace into a StepProfile. summarize() is a pure function of
plain TraceEvent records, so it is tested on CPU with synthetic events. Run the profile in a pass of its own, after
the timed one: the profiler adds host overhead and synchronises the device when it stops.

Definitions, over the window from the first step's start to the end of the last step or of its GPU work:
- GPU busy: the union of kernel, memcpy and memset intervals (overlaps counted once) / the window's wall time.
- launches: host-side kernel launch API calls (runtime and driver, graph launches count one each).
- syncs: host calls that block on the device (stream/device/event synchronize, synchronous cudaMemcpy, cudaFree).
The wall time is that of the profiled steps, the profiler's host overhead included (the timed pass has the clean
step time). Without a GPU trace (a CPU run) the GPU columns are None, printed as n/a: there is nothing to measure.

kernels: the kernels the trace shows on the GPU (a CUDA graph replays many from one launch). The kernel table
(`kernel_table=True`) groups them by short name (template arguments and parameter list stripped). Kernels by layer:
`layer_ranges()` puts a record_function range around each decoder layer and the LM head; the profiler gives each
range a GPU twin spanning the kernels launched inside it, and `attribute_kernels()` counts the kernels in each twin.
A graph replay launches no ranges, so the bench attributes an eager run of the graph's forward (the same kernels).

Idle gaps (`idle_gaps`, StepProfile.idle): the intervals of the window where the GPU ran nothing, each with the GPU
work before and after it and what the host was doing meanwhile (its records overlapping the gap, summed per name):
the GPU idles only while the host is behind, so those records name the stall (a sync, a host-side loop, launches
slower than the kernels they launch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

STEP_MARK = "sglang::profiled_step"
# Kineto activity types (libkineto ActivityType names) of work that occupies the GPU.
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_RANGE = "user_annotation"  # a record_function range on the host (its GPU twin is "gpu_user_annotation")

# API names, after dropping the version and per-thread-stream suffixes (cuMemcpyDtoH_v2, cudaLaunchKernel_ptsz).
_API_SUFFIX = re.compile(r"(_v\d+|_pt(sz|ds))*$")
_LAUNCH = re.compile(r"(cuda|cu|hip)(Ext)?(Module)?Launch(Cooperative)?Kernel(Ex|ExC)?|(cuda|cu|hip)GraphLaunch")
# cudaMemcpy without Async blocks the host; cudaFree and cudaFreeHost synchronise the device implicitly.
_SYNC = re.compile(r"(cuda|cu|hip)(Stream|Device|Event|Ctx)Synchronize|(cuda|hip)Memcpy|cuMemcpy(DtoH|HtoD|DtoD)?"
                   r"|(cuda|hip)Free(Host)?")


TOP_KERNELS = 12  # GPU work names kept in StepProfile.top_kernels
LAYER_MARK = "sglang::layer."  # + the decoder layer's index: layer_ranges()
HEAD_MARK = "sglang::lm_head"  # the logits processor (final norm's output through the LM head to the logits)
GPU_RANGE = "gpu_user_annotation"


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """One row of the kernel table: the GPU work of one short name in a step."""

    name: str
    runs_per_step: float
    ms_per_step: float
    share: float  # of the summed GPU work time (overlapping work counted each)


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One profiler record: `activity` is kineto's activity type ("kernel", "cuda_runtime", "cpu_op", ...)."""

    name: str
    activity: str
    start_us: float
    end_us: float


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Per-step averages over `steps` profiled steps; the GPU fields are None without a GPU trace."""

    steps: int
    wall_ms_per_step: float
    gpu_ms_per_step: Optional[float]  # union of GPU work intervals
    gpu_busy: Optional[float]  # fraction of the wall time
    kernels_per_step: Optional[float]  # kernels that ran (a cross-check of launches: equal without graphs)
    launches_per_step: Optional[float]
    syncs_per_step: Optional[float]
    # The GPU work that took longest, summed per name: (name, ms per step, runs per step), longest first.
    top_kernels: tuple = ()
    collective_ms_per_step: Optional[float] = None  # NCCL / RCCL kernels (all-reduce, all-gather, reduce-scatter)
    kernel_table: tuple = ()  # KernelRow per short name, longest first (summarize(kernel_table=True))
    idle: Optional["IdleReport"] = None  # the GPU's idle gaps (idle_gaps), with a GPU trace

    def columns(self) -> str:
        """One table cell group, n/a where nothing was measured."""
        def fmt(value: Optional[float], spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        return (f"wall ms/step {self.wall_ms_per_step:8.2f} | GPU ms/step {fmt(self.gpu_ms_per_step, '7.2f')} "
                f"| busy {fmt(self.gpu_busy, '6.1%')} | launches/step {fmt(self.launches_per_step, '6.1f')} "
                f"| syncs/step {fmt(self.syncs_per_step, '5.1f')}"
                + (f" | collectives ms/step {self.collective_ms_per_step:6.3f}" if self.collective_ms_per_step else ""))


def is_launch(name: str) -> bool:
    return _LAUNCH.fullmatch(_API_SUFFIX.sub("", name)) is not None


def is_sync(name: str) -> bool:
    return _SYNC.fullmatch(_API_SUFFIX.sub("", name)) is not None


def merged_length(intervals: Iterable[tuple]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total if cur_end is None else total + cur_end - cur_start


def summarize(events: list, gpu_trace: bool, kernel_table: bool = False) -> StepProfile:
    """StepProfile of the STEP_MARK ranges in `events`. Host calls count only inside the steps (the profiler's own
    synchronize at stop falls outside); GPU work counts clipped to the window, whose end waits for the last of it.
    `gpu_trace`: the trace was taken with CUDA activities (False on CPU: GPU fields None). `kernel_table`: fill
    StepProfile.kernel_table."""
    marks = [e for e in events if e.name == STEP_MARK and e.activity == HOST_RANGE]
    if not marks:
        raise ValueError(f"no {STEP_MARK!r} ranges in the trace: wrap each step in record_function(STEP_MARK)")
    start, steps_end = min(m.start_us for m in marks), max(m.end_us for m in marks)
    work = [(e.start_us, e.end_us) for e in events if e.activity in DEVICE_WORK and e.end_us > start]
    end = max([steps_end] + [e for _, e in work])
    n, wall_us = len(marks), end - start
    if not gpu_trace or not work:
        return StepProfile(n, wall_us / n / 1e3, None, None, None, None, None)
    busy_us = merged_length((max(s, start), e) for s, e in work)
    host = [e.name for e in events if e.activity not in DEVICE_WORK and start <= e.start_us <= steps_end]
    kernels = sum(1 for e in events if e.activity == "kernel" and e.end_us > start)
    by_name: dict = {}
    for e in events:
        if e.activity in DEVICE_WORK and e.end_us > start:
            total, count = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (total + e.end_us - max(e.start_us, start), count + 1)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    collective_us = sum(us for name, (us, _) in by_name.items() if is_collective(name))
    return StepProfile(n, wall_us / n / 1e3, busy_us / n / 1e3, busy_us / wall_us, kernels / n,
                       sum(map(is_launch, host)) / n, sum(map(is_sync, host)) / n,
                       tuple((name, us / n / 1e3, count / n) for name, (us, count) in top),
                       collective_us / n / 1e3, table_of(by_name, n) if kernel_table else (), idle_gaps(events))


GAP_MIN_US = 20.0  # idle gaps counted (StepProfile.idle.gaps_per_step) from this length: below it, launch latency
TOP_GAPS = 6  # gaps kept in IdleReport.largest
HOST_NAMES = 4  # host records named per gap


@dataclasses.dataclass(frozen=True)
class IdleGap:
    """One interval of the window where the GPU ran nothing."""

    ms: float
    before: str  # short name of the GPU work that ended last before it ("" at the window's start)
    after: str  # of the GPU work that started it ("" at the window's end)
    host: tuple  # (name, ms of the gap it overlaps) of the host records during it, most overlap first


@dataclasses.dataclass(frozen=True)
class IdleReport:
    idle_ms_per_step: float  # the window's wall time less the GPU's busy time, per step
    gaps_per_step: float  # gaps of GAP_MIN_US or longer, per step
    largest: tuple  # the TOP_GAPS longest IdleGaps, longest first
    # (short name, idle ms per step, gaps per step) of the GPU work that ended each gap, summed per name, most idle
    # first (TOP_GAPS of them): where many short gaps add up, the launches the host was late for
    by_next: tuple = ()

    def lines(self) -> list:
        head = (f"GPU idle {self.idle_ms_per_step:.3f} ms/step in {self.gaps_per_step:.1f} gaps >= "
                f"{GAP_MIN_US:.0f} us/step; largest:")
        late = "; ".join(f"{name[:40] or '(end)'} {ms:.3f} ms in {count:.1f}" for name, ms, count in self.by_next)
        return [head] + [f"  {g.ms:8.3f} ms after {g.before[:40] or '(start)'} before {g.after[:40] or '(end)'} "
                         f"| host: " + ", ".join(f"{name[:48]} {ms:.3f}" for name, ms in g.host)
                         for g in self.largest] + [f"  idle before, by the work that ended it: {late}"]


def idle_gaps(events: list, top: int = TOP_GAPS) -> Optional[IdleReport]:
    """The GPU's idle gaps in the STEP_MARK window of `events` (the window of summarize()); None without GPU work."""
    marks = [e for e in events if e.name == STEP_MARK and e.activity == HOST_RANGE]
    if not marks:
        raise ValueError(f"no {STEP_MARK!r} ranges in the trace: wrap each step in record_function(STEP_MARK)")
    start, steps_end = min(m.start_us for m in marks), max(m.end_us for m in marks)
    work = sorted((max(e.start_us, start), e.end_us, e.name) for e in events
                  if e.activity in DEVICE_WORK and e.end_us > start)
    if not work:
        return None
    gaps, busy_end, last = [], start, ""
    for s, e, name in work:
        if s > busy_end:
            gaps.append((busy_end, s, last, name))
        if e > busy_end:
            busy_end, last = e, name
    if steps_end > busy_end:
        gaps.append((busy_end, steps_end, last, ""))
    host = [e for e in events if e.activity not in DEVICE_WORK and e.activity != GPU_RANGE and e.name != STEP_MARK]

    def during(a: float, b: float) -> tuple:
        overlap: dict = {}
        for e in host:
            if e.start_us < b and e.end_us > a:
                overlap[e.name] = overlap.get(e.name, 0.0) + min(b, e.end_us) - max(a, e.start_us)
        ranked = sorted(overlap.items(), key=lambda kv: -kv[1])[:HOST_NAMES]
        return tuple((name, us / 1e3) for name, us in ranked)

    n = len(marks)
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    by_next: dict = {}
    for a, b, _, y in gaps:
        name = short_name(y) if y else ""
        us, count = by_next.get(name, (0.0, 0))
        by_next[name] = (us + b - a, count + 1)
    ranked = sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]
    return IdleReport(sum(b - a for a, b, _, _ in gaps) / n / 1e3,
                      sum(1 for a, b, _, _ in gaps if b - a >= GAP_MIN_US) / n,
                      tuple(IdleGap((b - a) / 1e3, short_name(x) if x else "", short_name(y) if y else "", during(a, b))
                            for a, b, x, y in largest),
                      tuple((name, us / n / 1e3, count / n) for name, (us, count) in ranked))


def short_name(name: str) -> str:
    """A kernel's name without template arguments, parameter list and return type: `void at::native::
    vectorized_elementwise_kernel<4, ...>(int, ...)` -> `at::native::vectorized_elementwise_kernel`. Names without
    them (Triton kernels, `Memcpy DtoD (Device -> Device)`) are kept whole."""
    if "<" not in name and not name.endswith(")") or name.startswith(("Memcpy", "Memset")):
        return name
    out, depth = [], 0
    for ch in name:  # drop every <...>, nested ones included
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    short = "".join(out).strip()
    if short.endswith(")"):  # the parameter list: from its matching "("
        depth = 0
        for i in range(len(short) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(short[i], 0)
            if depth == 0:
                short = short[:i].rstrip()
                break
    return short.removeprefix("void ") or name  # kernels return void


def table_of(by_name: dict, steps: int) -> tuple:
    """KernelRows of {full name: (us, runs)} over `steps` steps, grouped by short_name, longest first."""
    grouped: dict = {}
    for name, (us, count) in by_name.items():
        total, runs = grouped.get(short_name(name), (0.0, 0))
        grouped[short_name(name)] = (total + us, runs + count)
    all_us = sum(us for us, _ in grouped.values()) or 1.0
    return tuple(KernelRow(name, runs / steps, us / steps / 1e3, us / all_us)
                 for name, (us, runs) in sorted(grouped.items(), key=lambda kv: (-kv[1][0], kv[0])))


@dataclasses.dataclass(frozen=True)
class LayerKernels:
    """The kernels of one step by where they were launched (attribute_kernels)."""

    per_layer: tuple  # kernels of each decoder layer, in layer order
    lm_head: int
    outside: int  # the rest of the step: embedding, HC head and final norm, sampling, input copies
    total: int

    def columns(self) -> str:
        layers = self.per_layer
        return (f"by layer (an eager run of the same forward): {sum(layers) / len(layers):.1f} per layer "
                f"(min {min(layers)}, max {max(layers)}, {len(layers)} layers) | LM head {self.lm_head} | "
                f"outside the layers {self.outside} | total {self.total}")


def attribute_kernels(events: list) -> Optional[LayerKernels]:
    """Kernels of the STEP_MARK window of `events` inside each layer's and the LM head's GPU range (layer_ranges);
    None without GPU kernels or without layer ranges (a CPU trace)."""
    marks = [e for e in events if e.name == STEP_MARK and e.activity == HOST_RANGE]
    if not marks:
        raise ValueError(f"no {STEP_MARK!r} ranges in the trace: wrap each step in record_function(STEP_MARK)")
    start = min(m.start_us for m in marks)
    kernels = [e for e in events if e.activity == "kernel" and e.end_us > start]
    ranges = [e for e in events if e.activity == GPU_RANGE and e.end_us > start
              and (e.name.startswith(LAYER_MARK) or e.name == HEAD_MARK)]
    layer_ids = sorted({int(e.name[len(LAYER_MARK):]) for e in ranges if e.name != HEAD_MARK})
    if not kernels or not layer_ids:
        return None
    counts = {name: 0 for name in [f"{LAYER_MARK}{i}" for i in range(layer_ids[-1] + 1)] + [HEAD_MARK]}
    for k in kernels:
        inside = next((r.name for r in ranges if r.start_us <= k.start_us and k.end_us <= r.end_us), None)
        if inside is not None:
            counts[inside] += 1
    per_layer = tuple(counts[f"{LAYER_MARK}{i}"] for i in range(layer_ids[-1] + 1))
    head = counts[HEAD_MARK]
    return LayerKernels(per_layer, head, len(kernels) - sum(per_layer) - head, len(kernels))


@contextlib.contextmanager
def layer_ranges(layers: Iterable[torch.nn.Module], head: Optional[torch.nn.Module]):
    """Inside: each forward of layers[i] runs in a record_function range LAYER_MARK + i, `head`'s in HEAD_MARK
    (module hooks: the model's code is unchanged, and nothing is added outside this block)."""
    from torch.autograd.profiler import record_function

    open_ranges: list = []
    handles = []

    def enter(name: str):
        def hook(module, args):
            open_ranges.append(record_function(name).__enter__())
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    named = [(f"{LAYER_MARK}{i}", m) for i, m in enumerate(layers)] + ([(HEAD_MARK, head)] if head is not None else [])
    for name, module in named:
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def is_collective(name: str) -> bool:
    """A communication kernel of NCCL (or RCCL, which keeps its names): ncclDevKernel_AllReduce_..., ncclKernel_..."""
    return name.startswith(("ncclDevKernel", "ncclKernel", "ncclDevFunc"))


def profile_steps(step: Callable[[], object], steps: int, device: torch.device,
                  kernel_table: bool = False) -> StepProfile:
    """Run `step` 1 + `steps` times under torch.profiler and summarize the last `steps` (the first one is the
    profiler's warm-up: CUPTI's start-up cost lands there, not in the numbers)."""
    result = summarize(record_steps(step, steps, device), device.type == "cuda", kernel_table)
    if device.type == "cuda" and result.gpu_busy is None:
        logger.warning("the CUDA profile holds no GPU work (is CUPTI available?): GPU columns are n/a")
    return result


def record_steps(step: Callable[[], object], steps: int, device: torch.device) -> list:
    """The TraceEvents of `steps` runs of `step` under torch.profiler, each in a STEP_MARK range, after one unrecorded
    warm-up run; CUDA activities too on a GPU."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.synchronize(device)  # nothing queued earlier runs inside the window
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        for _ in range(1 + steps):
            with record_function(STEP_MARK):
                step()
            prof.step()
    return trace_events(prof)


def trace_events(prof, raw: bool = True) -> list:
    """A finished torch.profiler.profile's records as TraceEvents. raw: read the kineto records prof.events() is
    built from (building its FunctionEvent tree takes seconds for the thousands of ops of a step, and none of it is
    needed here); False, or a profiler without them: prof.events()."""
    records = getattr(prof.profiler, "kineto_results", None) if raw else None
    if records is None:
        return [TraceEvent(e.name, e.activity_type or "", e.time_range.start, e.time_range.end) for e in prof.events()]
    t0 = records.trace_start_ns()  # relative times: epoch nanoseconds as float microseconds lose precision
    return [TraceEvent(e.name(), activity_of(e), (e.start_ns() - t0) / 1e3, (e.end_ns() - t0) / 1e3)
            for e in records.events()]


def activity_of(record) -> str:
    """A kineto record's activity type. Older torch (the GPU image's 2.11) has no activity_type(): derive the kinds
    summarize() tells apart from the device and the name (CUDA-side records are kernels, Memcpy*/Memset* copies)."""
    if hasattr(record, "activity_type"):
        return record.activity_type()
    name, on_gpu = record.name(), record.device_type() == torch.autograd.DeviceType.CUDA
    if name == STEP_MARK or name.startswith(LAYER_MARK) or name == HEAD_MARK:
        return GPU_RANGE if on_gpu else HOST_RANGE
    if not on_gpu:
        return "cpu_op"
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
