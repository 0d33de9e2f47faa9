"""The command line of `python -m sglang.launch_server`: the flags in --help groups, a short usage line, and errors of
one line. Each flag's help states its default. The choice lists here are the ones ServerArgs.validate() checks (it
imports them: stdlib only, so server_args.py stays importable from every layer).
"""

from __future__ import annotations

import argparse
import sys

from sglang.srt.arg_groups.upstream_recipes import add_recipe_args

PROG = "python -m sglang.launch_server"
ATTENTION_BACKENDS = ("torch", "triton", "dsv4")
QUANTIZATIONS = (None, "fp8", "mxfp4", "none")
# Activations of the packed MXFP4 experts: bf16 (W4A16); `default` is upstream's name for the same. fp8 (W4A8) is
# refused at validation: the W4A16 kernels measured faster at every batch.
MOE_PRECISIONS = ("bf16", "default")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("xgrammar", "none")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EXPERT_RECORDER_MODES = ("stat",)  # upstream also has per_pass, per_token, stat_approx: not built
REASONING_PARSERS = ("deepseek-v4", "none")
TOOL_CALL_PARSERS = ("deepseekv4", "none")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_IO_BACKENDS = ("direct", "kernel")
HICACHE_STORAGE_BACKENDS = ("file",)
HICACHE_STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def one_line(message: str) -> str:
    """A message on one line (hub and config errors can span several)."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already says what the default is (options whose default is decided at
    start, such as --page-size, state it in words); a switch's default reads "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """argparse with an error of one line and exit status 2, instead of the usage block with the error below it."""

    def error(self, message: str):
        self.exit(2, f"error: {one_line(message)} ({self.prog} --help lists the options)\n")


def fail(message) -> None:
    """A bad value found after parsing (ServerArgs validation, the model): one line on stderr, exit status 2."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog=PROG, usage="%(prog)s --model-path PATH [options]", formatter_class=HelpFormatter,
                       description="Serve a DeepSeek-V4 model over an OpenAI-compatible API (/v1/chat/completions, "
                                   "/v1/completions, /v1/responses) and SGLang's native /generate.")
    add_cli_args(parser)
    return parser


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerArgs flag, in --help groups: model and loading, HTTP / API, scheduling and memory, parallelism,
    speculative decoding, kernels and backends, observability, then the upstream recipe flags."""
    _model_args(parser.add_argument_group("model and loading"))
    _api_args(parser.add_argument_group("HTTP / API"))
    _scheduling_args(parser.add_argument_group("scheduling and memory"))
    _hicache_args(parser.add_argument_group(
        "hierarchical cache", "a host-memory tier under the prefix cache: prefixes the device pool evicts move to "
                              "host memory and come back on a hit (docs/prefix-cache.md)"))
    _parallel_args(parser.add_argument_group("parallelism"))
    _speculative_args(parser.add_argument_group(
        "speculative decoding", "EAGLE-style drafting with the checkpoint's own MTP (NextN) layer, top-k 1"))
    _disaggregation_args(parser.add_argument_group(
        "prefill/decode disaggregation", "a prefill server and a decode server behind sglang-router in its PD mode "
                                         "(python -m sglang_router.launch_router --pd-disaggregation --prefill URL "
                                         "BOOTSTRAP_PORT --decode URL)"))
    _kernel_args(parser.add_argument_group("kernels and backends"))
    _observability_args(parser.add_argument_group(
        "observability", "logging, metrics and expert distribution; profiling is driven by the /start_profile and "
                         "/stop_profile endpoints (traces in SGLANG_TORCH_PROFILER_DIR)"))
    add_recipe_args(parser)


def _model_args(g) -> None:
    g.add_argument("--model-path", required=True, metavar="PATH",
                   help="checkpoint directory, HF hub id, or 'tiny-deepseek-v4' (the built-in tiny model, random "
                        "weights, generated on first use); required")
    g.add_argument("--tokenizer-path", metavar="DIR",
                   help="directory with tokenizer.json (default: the model's directory; without one, prompts must be "
                        "token ids)")
    g.add_argument("--served-model-name", metavar="NAME", help="model id in the OpenAI API (default: --model-path)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for SGLang compatibility and not needed: DeepSeek-V4 is implemented here, no code "
                        "from the checkpoint is run (logged when given)")
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available (ROCm too), else cpu")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype; auto = bfloat16 on a GPU, float32 on CPU")
    g.add_argument("--quantization", choices=QUANTIZATIONS[1:],
                   help="weight formats kept on a GPU: fp8 = the checkpoint's FP8 linears stay FP8 and its MXFP4 "
                        "experts packed; mxfp4 = only MXFP4 experts stay packed; none = every weight dequantized at "
                        "load; a format the checkpoint does not store is refused (default: detected from the "
                        "checkpoint; on CPU every weight is dequantized at load)")
    g.add_argument("--context-length", metavar="N", type=int,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--random-seed", metavar="N", type=int, default=42,
                   help="seed of torch's generator in the model process, the same on every rank")


def _api_args(g) -> None:
    g.add_argument("--host", metavar="HOST", default="127.0.0.1", help="address the HTTP server binds")
    g.add_argument("--port", metavar="PORT", type=int, default=30000,
                   help="port the HTTP server binds, checked before the model loads")
    g.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer <key>' on every endpoint but /health (default: none)")
    g.add_argument("--admin-api-key", metavar="KEY",
                   help="the key of the admin endpoints (weight updates and inspection, profiling, cache flush, "
                        "expert records, /abort_request with abort_all): 'Authorization: Bearer <key>'; --api-key "
                        "does not grant them (default: none: admin endpoints answer loopback clients only)")
    g.add_argument("--weights-dir", metavar="DIR",
                   help="directory /update_weights_from_disk may load checkpoints from, symlinks resolved (default: "
                        "the served checkpoint's parent directory)")
    g.add_argument("--allow-hub-weight-updates", action="store_true",
                   help="let /update_weights_from_disk fetch hub ids (default: off: local directories only)")
    g.add_argument("--max-request-body-mb", metavar="MIB", type=float, default=64.0,
                   help="largest request body accepted, in MiB; a larger one is refused with 413")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split thinking-mode output into reasoning_content and content; none: the reasoning stays "
                        "in content (default: deepseek-v4)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="turn DSML tool-call blocks into tool_calls, and allow tool_choice \"required\" / a named "
                        "function; none: tool calls stay text in content (default: deepseekv4)")
    g.add_argument("--grammar-backend", default="xgrammar", choices=GRAMMAR_BACKENDS,
                   help="constrained decoding of response_format (json_object, json_schema), forced tool_choice and "
                        "the json_schema / regex / ebnf request fields (none: such requests are refused)")


def _scheduling_args(g) -> None:
    g.add_argument("--mem-fraction-static", metavar="F", type=float,
                   help="share of device memory for weights and KV pools on a GPU, of free memory for the pools on "
                        "CPU (default: 0.85 GPU, 0.25 CPU)")
    g.add_argument("--max-running-requests", metavar="N", type=int, help="requests decoded at once (default: 256)")
    g.add_argument("--max-total-tokens", metavar="N", type=int,
                   help="cap on the KV pool's tokens (default: as many as --mem-fraction-static allows)")
    g.add_argument("--page-size", metavar="N", type=int,
                   help="tokens per KV page, a multiple of every compress ratio and the sliding window (default: 256)")
    g.add_argument("--swa-full-tokens-ratio", metavar="F", type=float, default=0.1,
                   help="sliding-window KV slots per full-pool token, in (0, 1]; never fewer than the running "
                        "requests' windows and one prefill chunk need")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage; auto = the compute dtype, fp8_e4m3 also quantizes the indexer keys")
    g.add_argument("--enable-deepseek-v4-fp4-indexer", action="store_true",
                   help="store the lightning indexer's keys in FP4")
    g.add_argument("--chunked-prefill-size", metavar="N", type=int,
                   help="prompt tokens per prefill chunk, -1 for no chunking (default: 8192 GPU, 1024 CPU)")
    g.add_argument("--max-prefill-tokens", metavar="N", type=int, default=16384,
                   help="prompt tokens one step prefills over all its requests; the first request's chunk alone "
                        "may be longer, up to --chunked-prefill-size")
    g.add_argument("--enable-mixed-chunk", dest="enable_mixed_chunk", action="store_true", default=True,
                   help="decode rows join the steps that prefill chunks (the default here; upstream's is off)")
    g.add_argument("--disable-mixed-chunk", dest="enable_mixed_chunk", action="store_false",
                   help="while prompts prefill, steps carry only prefill chunks and running requests wait "
                        "(upstream's default)")
    g.add_argument("--max-queued-requests", metavar="N", type=int,
                   help="requests that may wait beyond the running ones (--max-running-requests); more are refused "
                        "with 429 and Retry-After (default: no bound)")
    g.add_argument("--watchdog-timeout", metavar="SECONDS", type=float, default=300.0,
                   help="when the scheduler completes no step for this long while requests await it, they fail with "
                        "503 and /health answers 503 until a step completes")
    g.add_argument("--schedule-conservativeness", metavar="F", type=float, default=1.0,
                   help="how much of their remaining max_new_tokens admission expects running requests to use "
                        "(x 0.7 at start, decaying; larger admits fewer, smaller risks more retractions)")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="do not reuse cached prompt prefixes across requests (default: reuse them, with speculative "
                        "decoding too)")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each decode step's tokens before launching the next (default: plain decode steps "
                        "within the CUDA-graph sizes launch the next step first, so the host's bookkeeping overlaps "
                        "the device; never with speculative decoding, DP attention, penalties or a grammar)")
    g.add_argument("--skip-server-warmup", action="store_true",
                   help="report ready without the warm-up prefills that compile every prefill kernel variant first "
                        "(default: they run on CUDA and ROCm, so no user's request waits for a compile)")


def _parallel_args(g) -> None:
    g.add_argument("--tp", "--tp-size", metavar="N", dest="tp_size", type=int, default=1,
                   help="tensor-parallel ranks, one model process each")
    g.add_argument("--ep", "--ep-size", metavar="N", dest="ep_size", type=int, default=1,
                   help="expert-parallel ranks among the --tp ranks: routed experts split over them")
    g.add_argument("--dp", "--dp-size", metavar="N", dest="dp_size", type=int, default=1,
                   help="data-parallel attention groups, with --enable-dp-attention")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="attention data-parallel over --dp groups, the MoE over all --tp ranks")
    g.add_argument("--nnodes", metavar="N", type=int, default=1,
                   help="nodes of one model instance: each runs --tp-size / --nnodes ranks; node 0 serves HTTP")
    g.add_argument("--node-rank", metavar="N", type=int, default=0,
                   help="this node's rank: 0 serves HTTP, the others run their ranks headless")
    g.add_argument("--dist-init-addr", metavar="HOST:PORT",
                   help="host:port where the ranks meet (default: 127.0.0.1 and a free port; needed with --nnodes > "
                        "1); with DP attention over several nodes, node 0 also takes the other nodes' DP groups' "
                        "outputs on port + 1")
    g.add_argument("--dist-timeout", metavar="SECONDS", type=float, default=300.0,
                   help="seconds a collective waits for a dead or hung rank before the server exits")


def _speculative_args(g) -> None:
    g.add_argument("--speculative-algorithm", choices=("EAGLE", "NEXTN"),
                   help="draft with the checkpoint's MTP layer (NEXTN is an alias of EAGLE; default: off)")
    g.add_argument("--speculative-num-steps", metavar="N", type=int,
                   help="tokens drafted ahead per cycle, 1 to 8 (default: 3 with --speculative-algorithm)")
    g.add_argument("--speculative-eagle-topk", metavar="K", type=int,
                   help="draft branches; only 1 is supported (default: 1)")
    g.add_argument("--speculative-num-draft-tokens", metavar="N", type=int,
                   help="must equal --speculative-num-steps + 1 (default: that)")


def _hicache_args(g) -> None:
    g.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep cached prefixes the device pool evicts in host memory (pinned on CUDA) and load them "
                        "back on a hit")
    g.add_argument("--hicache-ratio", metavar="F", type=float, default=2.0,
                   help="host tier size as a multiple of the device pool's pages and prefix ends")
    g.add_argument("--hicache-size", metavar="GB", type=float, default=0,
                   help="host tier size in GB (2^30 bytes); wins over --hicache-ratio when > 0")
    g.add_argument("--hicache-write-policy", default="write_through", choices=HICACHE_WRITE_POLICIES,
                   help="when a cached prefix is copied to the host: write_back when the device evicts it, "
                        "write_through when it is cached, write_through_selective once it has been hit twice")
    g.add_argument("--hicache-io-backend", default="kernel", choices=HICACHE_IO_BACKENDS,
                   help="how rows move between the tiers: kernel = one indexed gather, transfer and scatter per "
                        "buffer; direct = one copy per page")
    g.add_argument("--hicache-storage-backend", choices=HICACHE_STORAGE_BACKENDS,
                   help="a tier below the host: file = a directory (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, or "
                        "storage_dir in --hicache-storage-backend-extra-config) that outlives the server "
                        "(default: none)")
    g.add_argument("--hicache-storage-backend-extra-config", metavar="JSON",
                   help='file backend: {"storage_dir": DIR, "max_size_gb": 64, "prefetch_timeout_base": 1.0} '
                        '(default: none: those values)')
    g.add_argument("--hicache-storage-prefetch-policy", default="best_effort",
                   choices=HICACHE_STORAGE_PREFETCH_POLICIES,
                   help="a waiting request's files are read in the background; it is admitted: best_effort = "
                        "whenever the scheduler would anyway, with what landed (room only from host copies the device "
                        "also holds); wait_complete = once its reads landed (evicting host copies to read it all); "
                        "timeout = as wait_complete, no later than prefetch_timeout_base seconds after queueing")


def _disaggregation_args(g) -> None:
    g.add_argument("--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES,
                   help="null: this server prefills and decodes; prefill: it prefills, samples the first token and "
                        "writes the request's KV state into a decode server's memory; decode: it receives that "
                        "state and decodes on (requests must carry the router's bootstrap_host and bootstrap_room)")
    g.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=TRANSFER_BACKENDS,
                   help="engine that moves the KV state: mooncake (pip install mooncake-transfer-engine, or "
                        "mooncake-transfer-engine-non-cuda without CUDA; TCP, or RDMA with "
                        "--disaggregation-ib-device) or nixl (pip install nixl; CUDA machines)")
    g.add_argument("--disaggregation-bootstrap-port", metavar="PORT", type=int, default=8998,
                   help="port of the prefill server's bootstrap server, where decode servers register rooms; give "
                        "the same port to the router after the prefill URL")
    g.add_argument("--disaggregation-ib-device", metavar="DEVICES",
                   help="RDMA NICs the transfer engine uses, comma-separated (e.g. mlx5_0,mlx5_1), passed through "
                        "to it (default: none: TCP)")


def _kernel_args(g) -> None:
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="dsv4 = the best available: triton on a GPU, torch on CPU (default: dsv4; "
                        "SGLANG_HACK_FLASHMLA_BACKEND overrides its choice)")
    g.add_argument("--mxfp4-moe-precision", "--flashinfer-mxfp4-moe-precision", default="bf16",
                   metavar="{bf16,default}",
                   help="activations of the MXFP4 routed experts kept packed on a GPU: bf16 = W4A16, as upstream's "
                        "'default'; fp8 (W4A8) is refused: the W4A16 kernels measured faster at every batch "
                        "(default: bf16)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode without CUDA graphs or static buffers: every step (and speculative cycle) runs "
                        "eagerly")
    g.add_argument("--cuda-graph-max-bs", metavar="N", type=int,
                   help="largest decode batch (or greedy speculative cycle) run as a CUDA graph; larger batches run "
                        "eagerly (default: min(256, --max-running-requests))")
    g.add_argument("--cuda-graph-bs", metavar="N", type=int, nargs="+",
                   help="batch sizes to capture, of decode steps or speculative cycles (default: 1 2 4 8 12 16 24 "
                        "... up to --cuda-graph-max-bs)")
    g.add_argument("--enforce-shared-experts-fusion", action="store_true",
                   help="run the shared expert as one more routed expert, with --tp 1 (default: on for ROCm only)")
    g.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="run the shared expert separately (exclusive with --enforce-shared-experts-fusion; "
                        "default: off, fusion is on for ROCm only)")


def _observability_args(g) -> None:
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="log level of every process (HTTP server, scheduler ranks)")
    g.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    g.add_argument("--expert-distribution-recorder-mode", choices=EXPERT_RECORDER_MODES,
                   help="stat: count the tokens each routed expert of each MoE layer gets, between "
                        "/start_expert_distribution_record and /stop_expert_distribution_record; "
                        "/dump_expert_distribution_record writes them (one index_add per MoE layer and step; "
                        "default: off)")
