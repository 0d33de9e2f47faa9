"""ServerArgs: the engine's options under SGLang's flag names, parsing and the checks of each option on its own.

The model- and platform-dependent defaults and checks live in one hook (arg_groups/deepseek_v4_hook.py);
`resolve_server_args(args)` there runs `validate()` and then the hook. This module imports nothing of sglang but
sglang.srt.platform and the stdlib-only arg_groups/cli.py and arg_groups/upstream_recipes.py (the flags, their
choices and the upstream recipe flags), so every layer may import it. Only the options the engine implements, and
upstream recipe flags it maps or names as inert, are accepted; unknown flags are rejected by argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

from sglang.srt.arg_groups.cli import (ATTENTION_BACKENDS, DISAGGREGATION_MODES, DTYPES, EXPERT_RECORDER_MODES,
                                       GRAMMAR_BACKENDS, HICACHE_IO_BACKENDS, HICACHE_STORAGE_BACKENDS,
                                       HICACHE_STORAGE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES, KV_CACHE_DTYPES,
                                       LOG_LEVELS, MOE_PRECISIONS, QUANTIZATIONS, REASONING_PARSERS, TOOL_CALL_PARSERS,
                                       TRANSFER_BACKENDS, add_cli_args)

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
    mxfp4_moe_precision: str = "bf16"  # activations of the packed MXFP4 experts (W4A16); upstream's default = bf16
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
    max_prefill_tokens: int = 16384  # prompt tokens of one step over all requests (a lone request's chunk may exceed)
    enable_mixed_chunk: bool = True  # decode rows ride along prefill chunks (off: they wait while prompts prefill)
    grammar_backend: str = "xgrammar"  # constrained decoding (json_schema / regex / ebnf); none: refused
    schedule_conservativeness: float = 1.0  # scales the new-token ratio admission reserves for running requests
    max_queued_requests: Optional[int] = None  # beyond the running slots; more get 429 (None: no bound, as upstream)
    watchdog_timeout: float = 300.0  # seconds without a scheduler step, requests pending, before they fail (upstream's)
    # Kernels
    attention_backend: Optional[str] = None
    disable_cuda_graph: bool = False  # decode runs the general eager path (no static buffers, no graphs)
    cuda_graph_max_bs: Optional[int] = None  # largest captured decode batch (default: min(256, max running))
    cuda_graph_bs: Optional[list] = None  # captured batch sizes of decode steps or speculative cycles
    disable_overlap_schedule: bool = False  # read each decode step's tokens before launching the next
    skip_server_warmup: bool = False  # report ready without the warm-up prefills (managers/server_warmup.py)
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
    # Its host-memory tier (mem_cache/host_tier.py): size as a multiple of the device pool or in GB (wins when > 0)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    # ... and its file tier (mem_cache/file_tier.py): backend, its JSON settings, how a match's files are read
    hicache_storage_backend: Optional[str] = None
    hicache_storage_backend_extra_config: Optional[str] = None
    hicache_storage_prefetch_policy: str = "best_effort"
    # Serving
    # None: the DeepSeek-V4 default (deepseek-v4 / deepseekv4, set by the hook); "none": off (None once resolved)
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None  # admin endpoints: this key only; without it, loopback clients only
    weights_dir: Optional[str] = None  # /update_weights_from_disk loads under it; None: the checkpoint's parent dir
    allow_hub_weight_updates: bool = False  # /update_weights_from_disk may fetch hub ids
    max_request_body_mb: float = 64.0  # larger bodies get 413; refused from Content-Length or while streaming in
    enable_metrics: bool = False
    expert_distribution_recorder_mode: Optional[str] = None  # stat: count each layer's routed experts (eplb/)
    # Prefill/decode disaggregation (disaggregation/): this server's role, how the KV state travels, where the
    # prefill side's bootstrap server listens, the RDMA NICs (passed to the transfer engine)
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: Optional[str] = None
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
        path = self.model_path
        if (os.path.isabs(path) or path.startswith(".")) and not os.path.exists(path):
            raise ValueError(f"--model-path {path}: no such directory")  # a path, not a hub id: nothing to fetch
        if self.device is None:
            self.device = default_device()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS[1:]}, got {self.quantization!r}")
        if self.mxfp4_moe_precision == "fp8":
            raise ValueError("--mxfp4-moe-precision fp8 (W4A8) is not served: the W4A16 kernels measured faster at "
                             "every batch; use bf16")
        if self.mxfp4_moe_precision not in MOE_PRECISIONS:
            raise ValueError(f"--mxfp4-moe-precision must be one of {MOE_PRECISIONS}, got {self.mxfp4_moe_precision!r}")
        self.mxfp4_moe_precision = "bf16"  # upstream's `default` is bf16 activations too
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
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"--max-prefill-tokens must be positive, got {self.max_prefill_tokens}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"--grammar-backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be 0 or more, got {self.max_queued_requests}")
        if not 0 < self.watchdog_timeout < float("inf"):
            raise ValueError(f"--watchdog-timeout must be a positive number of seconds, got {self.watchdog_timeout}")
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
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.speculative_algorithm not in (None, "EAGLE", "NEXTN"):
            raise ValueError(f"--speculative-algorithm must be EAGLE or NEXTN, got {self.speculative_algorithm!r}")
        if self.admin_api_key is not None and (not self.admin_api_key or self.admin_api_key == self.api_key):
            raise ValueError("--admin-api-key must be a non-empty key other than --api-key (the API key must not "
                             "grant admin)")
        if self.weights_dir is not None and not os.path.isdir(self.weights_dir):
            raise ValueError(f"--weights-dir {self.weights_dir}: no such directory")
        if not 0 < self.max_request_body_mb < float("inf"):
            raise ValueError(f"--max-request-body-mb must be a positive number, got {self.max_request_body_mb}")
        if self.expert_distribution_recorder_mode not in (None, *EXPERT_RECORDER_MODES):
            raise ValueError(f"--expert-distribution-recorder-mode must be stat (counts per layer and expert), got "
                             f"{self.expert_distribution_recorder_mode!r}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {DISAGGREGATION_MODES}, got "
                             f"{self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {TRANSFER_BACKENDS}, got "
                             f"{self.disaggregation_transfer_backend!r}")
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(f"--disaggregation-bootstrap-port must be a port in [1, 65535], got "
                             f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_mode != "null" and self.enable_dp_attention:
            raise ValueError(f"--disaggregation-mode {self.disaggregation_mode} runs tensor-parallel attention only: "
                             f"drop --enable-dp-attention (each DP group holds its own requests' KV, and a room "
                             f"would need to name its group); --tp-size and --nnodes are supported")
        if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
            raise ValueError(f"--disaggregation-bootstrap-port {self.port} is the HTTP --port; give it another")
        self._validate_hicache()
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        return self

    def _validate_hicache(self) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {HICACHE_WRITE_POLICIES}, got "
                             f"{self.hicache_write_policy!r}")
        if self.hicache_io_backend not in HICACHE_IO_BACKENDS:
            raise ValueError(f"--hicache-io-backend must be one of {HICACHE_IO_BACKENDS}, got "
                             f"{self.hicache_io_backend!r}")
        if not 0 < self.hicache_ratio < float("inf"):
            raise ValueError(f"--hicache-ratio must be a positive number, got {self.hicache_ratio}")
        if not 0 <= self.hicache_size < float("inf"):
            raise ValueError(f"--hicache-size must be 0 (use --hicache-ratio) or a positive number of GB, got "
                             f"{self.hicache_size}")
        if self.hicache_storage_backend is not None:
            self._validate_hicache_storage()
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache puts a host tier under the prefix cache: it cannot be "
                             "combined with --disable-radix-cache")

    def _validate_hicache_storage(self) -> None:
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ValueError(f"--hicache-storage-backend must be one of {HICACHE_STORAGE_BACKENDS}, got "
                             f"{self.hicache_storage_backend!r}")
        if self.hicache_storage_prefetch_policy not in HICACHE_STORAGE_PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of {HICACHE_STORAGE_PREFETCH_POLICIES}, "
                             f"got {self.hicache_storage_prefetch_policy!r}")
        if not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend is a tier below the host tier: it needs "
                             "--enable-hierarchical-cache")
        self.file_tier_config()  # the extra config's errors, at start

    def file_tier_config(self):
        """The file tier's settings (mem_cache.file_tier.FileTierConfig) from the extra config and the environment."""
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.file_tier import FileTierConfig

        return FileTierConfig.parse(self.hicache_storage_backend_extra_config,
                                    envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get())

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
        """Every flag, in --help groups (arg_groups/cli.py), as upstream's ServerArgs.add_cli_args."""
        add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
