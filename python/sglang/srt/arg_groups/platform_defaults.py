"""Platform-dependent defaults, decided in one function (DESIGN section 6) and printed at start.

`apply_platform_defaults(args)` runs inside the DeepSeek-V4 hook (resolve_server_args). It reads the platform
through `sglang.srt.platform` at call time, so a test that simulates ROCm sees ROCm decisions. What it decides,
for the platform the model runs on ("cpu" when --device cpu, else "rocm" or "cuda"):

* attention backend of `--attention-backend dsv4` (or unset): SGLANG_HACK_FLASHMLA_BACKEND (auto|triton|torch);
  auto = the Triton kernels on a GPU when Triton imports, else the torch reference. Both run on CUDA and ROCm:
  nothing CUDA-only (FlashMLA, DeepGEMM, FlashInfer) exists in this engine, so ROCm can never default to it.
* shared-experts fusion: --enforce-shared-experts-fusion / --disable-shared-experts-fusion; default off on
  CUDA and CPU (as upstream, which disables it because some fused implementations clamp the shared expert
  differently from the routed ones), on for ROCm (the MI355X recipe enforces it). Ours is exact either way.
* indexer logits budget: SGLANG_DSV4_FP4_LOGITS_BUDGET_MB with the FP4 indexer, else
  SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB (the same choice as layers/attention/dsv4/logits_workspace.py).
* AITER: on for ROCm when installed, unless SGLANG_USE_AITER=0 (layers/aiter_ops.py; warns once if missing); the
  start-up line names the ops that run AITER's kernels and those that run ours (`aiter_ops=...`).

Upstream's sparse-prefill switch (SGLANG_OPT_FLASHMLA_SPARSE_PREFILL) has nothing to choose here: prefill and decode
run one sparse attention kernel. arg_groups/upstream_recipes.py logs it, when set, as changing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from sglang.srt import platform as plat
from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# Attention backends that run on CUDA and ROCm alike (sgl-kernel's Triton kernels, the torch reference).
PORTABLE_BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class PlatformDecisions:
    platform: str  # where the model runs: "cuda", "rocm" or "cpu"
    gfx: Optional[str]  # AMD architecture on ROCm ("gfx950" MI355X, "gfx942" MI300X)
    aiter: str  # "on", "off (SGLANG_USE_AITER=0)", "missing", or "n/a" off ROCm
    attention_backend: str
    shared_experts_fusion: bool
    index_logits_budget_mb: int
    index_logits_budget_var: str  # the environment variable the budget came from
    aiter_ops: Optional[str] = None  # on ROCm: which ops run AITER's kernels, which ours (aiter_ops.startup_line)

    def summary(self) -> list:
        """'name=value' lines for the start-up log (with the DeepSeek-V4 defaults)."""
        where = self.platform + (f" {self.gfx}" if self.gfx else "")
        if self.platform == "rocm":
            where += f", aiter {self.aiter}"
        return [f"platform={where}", *([self.aiter_ops] if self.aiter_ops else []),
                f"shared_experts_fusion={'on' if self.shared_experts_fusion else 'off'}",
                f"index_logits_budget_mb={self.index_logits_budget_mb} ({self.index_logits_budget_var})"]


def runtime_platform(device: str) -> str:
    if device == "cpu":
        return "cpu"
    return "rocm" if plat.is_hip() else "cuda"


def best_attention_backend(device: str) -> str:
    """`dsv4` (or unset) with SGLANG_HACK_FLASHMLA_BACKEND=auto: Triton kernels on a GPU when Triton imports,
    else the torch reference."""
    return "triton" if device != "cpu" and plat.has_library("triton") else "torch"


def choose_attention_backend(args: "ServerArgs", where: str) -> Optional[str]:
    """The backend for an unset / `dsv4` --attention-backend; None when the flag names one explicitly."""
    if args.attention_backend not in (None, "dsv4"):
        return None
    forced = envs.SGLANG_HACK_FLASHMLA_BACKEND.get()
    if forced == "auto":
        backend = best_attention_backend(args.device)
    else:
        if forced == "triton" and not plat.has_library("triton"):
            raise ValueError("SGLANG_HACK_FLASHMLA_BACKEND=triton but Triton is not installed")
        backend = forced
    # Never a CUDA-only kernel on ROCm (guards a future backend list, not today's: both are portable).
    if where == "rocm" and backend not in PORTABLE_BACKENDS:
        raise ValueError(f"attention backend {backend!r} does not run on ROCm; use one of {PORTABLE_BACKENDS}")
    return backend


def choose_shared_experts_fusion(args: "ServerArgs", where: str) -> bool:
    if args.enforce_shared_experts_fusion and args.disable_shared_experts_fusion:
        raise ValueError("--enforce-shared-experts-fusion and --disable-shared-experts-fusion are mutually "
                         "exclusive")
    if args.tp_size > 1:  # each rank holds another part of the shared expert than of the routed experts
        if args.enforce_shared_experts_fusion:
            raise ValueError("--enforce-shared-experts-fusion needs --tp 1")
        return False
    if args.enforce_shared_experts_fusion:
        return True
    if args.disable_shared_experts_fusion:
        return False
    return where == "rocm"


def aiter_status(where: str) -> str:
    from sglang.srt.layers import aiter_ops

    if where != "rocm":
        return "n/a"
    if envs.SGLANG_USE_AITER.get() is False:
        return "off (SGLANG_USE_AITER=0)"
    return "on" if aiter_ops.aiter_wanted() else "missing"


def aiter_ops_line(where: str) -> Optional[str]:
    """On ROCm, the start-up line naming the ops on AITER and the ops on our kernels."""
    from sglang.srt.layers import aiter_ops

    return aiter_ops.startup_line() if where == "rocm" else None


def apply_platform_defaults(args: "ServerArgs") -> list:
    """Decide every platform-dependent default; sets args.attention_backend (when unset or `dsv4`) and
    args.platform_decisions. Returns the 'name=value' lines to print at start."""
    from sglang.srt.layers.attention.dsv4.logits_workspace import logits_budget_var
    from sglang.srt.mem_cache.kv_formats import index_key_kind

    where = runtime_platform(args.device)
    applied = []
    backend = choose_attention_backend(args, where)
    if backend is not None:
        args.attention_backend = backend
        applied.append(f"attention_backend={backend}")
    budget_var = logits_budget_var(index_key_kind(args.kv_cache_dtype, args.enable_deepseek_v4_fp4_indexer))
    budget_mb = budget_var.get()
    if budget_mb <= 0:
        raise ValueError(f"{budget_var.name} must be positive, got {budget_mb}")
    decisions = PlatformDecisions(
        platform=where, gfx=plat.gfx_arch() if where == "rocm" else None, aiter=aiter_status(where),
        attention_backend=args.attention_backend,
        shared_experts_fusion=choose_shared_experts_fusion(args, where), index_logits_budget_mb=budget_mb,
        index_logits_budget_var=budget_var.name, aiter_ops=aiter_ops_line(where))
    args.platform_decisions = decisions  # not a field: derived, like applied_defaults
    return applied + decisions.summary()
