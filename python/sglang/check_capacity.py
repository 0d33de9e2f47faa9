"""Capacity planner: will a DeepSeek-V4 deployment fit, and how many tokens and requests will it hold?

    python -m sglang.check_capacity --gpu h200 --model-path deepseek-ai/DeepSeek-V4-Flash --tp 4 [launch_server flags]
    python -m sglang.check_capacity flash|pro|CHECKPOINT_DIR [--tp 8] [launch_server flags] [--summary]

A launch recipe is taken verbatim: the flags after `python -m sglang.launch_server`, plus `--gpu`. Every launch_server
flag is accepted; those the plan depends on (--tp / --ep / --dp / --enable-dp-attention, --kv-cache-dtype,
--enable-deepseek-v4-fp4-indexer, --mem-fraction-static, --context-length, --max-running-requests,
--max-total-tokens, --page-size, --chunked-prefill-size, --swa-full-tokens-ratio, the speculative flags,
--disable-radix-cache, --quantization, --dtype, --moe-a2a-backend) mean what they mean to the server, and what is
not given gets the engine's DeepSeek-V4 defaults for the GPU planned for (arg_groups/deepseek_v4_hook.py); the rest
change nothing here. The hub ids deepseek-ai/DeepSeek-V4-Flash and -Pro, and the sgl-project/DeepSeek-V4-Flash-FP8
and -Pro-FP8 repacks (FP8 routed experts), are known offline (configs/hub_configs.py; nothing is downloaded); `flash`
and `pro` are short for the first two. A checkpoint directory is read as the server reads it (headers only).

Units: GB = 10^9 bytes, MiB = 2^20 bytes. Memory per GPU: H200 143,771 MiB = 150.8 GB, what the runtime reports on
the H200s the engine was measured on (the data sheet's "141 GB" is close to its 140.4 GiB); B200 180 GB and MI355X
288 GB, the vendors' figures, not measured here; --gpu-memory-gb overrides.

Prints per GPU: weight bytes (the engine's model built on the meta device in its final form, as rank 0 of the
layout builds its own: sglang.srt.distributed.parallel_state.layout_of_rank), pool bytes per kind, max total tokens,
max context, how many requests of `--at-context` tokens fit at once, and whether it fits; `--summary` prints the
verdict alone, on one line. The pool plan is the engine's own (`plan_pools_for_args` with the budget formula of
`pool_budget_bytes`), so the numbers equal what the engine logs at start for the same arguments
(test/srt/test_check_capacity.py checks it on CPU). What the planner cannot know: memory other processes hold
(assumed none: `--gpu-free-fraction`), the CUDA-graph memory the engine measures at start (`--cuda-graph-reserve-gb`,
default 0), and the runtime's own (CUDA context, NCCL buffers): on 2 H200s at TP2 the engine's pools came out 2.8%
smaller than planned with the measured graph memory given. Formats as the engine keeps them on that GPU: FP8 linears
and packed experts kept quantized, on NVIDIA GPUs and on MI355X (gfx950) alike.

Exit status: 0 fits, 1 does not fit, 2 the arguments are refused (a layout that does not divide, or any value the
server refuses; the message names it).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    vendor: str  # "nvidia" | "amd": which formats the engine keeps quantized there
    source: str  # where the memory figure comes from

    def describe(self) -> str:
        mib = f"{self.memory_bytes // MIB:,} MiB = " if self.memory_bytes % MIB == 0 else ""
        return f"{self.name}: {mib}{self.memory_bytes / GB:.1f} GB, {self.source}"


GPUS = {
    "h200": GpuSpec("H200", 143771 * MIB, "nvidia", "as nvidia-smi reports it on an H200 (the data sheet's \"141 GB\" "
                    "is about 140.4 GiB)"),
    "b200": GpuSpec("B200", 180 * 10**9, "nvidia", "the data sheet's figure, not measured here"),
    "mi355x": GpuSpec("MI355X", 288 * 10**9, "amd", "the data sheet's figure, not measured here"),
}


def tokens_label(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', else with thousands separators."""
    if n % 2**20 == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 2**10 == 0 else f"{n:,}"


@dataclass
class CapacityReport:
    weight_bytes: int  # per GPU
    checkpoint_bytes: int  # the whole checkpoint (presets: computed from the hub formats)
    budget_bytes: int  # what the pools may take per GPU
    plan: object  # PoolPlan, or None when the weights leave no room
    at_context: int
    error: str = ""
    dp_groups: int = 1  # DP-attention: each GPU holds the pools of its group's requests

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def requests_at(self, context: int) -> int:
        """Requests of `context` tokens the deployment holds at once (every DP group's)."""
        if self.plan is None:
            return 0
        return self.dp_groups * min(self.plan.shape.max_num_reqs, self.plan.max_total_tokens // context)

    def summary(self) -> str:
        """The verdict on one line (docs tables quote it)."""
        if self.plan is None:
            return f"does not fit: {self.error}"
        p, held = self.plan, self.requests_at(self.at_context)
        pool = (f"{p.max_total_tokens:,} tokens" if self.dp_groups == 1 else
                f"{self.dp_groups} x {p.max_total_tokens:,} tokens (one per DP group)")
        return (f"fits: {self.weight_bytes / GB:.1f} GB weights/GPU, KV pool {pool}, max context "
                f"{min(p.context_length, p.max_total_tokens):,}, {held:,} request{'' if held == 1 else 's'} of "
                f"{tokens_label(self.at_context)} tokens at once")

    def format(self) -> str:
        lines = [f"weights per GPU {self.weight_bytes / GB:.1f} GB (checkpoint {self.checkpoint_bytes / GB:.1f} GB); "
                 f"pool budget per GPU {self.budget_bytes / GB:.1f} GB"]
        if self.plan is not None:
            p = self.plan
            lines.append(p.format())
            for row in (*p.per_token.compressed, p.per_token.window):
                tokens = p.shape.num_swa_slots - 1 if row is p.per_token.window else p.max_total_tokens
                lines.append(f"  {row.pool:<22} {row.per_token * tokens / GB:8.2f} GB")
            lines.append(f"  {'staging state':<22} {p.state_bytes / GB:8.2f} GB")
        return "\n".join(lines + [self.summary()])


def plan_capacity(config, args, pc, weight_bytes: int, checkpoint_bytes: int, total: int, free_after_weights: int,
                  device_type: str = "cuda", graph_reserve: int = 0, dtype=torch.bfloat16,
                  at_context: int = 131072) -> CapacityReport:
    """The engine's pool plan per GPU for resolved server args `args` (page_size, max_running_requests,
    context_length, chunked_prefill_size, swa_full_tokens_ratio, max_total_tokens, kv_cache_dtype,
    enable_deepseek_v4_fp4_indexer, speculative_num_draft_tokens, mem_fraction_static, disable_radix_cache). Under
    DP-attention each GPU holds the pools of its DP group's requests (max_running_requests / dp)."""
    from sglang.srt.mem_cache.pool_sizing import plan_pools_for_args, pool_budget_bytes

    budget = pool_budget_bytes(device_type, free_after_weights, total, args.mem_fraction_static, graph_reserve)
    if budget <= 0:
        graphs = f" less {graph_reserve / GB:.1f} GB of CUDA graphs" if graph_reserve else ""
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, None, at_context,
                              f"weights {weight_bytes / GB:.1f} GB/GPU leave no room for the KV pools at "
                              f"--mem-fraction-static {args.mem_fraction_static} of {total / GB:.1f} GB{graphs}")
    per_rank, groups = vars(args), 1
    if pc.dp_attention and pc.dp > 1:
        per_rank, groups = {**per_rank, "max_running_requests": max(1, args.max_running_requests // pc.dp)}, pc.dp
    try:
        plan = plan_pools_for_args(config, SimpleNamespace(**per_rank), budget, dtype,
                                   with_draft=bool(args.speculative_num_draft_tokens))[0]
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, plan, at_context, dp_groups=groups)
    except ValueError as err:
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, None, at_context,
                              f"weights {weight_bytes / GB:.1f} GB/GPU leave {budget / GB:.1f} GB for the KV pools: "
                              f"{err}")


def hub_model(model: str) -> Optional[tuple]:
    """(hub id, config dict, routed experts' stored format) of a preset name or known hub id, else None."""
    from sglang.srt.configs.hub_configs import HUB_MODELS, PRESETS

    known = {k.lower(): k for k in HUB_MODELS}
    hub_id = PRESETS.get(model) or known.get(model.lower())
    return None if hub_id is None else (hub_id, *HUB_MODELS[hub_id])


def hub_plans(config, part: str, experts: str) -> list:
    """The checkpoint plan (loader.TensorPlan per tensor) the hub checkpoint's headers give, without its files: FP8
    linears with 128 x 128 E8M0 block scales, routed experts `experts` ("fp4": packed MXFP4, one E8M0 scale per 32
    inputs; "fp8": as the linears), other floats bf16 (the fp32-kept ones fp32), integer tables int32."""
    from sglang.srt.model_loader.checkpoint_spec import TensorKind, expected_tensors
    from sglang.srt.model_loader.loader import StoredTensor, TensorPlan
    from sglang.srt.model_loader.weight_utils import TensorRecord

    def stored(name: str, shape: tuple, dtype: torch.dtype, dtype_name: str) -> StoredTensor:
        return StoredTensor(TensorRecord(name, "", tuple(shape), dtype, dtype_name))

    plans = []
    for name, spec in expected_tensors(config, part).items():
        scale_name = name[: -len("weight")] + "scale"
        fp8 = spec.kind == TensorKind.LINEAR or (spec.kind == TensorKind.EXPERT and experts == "fp8")
        if fp8:
            grid = tuple(math.ceil(n / 128) for n in spec.shape)
            plans.append(TensorPlan(name, spec, "fp8", stored(name, spec.shape, torch.float8_e4m3fn, "F8_E4M3"),
                                    stored(scale_name, grid, torch.float8_e8m0fnu, "F8_E8M0")))
        elif spec.kind == TensorKind.EXPERT:
            out_f, in_f = spec.shape
            plans.append(TensorPlan(name, spec, "fp4", stored(name, (out_f, in_f // 2), torch.int8, "I8"),
                                    stored(scale_name, (out_f, in_f // 32), torch.float8_e8m0fnu, "F8_E8M0")))
        elif spec.kind == TensorKind.INDEX:
            plans.append(TensorPlan(name, spec, "index", stored(name, spec.shape, torch.int32, "I32")))
        else:
            fp32 = spec.kind == TensorKind.FP32
            plans.append(TensorPlan(name, spec, "plain", stored(name, spec.shape, torch.float32 if fp32 else
                                                                torch.bfloat16, "F32" if fp32 else "BF16")))
    return plans


def checkpoint_plans(model: str, config, parts: tuple) -> dict:
    """{part: its checkpoint plan}: a preset's from the hub formats (no files read), a directory's from its headers."""
    from sglang.srt.model_loader.loader import plan_checkpoint

    hub = hub_model(model)
    if hub is not None:
        return {part: _hub_plans_of(hub[0], part) for part in parts}
    return {part: plan_checkpoint(model, config, part) for part in parts}


@functools.lru_cache(maxsize=None)
def _hub_plans_of(hub_id: str, part: str) -> tuple:
    """hub_plans of a known hub id, made once per process (Pro's take seconds; a docs check plans it many times)."""
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import HUB_MODELS

    config, experts = HUB_MODELS[hub_id]
    return tuple(hub_plans(DeepseekV4Config.from_dict(config), part, experts))


@dataclass(frozen=True)
class RankWeights:
    weight_bytes: int  # rank 0's parameters and buffers on the device
    checkpoint_bytes: int  # the loaded parts as stored
    kept: str  # which formats stay quantized


def rank_weights(model: str, config, args, pc, device: torch.device) -> RankWeights:
    """Rank 0's weights as the engine builds them for `device` (model_builder.load_models' formats and sizes)."""
    from sglang.srt.distributed.parallel_state import layout_of_rank
    from sglang.srt.model_loader.loader import checkpoint_bytes
    from sglang.srt.model_loader.model_builder import (
        MODEL_CLASSES, bf16_projection_names, build_meta_model, kept_formats, parameter_bytes)

    parts = ("main", "mtp") if args.speculative_algorithm is not None else ("main",)
    plans = checkpoint_plans(model, config, parts)
    fp8, experts = kept_formats(args, plans, config, device, pc)
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
    with layout_of_rank(pc):  # rank 0's model as rank 0 builds it (local expert and head sizes, their layouts)
        need = sum(parameter_bytes(build_meta_model(MODEL_CLASSES[p], config, dtype, fp8[p], experts,
                                                    bf16_projection_names(plans[p], dtype, device))) for p in parts)
    kept = (f"{sum(map(len, fp8.values()))} linears kept FP8, routed experts "
            + ({"fp4": "kept MXFP4", "fp8": "kept FP8"}.get(experts) or f"in {args.dtype}"))
    return RankWeights(need, sum(checkpoint_bytes(p) for p in plans.values()), kept)


def per_rank_weight_bytes(model: str, config, args, pc, device: torch.device) -> tuple:
    """(per-GPU weight bytes, checkpoint bytes) of the engine's models for `device`."""
    w = rank_weights(model, config, args, pc, device)
    return w.weight_bytes, w.checkpoint_bytes


@contextmanager
def planned_platform(gpu: GpuSpec):
    """Decide formats and defaults as on `gpu`'s platform, whatever this machine is (sglang.srt.platform answers every
    probe for it: ROCm with AITER for an AMD GPU, CUDA otherwise)."""
    from sglang.srt.platform import simulate_platform

    with simulate_platform("hip", gfx="gfx950", aiter=True) if gpu.vendor == "amd" else simulate_platform("cuda"):
        yield


def build_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    ap = argparse.ArgumentParser(
        prog="python -m sglang.check_capacity", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [flash|pro|HUB_ID|CHECKPOINT_DIR | --model-path M] [--gpu h200|b200|mi355x] [--summary] "
              "[launch_server flags]",
        description=__doc__.split("\n\n")[0] + " GB = 10^9 bytes.",
        epilog="A launch command's flags are taken verbatim: replace `python -m sglang.launch_server` with `python -m "
               "sglang.check_capacity --gpu h200|b200|mi355x`. Exit status: 0 fits, 1 does not fit, 2 the arguments "
               "are refused.")
    ap.add_argument("model", nargs="?",
                    help="flash or pro (the hub's DeepSeek-V4-Flash / -Pro), a hub id, or a checkpoint directory; "
                         "or give it as --model-path, as launch_server does")
    g = ap.add_argument_group("planner", "what the plan is for; GB = 10^9 bytes")
    g.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                   help="the GPU kind, one per --tp rank (default h200): "
                        + "; ".join(GPUS[k].describe() for k in sorted(GPUS)))
    g.add_argument("--gpu-memory-gb", type=float,
                   help="memory per GPU in GB (10^9 bytes), instead of --gpu's (its kind still decides the formats)")
    g.add_argument("--gpu-free-fraction", type=float, default=1.0,
                   help="share of each GPU's memory free before the server loads (default 1.0: nothing else on it)")
    g.add_argument("--cuda-graph-reserve-gb", type=float, default=0.0,
                   help="GB per GPU the CUDA graphs take, which the engine measures at start and takes out of the "
                        "pools (default 0; the engine logs it in GiB, 'CUDA graph memory: X GiB': X x 1.074 GB)")
    g.add_argument("--at-context", type=int, default=131072,
                   help="context length in tokens of the requests counted as held at once (default 131072)")
    g.add_argument("--summary", action="store_true",
                   help="print the verdict alone, on one line (the docs tables' format)")
    ServerArgs.add_cli_args(ap)
    ap._option_string_actions["--model-path"].required = False  # or positional
    ap._optionals.title = "options: launch_server's flags (those the plan does not depend on change nothing)"
    return ap


@dataclass
class Planned:
    name: str  # the model as given
    gpu: GpuSpec
    args: object  # resolved ServerArgs
    weights: RankWeights
    report: CapacityReport
    summary: bool  # --summary


def plan_from_argv(argv: list) -> Planned:
    """Parse and plan; ValueError (naming the flag or size) for arguments the server refuses, SystemExit for usage
    errors (argparse)."""
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.model_loader.loader import CheckpointQuantization
    from sglang.srt.server_args import ServerArgs

    ap = build_parser()
    ns = ap.parse_args(argv)
    if ns.model and ns.model_path and ns.model != ns.model_path:
        ap.error(f"the model is given twice: {ns.model!r} and --model-path {ns.model_path!r}")
    name = ns.model or ns.model_path
    if not name:
        ap.error("give the model: flash, pro, a hub id or a checkpoint directory (or --model-path)")
    for flag, value in (("--gpu-free-fraction", ns.gpu_free_fraction), ("--at-context", ns.at_context)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if ns.gpu_memory_gb is not None and not ns.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {ns.gpu_memory_gb}")
    gpu = GPUS[ns.gpu]
    if ns.gpu_memory_gb is not None:
        gpu = GpuSpec(gpu.name, int(ns.gpu_memory_gb * GB), gpu.vendor, "given by --gpu-memory-gb")
    ns.model_path, ns.device = name, "cuda"  # the plan is a GPU's (ROCm's torch names its GPUs cuda too)
    args = ServerArgs.from_cli_args(ns)
    with planned_platform(gpu):
        hub = hub_model(name)
        if hub is not None:
            config = DeepseekV4Config.from_dict(hub[1])
            resolve_server_args(args, (config, CheckpointQuantization("fp8", hub[2])))  # FP8 linears on the hub
        else:
            from sglang.srt.model_loader.model_path import resolve_model_path

            args.model_path = resolve_model_path(name)
            config = DeepseekV4Config.from_pretrained(args.model_path)
            resolve_server_args(args)
        pc = args.parallel_config()
        weights = rank_weights(args.model_path if hub is None else name, config, args, pc, torch.device("cuda"))
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
    report = plan_capacity(config, args, pc, weights.weight_bytes, weights.checkpoint_bytes, gpu.memory_bytes,
                           int(gpu.memory_bytes * ns.gpu_free_fraction) - weights.weight_bytes,
                           graph_reserve=int(ns.cuda_graph_reserve_gb * GB), dtype=dtype, at_context=ns.at_context)
    return Planned(name, gpu, args, weights, report, ns.summary)


def header(p: Planned) -> str:
    a, pc = p.args, p.args.parallel_config()
    layout = f"TP{pc.tp}" + (f" EP{pc.ep}" if pc.ep > 1 else "") + (f" DP-attention {pc.dp}" if pc.dp_attention else "")
    kv = f"auto ({a.dtype})" if a.kv_cache_dtype == "auto" else a.kv_cache_dtype
    spec = f"MTP draft {a.speculative_num_draft_tokens} tokens" if a.speculative_algorithm else "no MTP draft"
    return "\n".join([
        f"{p.name} on {pc.tp} x {p.gpu.name} GPUs, {layout}, KV {kv}, --mem-fraction-static {a.mem_fraction_static}",
        f"units: GB = 10^9 bytes, MiB = 2^20 bytes; {p.gpu.describe()}",
        f"server args: page size {a.page_size}, context length {a.context_length:,}, max running requests "
        f"{a.max_running_requests}, chunked prefill {a.chunked_prefill_size:,}, {spec}, prefix cache "
        f"{'off' if a.disable_radix_cache else 'on'}, quantization {a.quantization} ({p.weights.kept})"])


def main(argv=None) -> int:
    try:
        planned = plan_from_argv(sys.argv[1:] if argv is None else list(argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if planned.summary:
        print(planned.report.summary())
    else:
        print(header(planned))
        print(planned.report.format())
    return 0 if planned.report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
