"""torch.profiler around scheduler steps: what SGLang's /start_profile and /stop_profile (and Engine.start_profile /
stop_profile) drive.

A profile records every scheduler step between its start and its stop, or `num_steps` steps (then it stops by
itself); each rank writes its own Chrome trace, `{output_dir}/{profile_id}-TP-{rank}.trace.json.gz` (open it in
Perfetto or chrome://tracing). Activities, as upstream's: CPU (host ops), GPU (kernels, through CUPTI), MEM (a CUDA
memory-history snapshot, `...-TP-{rank}-memory.pickle`, for torch's memory_viz), CUDA_PROFILER (cudaProfilerStart /
Stop, for an `nsys --capture-range=cudaProfilerApi` run; no trace of ours). Output directory by default
$SGLANG_TORCH_PROFILER_DIR (/tmp); stacks and shapes by default $SGLANG_PROFILE_WITH_STACK and
$SGLANG_PROFILE_RECORD_SHAPES (both true). An HTTP client's output_dir must lie under $SGLANG_TORCH_PROFILER_DIR
(`confined_output_dir`): traces are files the server writes, and a client must not choose where on its disk.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "MEM", "CUDA_PROFILER")
MEMORY_HISTORY_ENTRIES = 100_000


def confined_output_dir(output_dir: Optional[str]) -> Optional[str]:
    """An HTTP request's output_dir resolved (a relative one from $SGLANG_TORCH_PROFILER_DIR; symlinks and '..'
    followed) and checked to lie under that directory; ValueError naming output_dir otherwise. None stays None (the
    directory itself)."""
    if output_dir is None:
        return None
    if "\0" in output_dir:
        raise ValueError("output_dir must not contain a NUL character")
    root = os.path.realpath(envs.SGLANG_TORCH_PROFILER_DIR.get())
    path = os.path.realpath(os.path.join(root, output_dir))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"output_dir {output_dir!r} is outside the server's profile directory {root} "
                         f"(SGLANG_TORCH_PROFILER_DIR); give a directory under it, or a relative one")
    return path


@dataclass
class ProfileConfig:
    """One profile's settings (the HTTP body of /start_profile, defaults filled in by `ProfileConfig.make`)."""

    output_dir: str
    profile_id: str
    activities: tuple = ("CPU", "GPU")
    num_steps: Optional[int] = None  # stop by itself after this many scheduler steps
    with_stack: bool = True
    record_shapes: bool = True

    @staticmethod
    def make(output_dir: Optional[str] = None, activities: Optional[list] = None, num_steps: Optional[int] = None,
             with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None,
             profile_prefix: Optional[str] = None) -> "ProfileConfig":
        """Defaults as upstream's: the env's directory (else /tmp), CPU + GPU, stacks and shapes; the id is the
        start time (with `profile_prefix` before it). Raises ValueError naming a bad field."""
        acts = tuple(dict.fromkeys(activities)) if activities is not None else ("CPU", "GPU")
        unknown = [a for a in acts if a not in ACTIVITIES]
        if unknown or not acts:
            raise ValueError(f"activities must be a non-empty list of {', '.join(ACTIVITIES)}; got {activities!r}")
        if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer or null; got {num_steps!r}")
        stamp = f"{time.time():.6f}"
        return ProfileConfig(
            output_dir=output_dir or envs.SGLANG_TORCH_PROFILER_DIR.get(),
            profile_id=f"{profile_prefix}-{stamp}" if profile_prefix else stamp, activities=acts, num_steps=num_steps,
            with_stack=envs.SGLANG_PROFILE_WITH_STACK.get() if with_stack is None else with_stack,
            record_shapes=envs.SGLANG_PROFILE_RECORD_SHAPES.get() if record_shapes is None else record_shapes)


@dataclass
class SchedulerProfiler:
    """At most one profile at a time in a scheduler (process or in-process Engine). `start` and `stop` return the
    message to answer with and raise ValueError for what the caller asked wrongly (a 400); `step_done` is called
    after every scheduler step."""

    rank: int = 0
    on_cuda: bool = False
    config: Optional[ProfileConfig] = None  # the running profile's
    steps: int = 0  # scheduler steps recorded so far
    _torch: Optional[torch.profiler.profile] = field(default=None, repr=False)
    last_paths: list = field(default_factory=list)  # what the last stop wrote

    @property
    def active(self) -> bool:
        return self.config is not None

    def start(self, config: ProfileConfig) -> str:
        if self.active:
            raise ValueError(f"a profile is already running (id {self.config.profile_id}, {self.steps} steps so far); "
                             f"POST /stop_profile first")
        cuda_only = [a for a in config.activities if a in ("GPU", "MEM", "CUDA_PROFILER")]
        if cuda_only and not self.on_cuda:
            if config.activities == ("CPU", "GPU"):  # the default asks for what there is
                config = ProfileConfig(**{**config.__dict__, "activities": ("CPU",)})
            else:
                raise ValueError(f"activities {', '.join(cuda_only)} need a CUDA device; this server runs on the "
                                 f"CPU (ask for CPU)")
        try:
            os.makedirs(config.output_dir, exist_ok=True)
            probe = os.path.join(config.output_dir, f".{config.profile_id}-TP-{self.rank}.probe")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"output_dir {config.output_dir!r} is not a writable directory: {e}") from None
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in config.activities else []
        if "GPU" in config.activities:
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if kinds:
            self._torch = torch.profiler.profile(activities=kinds, record_shapes=config.record_shapes,
                                                 with_stack=config.with_stack)
            self._torch.start()
        if "MEM" in config.activities:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        if "CUDA_PROFILER" in config.activities:
            torch.cuda.cudart().cudaProfilerStart()
        self.config, self.steps = config, 0
        until = f"for {config.num_steps} steps" if config.num_steps else "until /stop_profile"
        logger.info("profiling %s (%s) %s, traces to %s", config.profile_id, ", ".join(config.activities), until,
                    config.output_dir)
        return (f"Start profiling (id {config.profile_id}; {', '.join(config.activities)}; {until}; traces to "
                f"{config.output_dir})")

    def step_done(self) -> None:
        """One more scheduler step recorded; the profile stops when it has num_steps of them."""
        if not self.active:
            return
        self.steps += 1
        if self.config.num_steps is not None and self.steps >= self.config.num_steps:
            logger.info("%s", self.stop())

    def stop(self) -> str:
        if not self.active:
            raise ValueError("no profile is running: POST /start_profile first (a profile with num_steps stops by "
                             "itself)")
        config, base = self.config, os.path.join(self.config.output_dir, f"{self.config.profile_id}-TP-{self.rank}")
        self.config, paths = None, []
        try:
            if "CUDA_PROFILER" in config.activities:
                torch.cuda.cudart().cudaProfilerStop()
            if "MEM" in config.activities:
                torch.cuda.memory._dump_snapshot(base + "-memory.pickle")
                torch.cuda.memory._record_memory_history(enabled=None)
                paths.append(base + "-memory.pickle")
            if self._torch is not None:
                self._torch.stop()
                self._torch.export_chrome_trace(base + ".trace.json.gz")
                paths.append(base + ".trace.json.gz")
        finally:
            self._torch = None
        self.last_paths = paths
        written = ", ".join(paths) if paths else "no trace (CUDA_PROFILER only)"
        return f"Stop profiling ({self.steps} scheduler steps recorded); wrote {written}"
