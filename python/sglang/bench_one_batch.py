"""Run one static batch through the engine without a server: prefill, then decode; report latency/throughput.

    python -m sglang.bench_one_batch --model-path tiny-deepseek-v4 --batch-size 1 8 --input-len 256 --output-len 32
    python -m sglang.bench_one_batch --model-path tiny-deepseek-v4 --correctness-test   # print completions
    python -m sglang.bench_one_batch --model-path tiny-deepseek-v4 --device cpu --tp 2 --batch-size 2 --input-len 16

The batch's prompts are prefilled whole, as many per forward as --chunked-prefill-size allows, then all requests
decode together for --output-len steps. Each
(batch, input length) is first warmed up at its own shape (WARMUP_DECODE_STEPS decode steps), then timed; the
prefill is timed --prefill-repeats times (fresh prompts each, the extra ones finishing at their first token) and
reported as the median with the range, since single prefills of one build spread by +-15% on an H200. Then, in a
separate pass, --profile-steps decode steps are timed by host phase (sglang.srt.utils.host_phases), and in a last
pass run under torch.profiler for the GPU-busy fraction, kernel launches and host syncs per step
(sglang.srt.utils.step_profile; on CPU, where there is no GPU trace, the wall time only); --profile-prefill adds
PREFILL_HOST_REPEATS prefills per shape timed by host phase and one profiled prefill per shape (request admission
included). The decode profile counts the kernels the GPU ran per
step and per decoder layer, and attributes them to the layers, the LM head and the rest from one more decode step run
eagerly with a profiler range around each layer (attribute_decode); --kernel-table adds every kernel of the step by
name. The bytes floor (sglang.srt.utils.bytes_floor) divides what a decode step must read (weights, the routed
experts the step touched, the cache its attention reads) by the copy bandwidth measured before the engine starts;
each prefill's rate is the model's FLOPs (sglang.srt.utils.model_flops) over its median time, on a GPU also as the
fraction of a bf16 matmul's rate measured there too.

Output: the pool plan, then one table per pass, each result once: the timed runs (printed as each finishes), the
host phases, and the profiles, printed after every profiled pass has run so that torch.profiler's own log lines
(on stderr) come before them, not between their rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import statistics
import time
from typing import Optional

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.platform import default_device
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.bytes_floor import BytesFloor, ExpertTouches, copy_bandwidth_gbps, decode_floor, model_bytes
from sglang.srt.utils.graph_capture import graph_capture_region
from sglang.srt.utils.host_phases import HostPhases, time_host_phases
from sglang.srt.utils.model_flops import matmul_rate_tflops, prefill_flops
from sglang.srt.utils.step_profile import (LayerKernels, StepProfile, attribute_kernels, layer_ranges, profile_steps,
                                           record_steps)

WARMUP_DECODE_STEPS = 4
PREFILL_HOST_REPEATS = 3  # prefills timed by host phase per shape (--profile-prefill)
# The copy that measures the bandwidth of the bytes floor: two 2 GiB buffers on a GPU; on a CPU a 256 MiB memcpy
# (past the caches, and short on a shared machine).
COPY_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}
PROMPTS = ["The capital of France is", "DeepSeek-V4 compresses its KV cache by", "1, 2, 3, 4,"]


@dataclasses.dataclass
class BenchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_latency_s: float
    prefill_throughput_tok_s: float
    median_decode_latency_s: float
    decode_throughput_tok_s: float
    profile: Optional[StepProfile] = None  # from a separate profiled pass (--profile-steps)
    host_phases: Optional[HostPhases] = None  # host time by phase, from a separate pass before any profile
    prefill_host_phases: Optional[HostPhases] = None  # the same for a prefill (--profile-prefill)
    prefill_latencies_s: tuple = ()  # every timed prefill (--prefill-repeats); prefill_latency_s is their median
    prefill_profile: Optional[StepProfile] = None  # one profiled prefill (--profile-prefill)
    layer_kernels: Optional[LayerKernels] = None  # a decode step's kernels by layer (attribute_decode)
    floor: Optional[BytesFloor] = None  # the bytes floor of a decode step and the median step's fraction of it
    prefill_gflop_per_token: Optional[float] = None  # the model's FLOPs of the prefill (model_flops), per token
    prefill_tflops: Optional[float] = None  # those FLOPs over the median prefill
    prefill_matmul_fraction: Optional[float] = None  # prefill_tflops over the same run's bf16 matmul rate

    def label(self) -> str:
        return f"batch {self.batch_size:4d} input {self.input_len:6d}"

    def columns(self) -> str:
        spread = (f" ({min(self.prefill_latencies_s) * 1e3:.1f}-{max(self.prefill_latencies_s) * 1e3:.1f}, "
                  f"{len(self.prefill_latencies_s)} runs)" if len(self.prefill_latencies_s) > 1 else "")
        decode = ("decode median      n/a" if math.isnan(self.median_decode_latency_s) else
                  f"decode median {self.median_decode_latency_s * 1e3:8.2f} ms {self.decode_throughput_tok_s:9.1f} "
                  f"tok/s")
        return (f"{self.label()} | prefill {self.prefill_latency_s * 1e3:9.1f} ms{spread} "
                f"{self.prefill_throughput_tok_s:10.1f} tok/s | {decode}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(engine, batch_size: int, input_len: int, output_len: int, seed: int) -> float:
    """Admit `batch_size` random prompts and prefill them (chunk-budget sized forwards: several whole prompts in one,
    or a long prompt in chunks); returns the prefill seconds. Nothing comes from the prefix cache: it is emptied
    first (prompts of different lengths drawn from one seed share their first tokens)."""
    sched, runner = engine.scheduler, engine.model_runner
    if not sched.flush_cache():
        raise RuntimeError("bench_one_batch prefills on an idle engine: requests are still running")
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [Req(rid=f"bench-{i}", origin_input_ids=torch.randint(2, vocab, (input_len,), generator=g).tolist(),
                sampling_params=params) for i in range(batch_size)]
    for req in reqs:
        sched.add_request(req)
    sched._admit()
    if len(sched.running) != batch_size:
        raise ValueError(f"only {len(sched.running)} of {batch_size} requests fit the pool; "
                         f"raise --max-total-tokens or lower the batch")
    # Whole prompts, as many per forward as --chunked-prefill-size allows (at least one), a prompt longer than that
    # in chunks of it: a batch of 128 x 1024, or one 128K prompt, in one forward would need activations the pools
    # leave no room for.
    per_forward = max(1, sched.chunk_budget // input_len)
    _sync(runner.device)
    start = time.perf_counter()
    for i in range(0, batch_size, per_forward):
        group = reqs[i:i + per_forward]
        while not group[0].prefill_done:
            n = input_len if len(group) > 1 else min(sched.chunk_budget, input_len - group[0].num_computed)
            sched.run_batch(ScheduleBatch(ForwardMode.EXTEND, group, [n] * len(group)))
    _sync(runner.device)
    return time.perf_counter() - start


def run_once(engine, batch_size: int, input_len: int, output_len: int, seed: int,
             prefill_repeats: int = 1) -> BenchResult:
    """Prefill and decode one batch; then prefill_repeats - 1 more prefills of fresh prompts (requests that finish at
    their first token, so nothing is left running); the prefill latency is the median of all."""
    sched, runner = engine.scheduler, engine.model_runner
    prefills = [prefill(engine, batch_size, input_len, output_len, seed)]
    steps = []
    while sched.running:  # no device sync per step: it would stall overlap scheduling (each step reads the last)
        t = time.perf_counter()
        sched.step()
        steps.append(time.perf_counter() - t)
    _sync(runner.device)
    prefills += [prefill(engine, batch_size, input_len, 1, seed + 1000 + i) for i in range(prefill_repeats - 1)]
    median = statistics.median(steps) if steps else float("nan")  # the steady-state period of a step
    prefill_s = statistics.median(prefills)
    return BenchResult(batch_size, input_len, output_len, prefill_s, batch_size * input_len / prefill_s, median,
                       batch_size / median if steps else float("nan"), prefill_latencies_s=tuple(prefills))


def profile_prefill(engine, batch_size: int, input_len: int, seed: int, kernel_table: bool = False) -> StepProfile:
    """One prefill of fresh prompts under torch.profiler (after one unprofiled warm-up); the requests finish at their
    first token. Never part of a timed pass."""
    return profile_steps(lambda: prefill(engine, batch_size, input_len, 1, seed), 1, engine.model_runner.device,
                         kernel_table)


def prefill_rate(r: BenchResult, config, matmul_tflops: Optional[float]) -> str:
    """Fill r's prefill FLOPs figures (the model's FLOPs over the median prefill, and their fraction of the matmul
    rate where one was measured); returns the report row."""
    flops = prefill_flops(config, r.input_len, batch=r.batch_size)
    r.prefill_gflop_per_token = flops.per_token / 1e9
    r.prefill_tflops = flops.total / r.prefill_latency_s / 1e12
    fraction = ""
    if matmul_tflops:
        r.prefill_matmul_fraction = r.prefill_tflops / matmul_tflops
        fraction = f" | {r.prefill_matmul_fraction:.3f} of the matmul rate"
    share = ", ".join(f"{k} {getattr(flops, k) / flops.total:.0%}" for k in ("linear", "experts", "attention",
                                                                              "indexer"))
    return (f"{r.label()} | model FLOPs | {r.prefill_gflop_per_token:.2f} GFLOP/token ({share}) | "
            f"{r.prefill_tflops:8.1f} TFLOP/s{fraction}")


def tokens_per_step(engine) -> int:
    """The most tokens one decode step commits per request: a speculative cycle commits up to num_draft_tokens."""
    return max(1, engine.scheduler.num_draft_tokens)


def profile_decode(engine, batch_size: int, input_len: int, steps: int, seed: int,
                   kernel_table: bool = False) -> StepProfile:
    """Prefill a fresh batch, profile `steps` decode steps (a speculative cycle is one step), then finish the batch.
    Never part of a timed pass."""
    sched = engine.scheduler
    # The first token comes from prefill; one more step is the profiler's warm-up, one more is slack.
    prefill(engine, batch_size, input_len, 1 + (steps + 2) * tokens_per_step(engine), seed)
    result = profile_steps(sched.step, steps, engine.model_runner.device, kernel_table)
    if len(sched.running) != batch_size:
        raise RuntimeError(f"a request finished inside the profiled steps ({len(sched.running)} of {batch_size} "
                           f"left)")
    while sched.running:
        sched.step()
    return result


def attribute_decode(engine, batch_size: int, input_len: int, seed: int) -> tuple:
    """One decode step of a fresh batch under the profiler, with a range around each decoder layer and the LM head,
    the routers' choices kept: (LayerKernels, None without a GPU trace; distinct routed experts per MoE layer). A
    graph replay launches no ranges, so a batch of the static path runs its captured forward eagerly here
    (graph_capture_region: the kernels the capture chose), launching the graph's kernels one by one. The device is
    synchronised after each step: no earlier step's kernels run inside the recorded one."""
    sched, runner = engine.scheduler, engine.model_runner
    prefill(engine, batch_size, input_len, 1 + 3 * tokens_per_step(engine), seed)
    graphs, model = runner.graph_runner, runner.model
    static = runner.can_run_decode_graph(batch_size)
    captured = graphs.graphs if graphs is not None else None

    def step() -> None:
        sched.step()
        _sync(runner.device)

    touches = ExpertTouches(model, batch_size * tokens_per_step(engine))
    try:
        if graphs is not None:
            graphs.graphs = {}  # the static path's eager run (the CPU's)
        with graph_capture_region() if static else contextlib.nullcontext(), touches, \
                layer_ranges(model.layers, model.logits_processor):
            events = record_steps(step, 1, runner.device)
    finally:
        if graphs is not None:
            graphs.graphs = captured
    while sched.running:
        sched.step()
    return attribute_kernels(events), touches


def host_phases(engine, batch_size: int, input_len: int, steps: int, seed: int) -> HostPhases:
    """Prefill a fresh batch, time `steps` decode steps by phase (sglang.srt.utils.host_phases), finish the batch."""
    sched = engine.scheduler
    prefill(engine, batch_size, input_len, 2 + (steps + 1) * tokens_per_step(engine), seed)
    sched.step()  # warm
    result = time_host_phases(sched, steps)
    while sched.running:
        sched.step()
    return result


def correctness_test(engine) -> None:
    outs = engine.generate(prompt=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 16})
    for prompt, out in zip(PROMPTS, outs):
        print(f"prompt: {prompt!r}\ncompletion ({out['meta_info']['completion_tokens']} tokens): {out['text']!r}\n")


def parse_args() -> tuple:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[256])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=6,
                        help="decode steps profiled after the timed run, per batch (0: no profile)")
    parser.add_argument("--prefill-repeats", type=int, default=3,
                        help="timed prefills per shape, reported as median and range (>= 1)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="profile one prefill per shape (GPU busy, launches, syncs) after the timed runs")
    parser.add_argument("--kernel-table", action="store_true",
                        help="with the decode (and --profile-prefill) profiles, every GPU kernel of a step by name "
                             "(runs, ms, share of GPU time), printed and in --result-filename")
    parser.add_argument("--correctness-test", action="store_true", help="print completions of a few prompts")
    parser.add_argument("--result-filename", help="append one JSON line per run")
    args = parser.parse_args()
    server_args = ServerArgs.from_cli_args(args)
    if server_args.log_level == "info":
        server_args.log_level = "warning"
    if server_args.nnodes > 1:
        raise SystemExit("bench_one_batch runs on one node; use launch_server --nnodes and bench_serving")
    if args.prefill_repeats < 1:
        parser.error(f"--prefill-repeats must be >= 1, got {args.prefill_repeats}")
    return args, server_args


def main() -> None:
    """One process per --tp rank (rank 0 here, the others spawned): every rank runs the same batches (the engine is
    deterministic, so they schedule alike and meet in the same collectives); rank 0 reports. With DP attention each
    group runs its own copy of the batch (figures are per group)."""
    args, server_args = parse_args()
    if server_args.tp_size == 1:
        bench(args, server_args, rank=0)
        return
    import multiprocessing as mp

    from sglang.srt.managers.scheduler_process import init_method_for

    init_method = init_method_for(server_args)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bench_rank, args=(args, server_args, r, init_method), daemon=True)
             for r in range(1, server_args.tp_size)]
    for p in procs:
        p.start()
    try:
        _bench_rank(args, server_args, 0, init_method)
        for p in procs:
            p.join(server_args.dist_timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    failed = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs, 1) if p.exitcode != 0]
    if failed:
        raise SystemExit("bench_one_batch: " + ", ".join(failed) + " failed")


def _bench_rank(args, server_args: ServerArgs, rank: int, init_method: str) -> None:
    from sglang.srt.distributed.parallel_state import destroy_parallel_state
    from sglang.srt.managers.scheduler_process import join_ranks

    join_ranks(server_args, rank, init_method)
    bench(args, server_args, rank)
    destroy_parallel_state()  # only after a clean run: a failed rank's peers must not wait in its barrier


def profile_report(results: list, args, device: torch.device, engine_layers: int = 1) -> list:
    """The profile rows (torch.profiler passes), one section per kind. Without a GPU trace (on CPU) the GPU columns
    are left out, saying why once, rather than printed n/a on every row. `engine_layers`: the model's decoder
    layers (kernels per layer)."""
    profiles = [p for r in results for p in (r.profile, r.prefill_profile) if p is not None]
    if not profiles:
        return []
    gpu = any(p.gpu_ms_per_step is not None for p in profiles)
    lines = [] if gpu else [f"profiles: wall time only; GPU ms/step, busy, launches/step and syncs/step are not "
                            f"measured ({'no GPU trace on CPU' if device.type == 'cpu' else 'no GPU work traced'})"]

    def cells(p: StepProfile) -> str:
        return p.columns() if gpu else f"wall ms/step {p.wall_ms_per_step:8.2f}"

    for kind, steps, get in (("prefill", 1, lambda r: r.prefill_profile), ("decode", args.profile_steps,
                                                                           lambda r: r.profile)):
        rows = [(r, get(r)) for r in results if get(r) is not None]
        if not rows:
            continue
        lines.append(f"{kind} profile (torch.profiler, {steps} {kind} step{'s' if steps > 1 else ''} per batch):")
        for r, p in rows:
            lines.append(f"{r.label()} | {kind} profile | {cells(p)}")
            if p.idle is not None:  # where the host fell behind the GPU
                lines += [f"    {line}" for line in p.idle.lines()]
            unit = "ms/step" if kind == "decode" else "ms"
            if kind == "decode":
                lines += kernel_lines(r, p, engine_layers)
            if p.kernel_table:
                lines.append(f"    every kernel, by name: {unit} | runs/step | share of GPU time | name")
                lines += [f"    {k.ms_per_step:7.3f} {k.runs_per_step:7.1f}x {k.share:6.1%}  {k.name[:110]}"
                          for k in p.kernel_table]
            else:
                lines += [f"    {ms:7.3f} {unit} {count:6.1f}x  {name[:110]}" for name, ms, count in p.top_kernels]
    return lines


def kernel_lines(r: BenchResult, p: StepProfile, num_layers: int) -> list:
    """Kernels per step and per decoder layer (the step's over the layer count), and by where they were launched."""
    if p.kernels_per_step is None:
        return []
    lines = [f"    kernels/step {p.kernels_per_step:.1f} | kernels/layer {p.kernels_per_step / num_layers:.1f} "
             f"(kernels/step / {num_layers} layers)"]
    if r.layer_kernels is not None:
        lines.append(f"    {r.layer_kernels.columns()}")
    return lines


def floor_report(results: list, runner, touches: dict, copy_gbps: Optional[float], output_len: int) -> str:
    """Fill each result's bytes floor (at the median timed step's context: input + output_len / 2 tokens); returns
    the section's heading."""
    mb = model_bytes(runner.model)
    pool = runner.token_to_kv_pool
    for r in results:
        touched = touches.get(id(r))
        r.floor = decode_floor(mb, runner.model_config, r.batch_size, r.input_len + output_len // 2,
                               pool.kv_format.bytes_per_entry, pool.index_format.bytes_per_entry,
                               touched.touched(mb.experts) if touched is not None else None, copy_gbps,
                               runner.device.type, r.median_decode_latency_s)
    return (f"bytes floor of a decode step (weights as stored {mb.non_expert / 1e6:.1f} MB, the embedding's rows "
            f"only; routed experts {mb.expert_total / 1e6:.1f} MB stored, the touched ones "
            f"{'counted in one step' if touches else 'estimated from uniform routing'}; "
            f"the cache read at the median step; copy bandwidth measured before the engine, "
            f"{'a device-to-device copy' if runner.device.type == 'cuda' else 'a CPU memcpy'}):")


def bench(args, server_args: ServerArgs, rank: int) -> None:
    """The whole benchmark on this rank's engine; only rank 0 prints and writes results."""
    import sglang

    report = print if rank == 0 else (lambda *a, **k: None)
    # Before the engine: its pools take the device memory the copy's two buffers need.
    device = torch.device(server_args.device or default_device())
    copy_gbps = copy_bandwidth_gbps(device, COPY_BYTES[device.type]) if rank == 0 and device.type in COPY_BYTES \
        else None
    matmul_tflops = matmul_rate_tflops(device) if rank == 0 else None  # a GPU's bf16 rate: the prefill's limit
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = sglang.Engine(**dataclasses.asdict(server_args))
    if args.correctness_test:
        correctness_test(engine) if rank == 0 else engine.generate(
            prompt=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 16})
        return
    logging.getLogger().setLevel(logging.WARNING)
    graphs = engine.model_runner.graph_runner
    report(engine.model_runner.pool_plan.format())  # what the pools hold: tokens per cache format, pages, slots
    report("decode: " + ("general eager path (--disable-cuda-graph)" if graphs is None else
                         f"static buffers, {'CUDA graphs' if graphs.graphs else 'eager'} for batch sizes "
                         f"{graphs.batch_sizes} (larger batches: general eager path)"))
    if server_args.tp_size > 1:
        report(f"ranks: tp {server_args.tp_size}, ep {server_args.ep_size}"
               + (f", DP attention {server_args.dp_size} (figures per DP group: each runs the batch)"
                  if server_args.enable_dp_attention else ""))
    results = []
    decode = (f"decode: median step of --output-len {args.output_len}" if args.output_len > 1 else
              "decode: n/a, --output-len 1 leaves no decode step")
    report(f"timed runs (prefill: median of {args.prefill_repeats}, range in parentheses; {decode}):")
    for bs in args.batch_size:
        for input_len in args.input_len:
            # Warm-up at this exact shape, so no first-use cost (allocation, kernel compilation) is timed.
            run_once(engine, bs, input_len, 1 + WARMUP_DECODE_STEPS * tokens_per_step(engine), seed=0)
            results.append(run_once(engine, bs, input_len, args.output_len, seed=1,
                                    prefill_repeats=args.prefill_repeats))
            report(results[-1].columns(), flush=True)  # at once: a later shape may fail
    config = engine.model_runner.model_config
    report("prefill by the model's FLOPs (sglang.srt.utils.model_flops; "
           + (f"a bf16 8192^3 matmul before the engine: {matmul_tflops:.1f} TFLOP/s)" if matmul_tflops else
              "no matmul rate off a GPU)") + ":")
    for r in results:
        report(prefill_rate(r, config, matmul_tflops))
    # Host phases, then profiles, only after every timed pass: once the CUDA profiler ran, CUPTI stays attached and
    # slows each launch.
    if args.profile_steps > 0:
        report(f"host time of a decode step by phase ({args.profile_steps} steps per batch, a pass of their own):")
        for r in results:
            r.host_phases = host_phases(engine, r.batch_size, r.input_len, args.profile_steps, seed=3)
            report(f"{r.label()} | host {r.host_phases.columns()}", flush=True)
    if args.profile_prefill:
        report(f"host time of a prefill by phase (mean of {PREFILL_HOST_REPEATS} prefills of fresh prompts per batch, "
               "a pass of their own; allocate, batch and metadata come before its first kernel):")
        for r in results:
            r.prefill_host_phases = time_host_phases(
                engine.scheduler, PREFILL_HOST_REPEATS, lambda: prefill(engine, r.batch_size, r.input_len, 1, seed=6))
            report(f"{r.label()} | host prefill {r.prefill_host_phases.columns()}", flush=True)
    for r in results:  # every profile first: the profiler's own log lines then come before the profile rows
        if args.profile_prefill:
            r.prefill_profile = profile_prefill(engine, r.batch_size, r.input_len, seed=4,
                                                kernel_table=args.kernel_table)
        if args.profile_steps > 0:
            r.profile = profile_decode(engine, r.batch_size, r.input_len, args.profile_steps, seed=2,
                                       kernel_table=args.kernel_table)
    touches = {}
    if args.profile_steps > 0:  # after every profile above: its eager steps are no part of them
        for r in results:
            r.layer_kernels, counted = attribute_decode(engine, r.batch_size, r.input_len, seed=5)
            touches[id(r)] = counted
    runner = engine.model_runner
    num_layers = runner.model_config.num_hidden_layers
    for line in profile_report(results, args, runner.device, num_layers):
        report(line)
    report(floor_report(results, runner, touches, copy_gbps, args.output_len))
    for r in results:
        report(f"{r.label()} | floor | {r.floor.columns()}")
    if args.result_filename and rank == 0:
        with open(args.result_filename, "a") as f:
            for r in results:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
