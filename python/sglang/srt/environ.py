"""Every SGLANG_* environment variable the engine reads, typed, with its default and meaning.

Read them only here (`envs.NAME.get()`); tests use `envs.NAME.override(value)`. Prefer a ServerArgs flag over a
new variable. A test fails if `os.environ` / `os.getenv` appears elsewhere under python/sglang.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _tristate(text: str):
    """'auto' (or empty) -> None: the platform decides; otherwise a boolean."""
    return None if text.strip().lower() in ("auto", "") else _bool(text)


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise ValueError("must be greater than 0")
        return value

    return parse


def _non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise ValueError("must be 0 or more")
        return value

    return parse


def _choice(*allowed: str, aliases: dict = None) -> Callable[[str], str]:
    aliases = aliases or {}

    def parse(text: str) -> str:
        value = text.strip().lower()
        value = aliases.get(value, value)
        if value not in allowed:
            raise ValueError(f"must be one of {'|'.join(allowed + tuple(aliases))}")
        return value

    return parse


@dataclass
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {e}") from None

    def is_set(self) -> bool:
        return self.name in os.environ

    @contextmanager
    def override(self, value):
        old = os.environ.get(self.name)
        os.environ[self.name] = str(value)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = old

    def __bool__(self) -> bool:  # catch `if envs.X:` (always true) instead of `if envs.X.get():`
        raise TypeError(f"use envs.{self.name}.get() to read {self.name}")


class Envs:
    # Built-in model and caches
    SGLANG_CACHE_DIR = EnvVar("SGLANG_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sglang"),
                              str, "where the built-in tiny model and other generated files are kept")
    SGLANG_CPU_NUM_THREADS = EnvVar("SGLANG_CPU_NUM_THREADS", 1, int,
                                    "torch intra-op threads when running on CPU (1: OpenMP fork-join costs more "
                                    "than it saves on the small shapes the CPU path runs)")
    # Expert distribution records (/dump_expert_distribution_record; eplb/expert_distribution.py), upstream's name
    SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR = EnvVar("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", "/tmp", str,
                                                     "where /dump_expert_distribution_record writes its files")
    # Profiling (/start_profile, Engine.start_profile; managers/scheduler_profiler.py), upstream's names
    SGLANG_TORCH_PROFILER_DIR = EnvVar("SGLANG_TORCH_PROFILER_DIR", "/tmp", str,
                                       "where /start_profile writes traces when the request names no output_dir "
                                       "(sglang.bench_serving --profile reads it too)")
    SGLANG_PROFILE_WITH_STACK = EnvVar("SGLANG_PROFILE_WITH_STACK", True, _bool,
                                       "profiles record Python stacks unless the request says otherwise")
    SGLANG_PROFILE_RECORD_SHAPES = EnvVar("SGLANG_PROFILE_RECORD_SHAPES", True, _bool,
                                          "profiles record operator input shapes unless the request says otherwise")
    # Chat encoding (serving issue); declared here so there is one place to look
    SGLANG_DEFAULT_THINKING = EnvVar("SGLANG_DEFAULT_THINKING", False, _bool,
                                     "default of chat_template_kwargs.thinking for DeepSeek-V4 chats")
    SGLANG_DSV4_REASONING_EFFORT = EnvVar("SGLANG_DSV4_REASONING_EFFORT", "", str,
                                          "reasoning_effort used when a DeepSeek-V4 thinking request gives none "
                                          "(minimal|low|medium|high|max; empty: the encoder's default tier)")
    SGLANG_FORWARD_UNKNOWN_TOOLS = EnvVar("SGLANG_FORWARD_UNKNOWN_TOOLS", False, _bool,
                                          "a DSML call to a tool the request did not offer comes back as a tool call "
                                          "(arguments unchecked) instead of as text")
    # The prefix cache's file tier (--hicache-storage-backend file; mem_cache/file_tier.py), upstream's name
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR = EnvVar("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/tmp/hicache", str,
                                                     "the file tier's directory (storage_dir in "
                                                     "--hicache-storage-backend-extra-config wins)")
    # Constrained decoding (constrained/grammar_queue.py)
    SGLANG_GRAMMAR_TIMEOUT = EnvVar("SGLANG_GRAMMAR_TIMEOUT", 300.0, _positive(float),
                                    "seconds a request waits for its grammar to compile before it is refused with a "
                                    "400 naming the field (upstream's name and default)")
    SGLANG_GRAMMAR_CACHE_MB = EnvVar("SGLANG_GRAMMAR_CACHE_MB", 512, _non_negative(int),
                                     "MiB of compiled grammars kept for reuse, least recently used evicted first "
                                     "(0: none kept)")
    # Indexer logits budgets (GPU backends)
    SGLANG_DSV4_FP4_LOGITS_BUDGET_MB = EnvVar("SGLANG_DSV4_FP4_LOGITS_BUDGET_MB", 2048, int,
                                              "pooled prefill-logits block of the FP4 indexer, MiB")
    SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB = EnvVar("SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB", 512, int,
                                                  "pooled prefill-logits block of the FP8 indexer, MiB")
    SGLANG_DSV4_DISABLE_LOGITS_POOL = EnvVar("SGLANG_DSV4_DISABLE_LOGITS_POOL", False, _bool,
                                             "benchmark switch: allocate prefill indexer logits fresh per call "
                                             "instead of viewing the pooled block")

    # Scheduling (managers/schedule_policy.py)
    SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = EnvVar(
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", 4096, int,
        "admission counts at most this many of a request's max_new_tokens (upstream's name and default): a request "
        "without max_tokens is not expected to fill the context")

    SGLANG_DSV4_FP4_EXPERTS = EnvVar("SGLANG_DSV4_FP4_EXPERTS", None, _tristate,
                                     "whether the checkpoint's routed experts are MXFP4 (1) or FP8-converted (0); "
                                     "upstream needs it for FP8-converted checkpoints, here the stored format is "
                                     "detected and a contradicting value is refused at start (auto: detected)")

    SGLANG_DSV4_FP8_PREFILL = EnvVar(
        "SGLANG_DSV4_FP8_PREFILL", "auto", _choice("auto", "dequant"),
        "FP8 linears with at least 4,096 rows (long prefill chunks): auto = W8A8 as DeepSeek's reference "
        "(activations quantized per token and 128 channels, cuBLAS's blockwise-scaled GEMM via torch._scaled_mm) "
        "where the device has it (sm90, CUDA >= 12.9), else the weight dequantized + the bf16 GEMM (W8A16); dequant "
        "forces the latter")

    SGLANG_DSV4_MOE_DECODE = EnvVar(
        "SGLANG_DSV4_MOE_DECODE", "auto", _choice("auto", "planes"),
        "packed MXFP4 experts at 1-8 tokens (decode): auto = CUDA-core GEMVs straight from the router's ids "
        "(sgl_kernel.dsv4_moe_gemv; 10-30% faster than the MMA planes on an H100) where the widths fit; planes = "
        "the parity planes' MMA kernels at every batch")

    # Platform (ROCm / AMD); decided in arg_groups/platform_defaults.py, documented in docs/platforms.md
    SGLANG_USE_AITER = EnvVar("SGLANG_USE_AITER", None, _tristate,
                              "use AMD's AITER kernels where they are a drop-in swap (auto: on ROCm when `aiter` "
                              "is installed; 0: never; ignored off ROCm)")
    AITER_BF16_FP8_MOE_BOUND = EnvVar(
        "AITER_BF16_FP8_MOE_BOUND", 256, int,
        "AITER's own variable (its fused MoE reads it: batches below this many rows take bf16 activations, others "
        "MXFP8), read here too: 0, upstream's MI355X recipe value, lets AITER's A8W4 fused MoE serve the MXFP4 "
        "experts on gfx950 (layers/moe/aiter_moe.py); any other value keeps our Triton MoE")
    SGLANG_HACK_FLASHMLA_BACKEND = EnvVar(
        "SGLANG_HACK_FLASHMLA_BACKEND", "auto",
        _choice("auto", "triton", "torch", aliases={"unified_kv_triton": "triton"}),
        "kernel of `--attention-backend dsv4` (or unset): auto = triton on a GPU when Triton imports, else torch; "
        "triton|torch force one (upstream's unified_kv_triton, used by the AMD recipes, is read as triton: ours is "
        "one Triton kernel over window + compressed KV). An explicit --attention-backend triton|torch wins")
    SGLANG_OPT_FLASHMLA_SPARSE_PREFILL = EnvVar(
        "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", None, _tristate,
        "upstream's switch for FlashMLA's sparse-prefill kernel: accepted from upstream's recipes (a boolean or auto) "
        "and logged at start as changing nothing; prefill and decode run one sparse attention kernel here")

    # Prefill/decode disaggregation (disaggregation/)
    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT = EnvVar(
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0, float,
        "seconds a disaggregated request's two halves have to meet and finish its KV transfer (as upstream): a "
        "prefill request no decode server registered, a decode request whose prefill never completed, or one "
        "queued for decode pool pages fails after it")
    SGLANG_DISAGGREGATION_LATE_WRITE_HOLD = EnvVar(
        "SGLANG_DISAGGREGATION_LATE_WRITE_HOLD", 10.0, float,
        "seconds a decode server keeps the pool pages of a request whose prefill failed after its room was "
        "registered before reusing them: a write that timed out or was cut off may still land (bytes queued in a "
        "socket, an engine call past its bound); the request itself fails at once")

    SGLANG_SERVER_WARMUP_ON_CPU = EnvVar(
        "SGLANG_SERVER_WARMUP_ON_CPU", False, _bool,
        "run the server warm-up (managers/server_warmup.py) on CPU too, where no kernel compiles (it runs by default "
        "on CUDA and ROCm, and --skip-server-warmup skips it everywhere)")

    # Test hooks
    SGLANG_TEST_HANG_SCHEDULER_FILE = EnvVar(
        "SGLANG_TEST_HANG_SCHEDULER_FILE", "", str,
        "tests only: while this file exists, the scheduler process hangs before each step (alive, reading nothing), "
        "for the --watchdog-timeout tests")

    # Variables other libraries own, read here too because their value decides which kernels those libraries run
    LIBRARY_VARIABLES = ("AITER_BF16_FP8_MOE_BOUND",)

    @classmethod
    def all(cls) -> list:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]


envs = Envs
