"""Build the target (and MTP draft) model in its final form and load it, after checking that it fits.

Order: decide which stored formats stay quantized on this device (FP8 linears, packed MXFP4 experts); build both models
on the meta device with their final modules and dtypes; count the bytes their parameters will take and refuse before
allocating anything if the device cannot hold them next to the --mem-fraction-static reserve; then materialise on the
device and stream the checkpoint into the parameters one tensor at a time (no full-model host copy).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.distributed.sharding import (
    EXPERT_BLOCKS, ParallelConfig, experts_split_whole_blocks, local_name, rank_tensor)
from sglang.srt.layers.fp32_linear import bf16_weights_supported
from sglang.srt.layers.moe.experts import log_moe_paths, replace_routed_experts
from sglang.srt.layers.quantization.fp8 import Fp8RoutedExperts, fp8_linears_supported, replace_fp8_linears
from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts, mxfp4_experts_supported, serve_experts_with_aiter
from sglang.srt.layers.rotary import RotaryEmbedding
from sglang.srt.model_loader.loader import (
    checkpoint_bytes, fp8_linear_names, iter_checkpoint, plan_checkpoint, quantization_of)
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_nextn import DeepseekV4ForCausalLMNextN
from sglang.srt.models.weight_loading import BF16_PROJECTION
from sglang.srt.platform import memory_budget_bytes

logger = logging.getLogger(__name__)

# Parameters kept in fp32 whatever the compute dtype (mHC mixes, sinks, compressor position biases, router
# bias, norm weights): small, and precision-sensitive. The compressors' and router's projections (BF16_PROJECTION)
# compute in fp32 too (as the reference does): their weights are kept bf16 where every loaded value is one
# (bf16_projection_names; a bf16 GEMM with fp32 output is then the same function, layers/fp32_linear.py), else fp32.
_FP32_PARAM = re.compile(r"(hc_\w+|attn_sink|\.ape|gate\.bias|norm\.weight|weight_scale_inv)$")
_FLOAT_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))  # FP8 / packed weights keep theirs


def bf16_projection_names(plans: list, dtype: torch.dtype, device: torch.device) -> frozenset:
    """Native names of the planned fp32-computed projection weights (BF16_PROJECTION) whose loaded values are all
    bf16 values, decided per weight from the checkpoint's headers: the loader yields them in the engine's `dtype`
    (checkpoint_spec: FLOAT), so every one in a bf16 engine; in an fp32 engine those stored BF16 (widened exactly);
    none in an fp16 engine (fp16 values are not all bf16 values). The rest stay fp32, and all of them on devices
    without the bf16 GEMM with fp32 output (fp32_linear.bf16_weights_supported). load_native_weights checks the
    values again as it copies them."""
    if not bf16_weights_supported(device):
        return frozenset()
    if dtype == torch.bfloat16:
        return frozenset(p.name for p in plans if BF16_PROJECTION.search(p.name))
    if dtype == torch.float32:
        return frozenset(p.name for p in plans if BF16_PROJECTION.search(p.name)
                         and p.fmt == "plain" and p.weight.record.dtype_name == "BF16")
    return frozenset()


def build_meta_model(cls, config: DeepseekV4Config, dtype: torch.dtype, fp8_weights: frozenset = frozenset(),
                     experts: Optional[str] = None, bf16_weights: frozenset = frozenset()) -> nn.Module:
    """The model on the meta device in its final form: the linears of `fp8_weights` (native weight names) are
    Fp8BlockLinear, the routed experts Mxfp4RoutedExperts (`experts` "fp4") or Fp8RoutedExperts ("fp8") when kept
    quantized; float parameters in `dtype` except the fp32-kept ones; the fp32-computed projections
    (BF16_PROJECTION) bf16 where named in `bf16_weights` (bf16_projection_names), else fp32."""
    with torch.device("meta"):
        model = cls(config)
        local_groups = config.o_groups // get_parallel_state().attn_tp.world_size
        replace_fp8_linears(model, fp8_weights, lambda name: local_groups if name.endswith(".wo_a") else 1)
        if experts is not None:
            replace_routed_experts(model, {"fp4": Mxfp4RoutedExperts, "fp8": Fp8RoutedExperts}[experts])
    for name, param in model.named_parameters():
        if param.dtype not in _FLOAT_DTYPES:
            continue
        if BF16_PROJECTION.search(name):
            param.data = param.data.to(torch.bfloat16 if name in bf16_weights else torch.float32)
        elif not _FP32_PARAM.search(name):
            param.data = param.data.to(dtype)
    return model


def materialize(model: nn.Module, device) -> nn.Module:
    model = model.to_empty(device=device)
    for module in model.modules():  # non-persistent buffers are not in the checkpoint: recompute them
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return model.eval()


def parameter_bytes(model: Optional[nn.Module]) -> int:
    if model is None:
        return 0
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@dataclass
class LoadedModels:
    model: DeepseekV4ForCausalLM
    draft_model: Optional[DeepseekV4ForCausalLMNextN]
    weight_bytes: int  # what the parameters take on the device
    checkpoint_bytes: int  # what the loaded parts take in the checkpoint
    kept: tuple = ()  # (FP8 linears per part, routed experts' format): what a weight update must bring alike


def check_fits(weight_bytes: int, stored_bytes: int, device: torch.device, mem_fraction_static: float,
               what: str) -> None:
    """Refuse, before allocating, weights the device cannot hold beside the (1 - mem_fraction_static) reserve."""
    free, total = memory_budget_bytes(str(device))
    available = free - (1 - mem_fraction_static) * total if device.type == "cuda" else free
    if weight_bytes > available:
        gb = 1e9
        raise ValueError(
            f"the weights need {weight_bytes / gb:.1f} GB on {device.type} ({what}; checkpoint {stored_bytes / gb:.1f} "
            f"GB) but only {max(available, 0) / gb:.1f} GB is available ({free / gb:.1f} GB free of {total / gb:.1f} GB"
            + (f", less the {1 - mem_fraction_static:.2f} reserve of --mem-fraction-static" if device.type == "cuda"
               else "") + "): keep the checkpoint's quantized formats (--quantization fp8 on an NVIDIA GPU) or shard "
            "the model over more GPUs")


def rank_weights(config: DeepseekV4Config, stream):
    """`stream(select)` -> (name, tensor) pairs; under tensor / expert parallelism, this rank's parts only (other
    ranks' experts are not read; see distributed/sharding.py), else the stream itself."""
    state = get_parallel_state()
    if state.config.tp == 1:
        return stream(None)
    pc, coords, num_experts = state.config, state.coords, config.n_routed_experts

    def select(name: str) -> bool:
        return local_name(name, pc, coords, num_experts) is not None

    def parts():
        for name, tensor in stream(select):
            kept = rank_tensor(name, tensor, pc, coords, num_experts)
            if kept is not None:
                yield kept[0], kept[1].contiguous()
    return parts()


MODEL_CLASSES = {"main": DeepseekV4ForCausalLM, "mtp": DeepseekV4ForCausalLMNextN}


def kept_formats(args, plans: dict, config: DeepseekV4Config, device: torch.device, pc=None) -> tuple:
    """From each part's checkpoint plan: (native names of the FP8 linears kept FP8 per part, the stored format the
    routed experts keep: "fp4" (packed MXFP4), "fp8" (FP8-converted) or None (dequantized at load)) on `device`, for
    the parallel layout `pc` (ParallelConfig; default one rank)."""
    keep_fp8 = args.quantization == "fp8" and fp8_linears_supported(device)
    stored = quantization_of(plans["main"]).experts
    experts = None
    if stored == "fp4" and args.quantization in ("fp8", "mxfp4") and mxfp4_experts_supported(device):
        experts = "fp4"
    elif stored == "fp8" and keep_fp8 and (config.quantization_config is None
                                            or tuple(config.quantization_config.weight_block_size) == (128, 128)):
        experts = "fp8"
    pc = pc or ParallelConfig()
    if experts is not None and not experts_split_whole_blocks(config, pc, experts):
        logger.warning("routed experts stored %s are dequantized at load: moe_intermediate_size %d over %d MoE "
                       "tensor-parallel ranks leaves parts of %d, not whole blocks of %d (a larger --ep splits "
                       "fewer experts' widths)", experts.upper(), config.moe_intermediate_size, pc.moe_tp,
                       config.moe_intermediate_size // pc.moe_tp, EXPERT_BLOCKS[experts])
        experts = None
    # beside kept routed experts the shared expert stays FP8 too (decode reads half its bf16 bytes)
    fp8 = {part: fp8_linear_names(p, config, experts is not None, pc) if keep_fp8 else frozenset()
           for part, p in plans.items()}
    return fp8, experts


def load_models(args, model_path: str, config: DeepseekV4Config, dtype: torch.dtype,
                device: torch.device) -> LoadedModels:
    """The target model, and the MTP draft under speculative decoding, built, checked against memory and loaded."""
    parts = ("main", "mtp") if args.speculative_algorithm is not None else ("main",)
    plans = {part: plan_checkpoint(model_path, config, part) for part in parts}  # headers read once per part
    fp8, experts = kept_formats(args, plans, config, device, args.parallel_config())
    metas = {part: build_meta_model(MODEL_CLASSES[part], config, dtype, fp8[part], experts,
                                    bf16_projection_names(plans[part], dtype, device)) for part in parts}
    need = sum(parameter_bytes(m) for m in metas.values())
    stored = sum(checkpoint_bytes(p) for p in plans.values())
    kept = f"{sum(map(len, fp8.values()))} linears kept FP8, routed experts " + (
        {"fp4": "kept MXFP4", "fp8": "kept FP8"}.get(experts) or f"in {args.dtype}")
    check_fits(need, stored, device, args.mem_fraction_static, kept)
    models = {}
    for part in parts:
        models[part] = materialize(metas[part], device)
        models[part].load_weights(rank_weights(config, lambda select: iter_checkpoint(
            model_path, config, dtype=dtype, part=part, device=device, keep_fp8=fp8[part],
            keep_fp4=experts == "fp4", keep_fp8_experts=experts == "fp8", plans=plans[part], select=select)))
    draft = models.get("mtp")
    if draft is not None:
        draft.set_embed_and_head(models["main"].embed, models["main"].head)
    logger.info("weights on %s: %.2f GB (checkpoint %.2f GB; %s)", device.type, need / 1e9, stored / 1e9, kept)
    if experts == "fp4" and device.type == "cuda":  # ROCm's GPUs are torch "cuda" devices
        serve_experts_with_aiter(models.values(), dtype, args.parallel_config().ep > 1)
    log_moe_paths(models.values(), dtype)
    return LoadedModels(models["main"], draft, need, stored, (fp8, experts))


class PartialUpdateError(RuntimeError):
    """A weight update failed after it had begun writing parameters (the model holds a mix of both checkpoints)."""


def reload_weights(args, model_path: str, config: DeepseekV4Config, dtype: torch.dtype, device: torch.device,
                   models: dict, kept: tuple) -> int:
    """Stream the checkpoint at `model_path` into the loaded `models` ({part: model}) in place: the same
    architecture and kept formats, so every parameter keeps its storage (CUDA graphs stay valid) and nothing is
    allocated beside the weights but one tensor at a time. Checked before writing (ValueError: nothing written);
    PartialUpdateError once writing began. Returns the checkpoint bytes read."""
    try:  # every tensor checked first; an unreadable file (a truncated or garbage header) is the client's too
        plans = {part: plan_checkpoint(model_path, config, part) for part in models}
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"the checkpoint at {model_path} cannot be read: {e}") from None
    fp8, experts = kept_formats(args, plans, config, device, args.parallel_config())
    if (fp8, experts) != kept:
        raise ValueError(f"the checkpoint at {model_path} stores other formats (routed experts "
                         f"{experts or 'dequantized'}, {sum(map(len, fp8.values()))} FP8 linears kept) than the "
                         f"served weights (routed experts {kept[1] or 'dequantized'}, "
                         f"{sum(map(len, kept[0].values()))}); restart the server to change formats")
    for m in (m for model in models.values() for m in model.modules() if isinstance(m, Mxfp4RoutedExperts)):
        m.scale_range = (256, -1)  # measured again by this load
    try:
        for part, model in models.items():
            model.load_weights(rank_weights(config, lambda select, part=part: iter_checkpoint(
                model_path, config, dtype=dtype, part=part, device=device, keep_fp8=fp8[part],
                keep_fp4=experts == "fp4", keep_fp8_experts=experts == "fp8", plans=plans[part], select=select)))
    except Exception as e:
        raise PartialUpdateError(f"loading {model_path} failed midway: {e}") from e
    return sum(checkpoint_bytes(p) for p in plans.values())
