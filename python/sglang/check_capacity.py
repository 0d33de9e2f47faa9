"""Capacity planner: will a DeepSeek-V4 deployment fit, and how many tokens and requests will it hold?

    python -m sglang.check_capacity flash|pro|MODEL_PATH [--tp 8] [--ep 8] [--dp 8 --enable-dp-attention]
        [--gpu h200|b200|mi355x | --gpu-memory-gb 141] [--kv-cache-dtype auto|fp8_e4m3] [--mem-fraction-static 0.85]
        [--context-length N] [--max-running-requests 256] [--speculative-num-steps 3] [--at-context 131072]

Prints per GPU: weight bytes (the engine's model built on the meta device in its final form, as rank 0 of the
layout builds its own: sglang.srt.distributed.parallel_state.layout_of_rank), pool bytes per kind, max total tokens,
max context, how many requests of `--at-context` tokens fit at once, and whether it fits. The pool plan is the
engine's own (`plan_pools_for_args` with the budget formula of `pool_budget_bytes`), so the numbers equal what the
engine logs at start for the same arguments (test/srt/test_check_capacity.py checks it on CPU). What the planner
cannot know: memory other processes hold (assumed none: `--gpu-free-fraction`), the CUDA-graph memory the engine
measures at start (`--cuda-graph-reserve-gb`, default 0), and the runtime's own (CUDA context, NCCL buffers): on 2
H200s at TP2 the engine's pools came out 2.8% smaller than planned with the measured graph memory given. Built-in
`flash` / `pro` assume the hub's formats (FP8 linears, MXFP4 experts): kept quantized on NVIDIA GPUs, dequantized to
bf16 on AMD ones (what the engine does today).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

# Memory per GPU (bytes). H200: what the runtime reports (nvidia-smi 143,771 MiB on the lent H200s; the "141 GB" of
# the data sheet is 10^9-byte units of less); B200 180 GB and MI355X 288 GB: the vendors' figures, not measured here.
GPUS = {"h200": 143771 * 2**20, "b200": 180e9, "mi355x": 288e9}
AMD_GPUS = ("mi355x",)


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

    def format(self) -> str:
        gb = 1e9
        lines = [f"weights per GPU {self.weight_bytes / gb:.1f} GB (checkpoint {self.checkpoint_bytes / gb:.1f} GB); "
                 f"pool budget per GPU {self.budget_bytes / gb:.1f} GB"]
        if self.plan is None:
            return "\n".join(lines + [f"does NOT fit: {self.error}"])
        p = self.plan
        lines.append(p.format())
        for row in (*p.per_token.compressed, p.per_token.window):
            tokens = p.shape.num_swa_slots - 1 if row is p.per_token.window else p.max_total_tokens
            lines.append(f"  {row.pool:<22} {row.per_token * tokens / gb:8.2f} GB")
        lines.append(f"  {'staging state':<22} {p.state_bytes / gb:8.2f} GB")
        groups = f" per DP group (x {self.dp_groups})" if self.dp_groups > 1 else ""
        lines.append(f"fits: max total tokens {p.max_total_tokens}{groups}, max context "
                     f"{min(p.context_length, p.max_total_tokens)}, {self.requests_at(self.at_context)} concurrent "
                     f"requests of {self.at_context} tokens")
        return "\n".join(lines)


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
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, None, at_context,
                              f"the weights take {weight_bytes / 1e9:.1f} GB per GPU: --mem-fraction-static "
                              f"{args.mem_fraction_static} of {total / 1e9:.0f} GB leaves nothing for the KV pools")
    per_rank, groups = vars(args), 1
    if pc.dp_attention and pc.dp > 1:
        per_rank, groups = {**per_rank, "max_running_requests": max(1, args.max_running_requests // pc.dp)}, pc.dp
    try:
        plan = plan_pools_for_args(config, SimpleNamespace(**per_rank), budget, dtype,
                                   with_draft=bool(args.speculative_num_draft_tokens))[0]
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, plan, at_context, dp_groups=groups)
    except ValueError as err:
        return CapacityReport(weight_bytes, checkpoint_bytes, budget, None, at_context, str(err))


def per_rank_weight_bytes(model: str, config, args, pc, device: torch.device) -> tuple:
    """(per-GPU weight bytes, checkpoint bytes) of the engine's models for `device`."""
    from sglang.srt.distributed.parallel_state import layout_of_rank
    from sglang.srt.distributed.sharding import splits_whole_blocks
    from sglang.srt.model_loader.checkpoint_spec import TensorKind, expected_tensors
    from sglang.srt.model_loader.loader import checkpoint_bytes, plan_checkpoint
    from sglang.srt.model_loader.model_builder import MODEL_CLASSES, build_meta_model, kept_formats, parameter_bytes

    parts = ("main", "mtp") if args.speculative_num_draft_tokens else ("main",)
    if model in ("flash", "pro"):  # the hub's formats: FP8 linears (+ 128x128 scales), MXFP4 experts
        nvidia = device.type == "cuda"
        specs = {part: expected_tensors(config, part) for part in parts}
        # as model_builder.kept_formats: every FP8 linear (the shared expert's too, beside kept MXFP4 experts) whose
        # rank parts are whole 128 x 128 blocks
        fp8 = {part: frozenset(n for n, s in specs[part].items() if s.kind == TensorKind.LINEAR
                               and splits_whole_blocks(n, s.shape, pc)) if nvidia else frozenset() for part in parts}
        experts = "fp4" if nvidia else None
        stored = 0
        for part in parts:
            for name, spec in specs[part].items():
                n = spec.shape[0] * (spec.shape[1] if len(spec.shape) > 1 else 1)
                if spec.kind == TensorKind.LINEAR:
                    stored += n + -(-spec.shape[0] // 128) * -(-spec.shape[1] // 128)
                elif spec.kind == TensorKind.EXPERT:
                    stored += n // 2 + n // 32
                else:
                    stored += n * (4 if spec.kind in (TensorKind.FP32, TensorKind.INDEX) else 2)
    else:
        plans = {part: plan_checkpoint(model, config, part) for part in parts}
        fp8, experts = kept_formats(args, plans, config, device, pc)
        stored = sum(checkpoint_bytes(p) for p in plans.values())
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.bfloat16)
    with layout_of_rank(pc):  # rank 0's model as rank 0 builds it (local expert and head sizes, their layouts)
        need = sum(parameter_bytes(build_meta_model(MODEL_CLASSES[p], config, dtype, fp8[p], experts)) for p in parts)
    return need, stored


def main(argv=None) -> int:
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import FLASH, PRO
    from sglang.srt.distributed.sharding import ParallelConfig

    ap = argparse.ArgumentParser(prog="python -m sglang.check_capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="flash, pro, or a checkpoint directory")
    ap.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1)
    ap.add_argument("--ep", "--ep-size", dest="ep", type=int, default=1)
    ap.add_argument("--dp", "--dp-size", dest="dp", type=int, default=1)
    ap.add_argument("--enable-dp-attention", action="store_true")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    ap.add_argument("--gpu-memory-gb", type=float, help="memory per GPU (overrides --gpu)")
    ap.add_argument("--gpu-free-fraction", type=float, default=1.0, help="share of it free before loading")
    ap.add_argument("--cuda-graph-reserve-gb", type=float, default=0.0)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3", "bfloat16"),
                    help="as the engine's flag: auto (its default) = the model dtype, bf16")
    ap.add_argument("--enable-deepseek-v4-fp4-indexer", action="store_true")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--swa-full-tokens-ratio", type=float, default=0.1)
    ap.add_argument("--speculative-num-steps", type=int, default=0)
    ap.add_argument("--disable-radix-cache", action="store_true", help="no prefix-cache staging states (default: the "
                                                                        "cache is on, as in the engine)")
    ap.add_argument("--quantization", choices=("fp8", "mxfp4", "none"), help="for a checkpoint directory: default "
                    "detected")
    ap.add_argument("--at-context", type=int, default=131072)
    a = ap.parse_args(argv)
    presets = {"flash": FLASH, "pro": PRO}
    if a.model in presets:
        config = DeepseekV4Config.from_dict(presets[a.model])
    else:
        from sglang.srt.arg_groups.deepseek_v4_hook import apply_quantization
        from sglang.srt.model_loader.model_path import resolve_model_path

        a.model = resolve_model_path(a.model)
        config = DeepseekV4Config.from_pretrained(a.model)
        a.device = "cuda"  # the plan is a GPU's: quantized formats stay quantized there
        apply_quantization(a, a.model, config)
    pc = ParallelConfig(a.tp, a.ep, a.dp, a.enable_dp_attention)
    try:
        pc.validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = SimpleNamespace(
        page_size=a.page_size, max_running_requests=a.max_running_requests,
        context_length=a.context_length or config.max_position_embeddings, chunked_prefill_size=a.chunked_prefill_size,
        swa_full_tokens_ratio=a.swa_full_tokens_ratio, max_total_tokens=a.max_total_tokens,
        kv_cache_dtype=a.kv_cache_dtype, enable_deepseek_v4_fp4_indexer=a.enable_deepseek_v4_fp4_indexer,
        speculative_num_draft_tokens=a.speculative_num_steps + 1 if a.speculative_num_steps else 0,
        mem_fraction_static=a.mem_fraction_static, quantization=a.quantization, dtype="bfloat16",
        disable_radix_cache=a.disable_radix_cache)
    amd = a.gpu in AMD_GPUS and a.gpu_memory_gb is None
    device = torch.device("cpu") if amd else torch.device("cuda")  # AMD: the engine dequantizes at load today
    total = int(a.gpu_memory_gb * 1e9 if a.gpu_memory_gb else GPUS[a.gpu])
    weights, stored = per_rank_weight_bytes(a.model, config, args, pc, device)
    report = plan_capacity(config, args, pc, weights, stored, total, int(total * a.gpu_free_fraction) - weights,
                           graph_reserve=int(a.cuda_graph_reserve_gb * 1e9), at_context=a.at_context)
    gpus = f"{a.tp} x {a.gpu_memory_gb or a.gpu}"
    layout = f"TP{pc.tp}" + (f" EP{pc.ep}" if pc.ep > 1 else "") + (f" DP-attention {pc.dp}" if pc.dp_attention else "")
    kv = "auto (bfloat16)" if a.kv_cache_dtype == "auto" else a.kv_cache_dtype
    print(f"{a.model} on {gpus} GPUs, {layout}, KV {kv}, --mem-fraction-static {a.mem_fraction_static}")
    print(report.format())
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
