"""DeepSeek-V4 defaults and validation of ServerArgs, in one place (printed at start by launch_server / Engine).

`resolve_server_args(args)` is what every entry point calls: the per-option checks of server_args.py, then this
hook. Platform-dependent defaults (attention kernel, shared-experts fusion, logits budget, AITER)
are decided by arg_groups/platform_defaults.py, called from here; `best_attention_backend` is re-exported from it.
The dependency goes one way: this package reads ServerArgs, server_args.py never calls in here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.arg_groups.platform_defaults import apply_platform_defaults, best_attention_backend  # noqa: F401
from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

DEFAULT_PAGE_SIZE = 256
# SGLang's default decode capture list: dense at small batches, then every 8 (capped by --cuda-graph-max-bs).
DEFAULT_CUDA_GRAPH_BS = [1, 2, 4, 8, 12] + list(range(16, 257, 8))
logger = logging.getLogger(__name__)


def validate_page_size(page_size: int, config: DeepseekV4Config) -> None:
    """A page must hold whole compression windows of every ratio and whole sliding windows."""
    for ratio in config.distinct_ratios:
        if page_size % ratio:
            raise ValueError(f"--page-size {page_size} must be a multiple of every compress ratio "
                             f"(ratio {ratio} does not divide it)")
    if page_size % config.sliding_window:
        raise ValueError(f"--page-size {page_size} must be a multiple of the sliding window "
                         f"{config.sliding_window}")


def apply_speculative_defaults(args: "ServerArgs", config: DeepseekV4Config) -> list:
    """EAGLE / NEXTN on the MTP layer: top-k 1 only; draft tokens = steps + 1 (the survey's 3-1-4 / 1-1-2)."""
    spec = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if args.speculative_algorithm is None:
        if any(v is not None for v in spec):
            raise ValueError("--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens "
                             "need --speculative-algorithm EAGLE")
        return []
    if args.speculative_algorithm == "NEXTN":
        args.speculative_algorithm = "EAGLE"
    if config.num_nextn_predict_layers < 1:
        raise ValueError("--speculative-algorithm EAGLE needs the checkpoint's MTP layer "
                         "(num_nextn_predict_layers is 0)")
    applied = []
    if args.speculative_num_steps is None:
        args.speculative_num_steps = 3
        applied.append("speculative_num_steps=3")
    if not 1 <= args.speculative_num_steps <= 8:
        raise ValueError(f"--speculative-num-steps must be in [1, 8], got {args.speculative_num_steps}")
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = 1
    if args.speculative_eagle_topk != 1:
        raise ValueError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: DeepSeek-V4's MTP draft supports "
                         f"top-k 1 only")
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
        applied.append(f"speculative_num_draft_tokens={args.speculative_num_draft_tokens}")
    if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        raise ValueError(f"--speculative-num-draft-tokens must equal --speculative-num-steps + 1 "
                         f"({args.speculative_num_steps + 1}) with top-k 1, got {args.speculative_num_draft_tokens}")
    return applied


def apply_cuda_graph_defaults(args: "ServerArgs") -> list:
    """The captured batch sizes of DECODE steps or speculative cycles (printed at start): --cuda-graph-bs, or
    SGLang's list up to --cuda-graph-max-bs; none under --disable-cuda-graph. Sizes above --max-running-requests are
    never used: dropped. The torch reference attention backend cannot be captured (its boolean-mask indexing waits
    on the host), so on a GPU it turns the graphs off (chosen explicitly, or where Triton is missing)."""
    applied = []
    if args.attention_backend == "torch" and args.device != "cpu" and not args.disable_cuda_graph:
        args.disable_cuda_graph = True
        applied.append("disable_cuda_graph=True (the torch attention backend is not capturable)")
    if args.disable_cuda_graph:
        args.cuda_graph_bs = None
        return applied
    if args.cuda_graph_bs:
        sizes = sorted(set(args.cuda_graph_bs))
    else:
        max_bs = args.cuda_graph_max_bs or min(256, args.max_running_requests)
        sizes = [bs for bs in DEFAULT_CUDA_GRAPH_BS if bs < max_bs] + [max_bs]
    usable = [bs for bs in sizes if bs <= args.max_running_requests]
    if len(usable) < len(sizes):
        usable = sorted(set(usable + [args.max_running_requests]))
        logger.info("CUDA graph batch sizes above --max-running-requests %d dropped", args.max_running_requests)
    args.cuda_graph_bs, args.cuda_graph_max_bs = usable, usable[-1]
    return [f"cuda_graph_bs={usable}"]


def apply_quantization(args: "ServerArgs", stored) -> list:
    """--quantization from the checkpoint's stored formats (`stored`: loader.CheckpointQuantization; printed at
    start): fp8 when its linears are FP8 (MXFP4 experts, if any, stay packed too), mxfp4 when only its routed experts
    are MXFP4, else none. An explicit value the checkpoint does not store is refused (nothing quantizes at load); so
    is SGLANG_DSV4_FP4_EXPERTS contradicting the experts' stored format (upstream's switch for FP8-converted expert
    checkpoints; detected here)."""
    fp4_env = envs.SGLANG_DSV4_FP4_EXPERTS.get()
    if fp4_env is not None and stored.experts is not None and fp4_env != (stored.experts == "fp4"):
        raise ValueError(f"SGLANG_DSV4_FP4_EXPERTS={int(fp4_env)} but the checkpoint's routed experts are stored "
                         f"{stored.experts}")
    if args.quantization == "fp8" and stored.linears != "fp8":
        raise ValueError(f"--quantization fp8: the checkpoint stores no FP8 linears ({stored.describe()})")
    if args.quantization == "mxfp4" and stored.experts != "fp4":
        raise ValueError(f"--quantization mxfp4: the checkpoint stores no MXFP4 experts ({stored.describe()})")
    if args.quantization is not None:
        return []
    args.quantization = "fp8" if stored.linears == "fp8" else "mxfp4" if stored.experts == "fp4" else "none"
    where = "kept quantized on the GPU" if args.device != "cpu" else "dequantized at load on CPU"
    note = f"; {where}" if args.quantization != "none" else ""
    return [f"quantization={args.quantization} (checkpoint: {stored.describe()}{note})"]


def apply_dp_attention_defaults(args: "ServerArgs") -> list:
    """DP attention runs every forward as a round of all ranks (distributed/dp_attention.py). Decode graphs open
    their round before the replay; whole speculative cycles (several rounds in one graph) and overlapped steps (a
    round beside the one in flight) cannot, so those are turned off."""
    applied = []
    if args.dp_size > 1:
        if not args.disable_cuda_graph and args.speculative_algorithm is not None:
            args.disable_cuda_graph = True
            applied.append("disable_cuda_graph=True (DP attention with speculative decoding)")
        if not args.disable_overlap_schedule:
            args.disable_overlap_schedule = True
            applied.append("disable_overlap_schedule=True (DP attention)")
    return applied


# DeepSeek-V4's chat parsers, on unless a flag says `none`: tool calls come back as tool_calls and thinking as
# reasoning_content, as upstream's DeepSeek-V4 recipes start the server.
DEFAULT_PARSERS = (("reasoning_parser", "deepseek-v4"), ("tool_call_parser", "deepseekv4"))


def apply_parser_defaults(args: "ServerArgs") -> list:
    """Unset parsers get the DeepSeek-V4 ones; `none` turns one off (None from here on: what the server reads)."""
    applied = []
    for name, parser in DEFAULT_PARSERS:
        if getattr(args, name) is None:
            setattr(args, name, parser)
            applied.append(f"{name}={parser}")
        elif getattr(args, name) == "none":
            setattr(args, name, None)
    return applied


def describe_parsers(args: "ServerArgs") -> str:
    """The start-up line naming the active chat parsers and whether each is the default (after resolve)."""
    parts = []
    for name, _ in DEFAULT_PARSERS:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None:
            parts.append(f"{flag} none (off)")
        else:
            default = f"{name}={value}" in getattr(args, "applied_defaults", [])
            parts.append(f"{flag} {value}" + (f" (default; {flag} none turns it off)" if default else ""))
    return ", ".join(parts)


def read_model(args: "ServerArgs") -> tuple:
    """(config, stored formats) of the checkpoint --model-path names (a hub id is fetched)."""
    from sglang.srt.model_loader.loader import detect_quantization
    from sglang.srt.model_loader.model_path import resolve_model_path

    model_dir = resolve_model_path(args.model_path)
    try:
        config = DeepseekV4Config.from_pretrained(model_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"--model-path {args.model_path}: {e}") from None
    return config, detect_quantization(model_dir, config)


def apply_deepseek_v4_defaults(args: "ServerArgs", config: DeepseekV4Config, stored) -> list:
    """Fill the options left unset with DeepSeek-V4 defaults and validate them against the model (its config and
    stored formats); returns 'name=value' of each default applied (printed at start)."""
    on_cpu = args.device == "cpu"
    applied = []

    def default(name: str, value) -> None:
        if getattr(args, name) is None:
            setattr(args, name, value)
            applied.append(f"{name}={value}")

    try:
        args.parallel_config().validate(config)  # names the heads / groups / experts that do not split
    except ValueError as e:
        if str(e).startswith("--"):
            raise
        sizes = " ".join(f"--{flag} {n}" for flag, n in (("tp", args.tp_size), ("ep", args.ep_size),
                                                          ("dp", args.dp_size)) if flag == "tp" or n > 1)
        raise ValueError(f"{sizes}: {e}") from None
    applied += apply_parser_defaults(args)
    default("page_size", DEFAULT_PAGE_SIZE)
    validate_page_size(args.page_size, config)
    applied += apply_platform_defaults(args)  # attention backend, fusion, budgets, AITER
    if args.context_length is not None and args.context_length > config.max_position_embeddings:
        raise ValueError(f"--context-length {args.context_length} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    default("context_length", config.max_position_embeddings)
    default("max_running_requests", 256)
    default("chunked_prefill_size", 1024 if on_cpu else 8192)
    default("mem_fraction_static", 0.25 if on_cpu else 0.85)
    applied += apply_quantization(args, stored)
    applied += apply_speculative_defaults(args, config)
    applied += apply_dp_attention_defaults(args)
    applied += apply_cuda_graph_defaults(args)
    if args.kv_cache_dtype == "fp8_e4m3" and config.nope_head_dim % 64:
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 needs head_dim - qk_rope_head_dim ({config.nope_head_dim}) "
                         f"to be a multiple of 64")
    if args.enable_deepseek_v4_fp4_indexer and config.index_head_dim % 32:
        raise ValueError(f"--enable-deepseek-v4-fp4-indexer needs index_head_dim ({config.index_head_dim}) to be "
                         f"a multiple of 32")
    return applied


def resolve_server_args(args: "ServerArgs", model: tuple = None) -> "ServerArgs":
    """Validate each option, fill platform and model defaults and validate them against the model; returns args
    (with `applied_defaults` and `platform_decisions` set). Raises ValueError naming the option. `model`: (config,
    stored formats) of a model known without its directory (the capacity planner's hub presets); by default read
    from --model-path."""
    args.validate()
    config, stored = model if model is not None else read_model(args)
    # Not fields: shown at start; the hook also sets args.platform_decisions (arg_groups/platform_defaults.py)
    args.applied_defaults = apply_deepseek_v4_defaults(args, config, stored)
    args.log_inert_flags()
    return args
