"""ServerArgs: the engine's options under SGLang's flag names, parsing and the checks of each option on its own.

The model- and platform-dependent defaults and checks live in one hook (arg_groups/deepseek_v4_hook.py);
`resolve_server_args(args)` there runs `validate()` and then the hook. This module imports nothing of sglang but
sglang.srt.platform and the stdlib-only arg_groups/upstream_recipes (lazily), so every layer may import it. Only the
options the engine implements, and upstream recipe flags it maps or names as inert, are accepted; unknown flags are
rejected by argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

ATTENTION_BACKENDS = ("torch", "triton", "dsv4")
QUANTIZATIONS = (None, "fp8", "mxfp4", "none")
MOE_PRECISIONS = ("bf16", "fp8")  # activations of the packed MXFP4 experts: W4A16 / W4A8
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("xgrammar", "none")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EXPERT_RECORDER_MODES = ("stat",)  # upstream also has per_pass, per_token, stat_approx: not built

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    model_path: str
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    trust_remote_code: bool = False  # accepted, not needed (logged)
    device: Optional[str] = None  # None: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    quantization: Optional[str] = None  # None: detected; fp8 / mxfp4: stored formats stay quantized on a GPU
    mxfp4_moe_precision: str = "bf16"  # fp8: the packed MXFP4 experts take FP8 activations (W4A8, sm90+)
    context_length: Optional[int] = None  # None: the model's max_position_embeddings
    # Memory pool
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    page_size: Optional[int] = None
    swa_full_tokens_ratio: float = 0.1
    kv_cache_dtype: str = "auto"
    enable_deepseek_v4_fp4_indexer: bool = False
    # Scheduling
    chunked_prefill_size: Optional[int] = None
    grammar_backend: str = "xgrammar"  # constrained decoding (json_schema / regex / ebnf); none: refused
    schedule_conservativeness: float = 1.0  # scales the new-token ratio admission reserves for running requests
    # Kernels
    attention_backend: Optional[str] = None
    disable_cuda_graph: bool = False  # decode runs the general eager path (no static buffers, no graphs)
    cuda_graph_max_bs: Optional[int] = None  # largest captured decode batch (default: min(256, max running))
    cuda_graph_bs: Optional[list] = None  # captured batch sizes of decode steps or speculative cycles
    disable_overlap_schedule: bool = False  # read each decode step's tokens before launching the next
    # Shared expert run as routed expert E (weight 1 for every token); default: on for ROCm, off elsewhere
    enforce_shared_experts_fusion: bool = False
    disable_shared_experts_fusion: bool = False
    # Speculative decoding with the checkpoint's MTP (NextN) layer, EAGLE-style with top-k 1
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    # Parallelism: tensor-parallel ranks (heads, vocabulary, experts' intermediate dims), expert-parallel
    # ranks (routed experts) among them; DP attention: attention data-parallel over dp groups, the MoE over all ranks
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    dist_timeout: float = 300.0  # seconds a collective may wait for a dead or hung rank before the server exits
    # Prefix cache (radix tree over the pools)
    disable_radix_cache: bool = False
    # Serving
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    api_key: Optional[str] = None
    max_request_body_mb: float = 64.0  # larger bodies get 413; refused from Content-Length or while streaming in
    enable_metrics: bool = False
    expert_distribution_recorder_mode: Optional[str] = None  # stat: count each layer's routed experts (eplb/)
    # Misc
    random_seed: int = 42
    log_level: str = "info"
    host: str = "127.0.0.1"
    port: int = 30000
    # Upstream recipe flags (arg_groups/upstream_recipes.py): mapped to what serves them here, or logged as inert
    moe_runner_backend: str = "auto"
    moe_a2a_backend: str = "none"  # any other value: --ep = --tp, as upstream
    deepep_mode: str = "auto"
    deepep_config: Optional[str] = None
    disable_flashinfer_autotune: bool = False
    cuda_graph_max_bs_decode: Optional[int] = None  # = cuda_graph_max_bs (only decode is captured)
    tokenizer_worker_num: int = 1
    enable_prefill_delayer: bool = False
    prefill_delayer_max_delay_ms: Optional[float] = None
    enable_two_batch_overlap: bool = False
    speculative_draft_model_path: Optional[str] = None
    speculative_attention_mode: str = "prefill"
    speculative_draft_attention_backend: Optional[str] = None
    enable_w4a4_mxfp4_megamoe: bool = False

    def validate(self) -> "ServerArgs":
        """Check each option on its own and fill the device and dtype defaults; returns self. Raises ValueError
        naming the option. Called by arg_groups.deepseek_v4_hook.resolve_server_args before the hook."""
        from sglang.srt.arg_groups.upstream_recipes import apply_recipe_args
        from sglang.srt.platform import default_device

        self.recipe_notes = apply_recipe_args(self)  # first: it may set --ep and --cuda-graph-max-bs
        if self.device is None:
            self.device = default_device()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS[1:]}, got {self.quantization!r}")
        if self.mxfp4_moe_precision not in MOE_PRECISIONS:
            raise ValueError(f"--mxfp4-moe-precision must be one of {MOE_PRECISIONS}, got {self.mxfp4_moe_precision!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        for name in ("max_running_requests", "max_total_tokens", "page_size", "context_length", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) <= 0):
            raise ValueError(f"--cuda-graph-bs must list positive batch sizes, got {self.cuda_graph_bs}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"--grammar-backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        if not 0 < self.schedule_conservativeness < float("inf"):
            raise ValueError(f"--schedule-conservativeness must be a positive number, got "
                             f"{self.schedule_conservativeness}")
        for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(f"--dp-size {self.dp_size} needs --enable-dp-attention (data parallelism is over the "
                             f"attention of one model instance)")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ValueError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} (ranks per node)")
            if not self.dist_init_addr:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, where the ranks "
                                 "of every node meet)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be positive, got {self.dist_timeout}")
        if self.reasoning_parser not in (None, "deepseek-v4"):
            raise ValueError(f"--reasoning-parser must be deepseek-v4, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, "deepseekv4"):
            raise ValueError(f"--tool-call-parser must be deepseekv4, got {self.tool_call_parser!r}")
        if self.speculative_algorithm not in (None, "EAGLE", "NEXTN"):
            raise ValueError(f"--speculative-algorithm must be EAGLE or NEXTN, got {self.speculative_algorithm!r}")
        if not 0 < self.max_request_body_mb < float("inf"):
            raise ValueError(f"--max-request-body-mb must be a positive number, got {self.max_request_body_mb}")
        if self.expert_distribution_recorder_mode not in (None, *EXPERT_RECORDER_MODES):
            raise ValueError(f"--expert-distribution-recorder-mode must be stat (counts per layer and expert), got "
                             f"{self.expert_distribution_recorder_mode!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        return self

    def parallel_config(self):
        from sglang.srt.distributed.sharding import ParallelConfig

        return ParallelConfig(self.tp_size, self.ep_size, self.dp_size, self.enable_dp_attention)

    def log_inert_flags(self) -> None:
        """Flags SGLang users pass out of habit that change nothing here: accepted, and said so."""
        if self.trust_remote_code:
            logger.warning("--trust-remote-code is not needed: DeepSeek-V4 is implemented natively, no code from "
                           "the checkpoint is run")
        for line in getattr(self, "recipe_notes", []):
            logger.warning(line)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        p = parser
        p.add_argument("--model-path", required=True,
                       help="checkpoint directory, HF hub id, or 'tiny-deepseek-v4' (the built-in tiny model)")
        p.add_argument("--tokenizer-path", help="directory with tokenizer.json (default: the model's directory)")
        p.add_argument("--served-model-name", help="model id in the OpenAI API (default: --model-path)")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for SGLang compatibility and not needed: DeepSeek-V4 is implemented here, no "
                            "code from the checkpoint is run (logged when given)")
        p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
        p.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="compute dtype; auto = bfloat16 on a GPU, float32 on CPU")
        p.add_argument("--quantization", choices=QUANTIZATIONS[1:],
                       help="weight formats kept on a GPU: fp8 = the checkpoint's FP8 linears stay FP8 and its MXFP4 "
                            "experts packed; mxfp4 = only MXFP4 experts stay packed; none = every weight dequantized "
                            "at load (default: detected from the checkpoint)")
        p.add_argument("--mxfp4-moe-precision", "--flashinfer-mxfp4-moe-precision", default="bf16",
                       choices=MOE_PRECISIONS,
                       help="activations of the MXFP4 routed experts kept packed on an NVIDIA sm90+ GPU: bf16 (W4A16) "
                            "or fp8 (W4A8: DeepSeek's reference function, activations quantized per token and 128 "
                            "inputs; hidden and MoE intermediate sizes multiples of 256; 1.4-1.9x slower than bf16 "
                            "on an H200)")
        p.add_argument("--context-length", type=int,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
        p.add_argument("--mem-fraction-static", type=float,
                       help="share of device memory for weights and KV pools on a GPU, of free memory for the "
                            "pools on CPU (default: 0.85 GPU, 0.25 CPU)")
        p.add_argument("--max-running-requests", type=int, help="requests decoded at once (default: 256)")
        p.add_argument("--max-total-tokens", type=int,
                       help="cap on the KV pool's tokens (default: as many as --mem-fraction-static allows)")
        p.add_argument("--page-size", type=int,
                       help="tokens per KV page, a multiple of every compress ratio and the sliding window "
                            "(default: 256)")
        p.add_argument("--swa-full-tokens-ratio", type=float, default=0.1,
                       help="sliding-window KV slots per full-pool token, in (0, 1]")
        p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache storage; auto = the compute dtype, fp8_e4m3 also quantizes the indexer keys")
        p.add_argument("--enable-deepseek-v4-fp4-indexer", action="store_true",
                       help="store the lightning indexer's keys in FP4")
        p.add_argument("--chunked-prefill-size", type=int,
                       help="prompt tokens per prefill chunk, -1 for no chunking (default: 8192 GPU, 1024 CPU)")
        p.add_argument("--grammar-backend", default="xgrammar", choices=GRAMMAR_BACKENDS,
                       help="constrained decoding of json_schema / regex / ebnf requests and response_format "
                            "(none: such requests are refused)")
        p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                       help="how much of their remaining max_new_tokens admission expects running requests to use "
                            "(x 0.7 at start, decaying; larger admits fewer, smaller risks more retractions)")
        p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                       help="dsv4 = the best available: triton on a GPU, torch on CPU (default: dsv4)")
        p.add_argument("--disable-cuda-graph", action="store_true",
                       help="decode without CUDA graphs or static buffers: every step (and speculative cycle) runs "
                            "eagerly")
        p.add_argument("--disable-overlap-schedule", action="store_true",
                       help="wait for each decode step's tokens before launching the next (default: the next step is "
                            "launched first, so the host's bookkeeping overlaps the device)")
        p.add_argument("--cuda-graph-max-bs", type=int,
                       help="largest decode batch (or greedy speculative cycle) run as a CUDA graph; larger batches "
                            "run eagerly "
                            "(default: min(256, --max-running-requests))")
        p.add_argument("--cuda-graph-bs", type=int, nargs="+",
                       help="batch sizes to capture, of decode steps or speculative cycles (default: 1 2 4 8 12 16 24 "
                            "... up to --cuda-graph-max-bs)")
        p.add_argument("--enforce-shared-experts-fusion", action="store_true",
                       help="run the shared expert as one more routed expert (default: on for ROCm only)")
        p.add_argument("--disable-shared-experts-fusion", action="store_true",
                       help="run the shared expert separately (exclusive with --enforce-shared-experts-fusion)")
        p.add_argument("--speculative-algorithm", choices=("EAGLE", "NEXTN"),
                       help="draft with the checkpoint's MTP layer (NEXTN is an alias of EAGLE; default: off)")
        p.add_argument("--speculative-num-steps", type=int,
                       help="tokens drafted ahead per cycle, 1 to 8 (default: 3 with --speculative-algorithm)")
        p.add_argument("--speculative-eagle-topk", type=int, help="draft branches; only 1 is supported (default: 1)")
        p.add_argument("--speculative-num-draft-tokens", type=int,
                       help="must equal --speculative-num-steps + 1 (default: that)")
        p.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=1,
                       help="tensor-parallel ranks, one model process each (default: 1)")
        p.add_argument("--ep", "--ep-size", dest="ep_size", type=int, default=1,
                       help="expert-parallel ranks among the --tp ranks: routed experts split over them (default: 1)")
        p.add_argument("--dp", "--dp-size", dest="dp_size", type=int, default=1,
                       help="data-parallel attention groups, with --enable-dp-attention (default: 1)")
        p.add_argument("--enable-dp-attention", action="store_true",
                       help="attention data-parallel over --dp groups, the MoE over all --tp ranks (default: off)")
        p.add_argument("--nnodes", type=int, default=1,
                       help="nodes of one model instance: each runs --tp-size / --nnodes ranks; node 0 serves HTTP "
                            "(default: 1)")
        p.add_argument("--node-rank", type=int, default=0,
                       help="this node's rank: 0 serves HTTP, the others run their ranks headless (default: 0)")
        p.add_argument("--dist-init-addr",
                       help="host:port where the ranks meet (default: 127.0.0.1 and a free port); with DP attention "
                            "over several nodes, node 0 also takes the other nodes' DP groups' outputs on port + 1")
        p.add_argument("--dist-timeout", type=float, default=300.0,
                       help="seconds a collective waits for a dead or hung rank before the server exits "
                            "(default: 300)")
        p.add_argument("--disable-radix-cache", action="store_true",
                       help="do not reuse cached prompt prefixes across requests (default: reuse them; off with "
                            "--speculative-algorithm for now)")
        p.add_argument("--reasoning-parser", choices=("deepseek-v4",),
                       help="split thinking into reasoning_content (default: off)")
        p.add_argument("--tool-call-parser", choices=("deepseekv4",),
                       help="turn DSML tool-call blocks into tool_calls (default: off)")
        p.add_argument("--api-key",
                       help="require 'Authorization: Bearer <key>' on every endpoint but /health (default: none)")
        p.add_argument("--max-request-body-mb", type=float, default=64.0,
                       help="largest request body accepted, in MiB; a larger one is refused with 413")
        p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
        p.add_argument("--expert-distribution-recorder-mode", choices=EXPERT_RECORDER_MODES,
                       help="stat: count the tokens each routed expert of each MoE layer gets, between "
                            "/start_expert_distribution_record and /stop_expert_distribution_record (one index_add "
                            "per MoE layer and step; default: off)")
        p.add_argument("--random-seed", type=int, default=42, help="seed of torch's generator in the model process")
        p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level of every process")
        p.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds")
        p.add_argument("--port", type=int, default=30000, help="port the HTTP server binds (checked before loading)")
        from sglang.srt.arg_groups.upstream_recipes import add_recipe_args

        add_recipe_args(p)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
