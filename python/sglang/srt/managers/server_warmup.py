"""The server's warm-up: prefill forwards run before the scheduler reports ready, so no Triton kernel compiles inside
a user's request (on an H100 the first 8,192-token prompt took 3.8 s against 0.47 s warm, all of it compiles).

Which prompts. Triton compiles a kernel once per launch variant: its constexprs (tiles, paths, formats), its launch
options (warps, stages), for each integer argument not marked do_not_specialize whether it is 1 or divisible by 16,
and for each pointer whether its address is a multiple of 16 bytes (so every index array of a forward starts aligned,
whatever its row and request counts: forward_batch_info._packed_views; chunks of one request then launch what chunks
of several do). Decode is not the warm-up's business: the CUDA-graph capture runs every decode (and speculative
cycle) batch size before this. A prefill chunk of T rows (one request, T from 1 to --chunked-prefill-size) picks
its variants through the wrappers' launch tables, each a function of T: `prefill_signature` evaluates them (the
same functions the wrappers call, so nothing is restated here), and the variants stay constant over runs of T. The
warm-up prefills the last T of every run (the largest rows a variant serves), plus:
  * T = 1 (integer arguments equal to 1 become constexprs), and within each run one T divisible by 16 and one not,
    where the run holds both (row counts and the strides that follow them are specialised on divisibility by 16);
  * a prompt of two chunks, whose second chunk runs after a prefix: attention over the first chunk's compressed
    entries and the compressors' ring state carried over. A chunk after a prefix from the prefix cache runs those
    same kernels (the cache restores the same pool state); the warm-up never touches the cache.
What this cannot reach cheaply: integers derived from both T and the prefix, which vary with where a chunk starts,
where a kernel specialises them. The counts among them are marked do_not_specialize (dsv4_compress's completed entries
and staging writes, attention's key counts, the indexer's and top-k's bounds); the row strides of the indexer's
[rows, entries] logits and entry tables are not (their divisibility by 16 lets the stores vectorise), so a chunk whose
entry count falls in a class no warm-up prompt met compiles that variant in the first request that meets it (once per
server, then Triton's cache holds it on disk).

The prompts run through the normal forward path (Scheduler.step, chunking, the draft model's prefill under
speculative decoding, every TP rank alike) as throw-away requests that neither read nor fill the prefix cache; the
pools and the radix tree are back to empty after. --skip-server-warmup skips it; it runs by default where kernels
compile (CUDA, ROCm), on CPU only with SGLANG_SERVER_WARMUP_ON_CPU=1 (the CPU runs the torch references and Triton's
interpreter, which compile nothing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional


from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.environ import envs
from sglang.srt.layers.mhc import CARRY_MAX_ROWS
from sglang.srt.layers.moe.router import FUSED_MAX_ROWS
from sglang.srt.layers.quantization.fp8 import CUBLAS_EAGER_MIN_ROWS, SKINNY_ROWS
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.models.deepseek_v4 import FUSED_PROJ_MAX_ROWS
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_RID_PREFIX = "server-warmup-"


@dataclass(frozen=True)
class WarmupPlan:
    """Prompt lengths the warm-up prefills, in order; `chunk`: the chunk budget they were planned for."""
    prompt_lens: tuple
    chunk: int


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran: forwards (scheduler steps), its prompts' lengths, and how long it took."""
    forwards: int
    prompt_lens: tuple
    seconds: float


def prefill_signature(t: int, shapes: "WarmupShapes") -> tuple:
    """The launch variants a prefill chunk of `t` rows picks, as the wrappers' own launch tables give them (equal
    tuples: the same compiled kernels but for integer divisibility)."""
    from sgl_kernel.dsv4_fp8_gemm import _default_config
    from sgl_kernel.dsv4_mhc import mixes_launch, post_mixes_launch
    from sgl_kernel.dsv4_moe import moe_config
    from sgl_kernel.dsv4_moe_align import one_program_sort_width
    from sgl_kernel.dsv4_moe_gemv import GEMV_MAX_TOKENS
    from sgl_kernel.dsv4_router import router_launch
    from sgl_kernel.dsv4_sparse_attention import launch_variant
    from sgl_kernel.dsv4_swiglu import swiglu_row_block

    pairs = t * shapes.top_k
    return (t == 1, t <= FUSED_PROJ_MAX_ROWS, t <= CARRY_MAX_ROWS,
            router_launch(t, shapes.experts, shapes.hidden) if t <= FUSED_MAX_ROWS else None,
            _default_config(t, 2) if t <= SKINNY_ROWS else t >= CUBLAS_EAGER_MIN_ROWS,
            mixes_launch(t, shapes.hidden), post_mixes_launch(t, shapes.hidden) if t <= CARRY_MAX_ROWS else None,
            moe_config(pairs, shapes.experts), moe_config(pairs, shapes.experts, scaled_dot=False, planes=True),
            t <= GEMV_MAX_TOKENS, one_program_sort_width(pairs),
            launch_variant(t, shapes.heads, shapes.attn_dot, shapes.num_sms), swiglu_row_block(t))


@dataclass(frozen=True)
class WarmupShapes:
    """What a rank's prefill launches depend on besides the rows: its model widths, its attention's dot dtype (the
    compute and KV cache dtypes) and the GPU's SM count."""
    hidden: int
    heads: int  # attention heads on this rank (attention TP: DP attention keeps every head on a rank)
    experts: int
    top_k: int
    num_sms: int
    attn_dot: object  # triton dtype of the sparse attention's dots (attention_dot_dtype)

    @classmethod
    def of(cls, config, attn_tp_size: int, device, dtype, kv_cache_dtype: str = "auto") -> "WarmupShapes":
        from sgl_kernel.dsv4_sparse_attention import _sm_count, attention_dot_dtype

        from sglang.srt.mem_cache.kv_formats import make_kv_format

        kv = make_kv_format(kv_cache_dtype, config.head_dim, config.qk_rope_head_dim, dtype)
        return cls(config.hidden_size, max(1, config.num_attention_heads // attn_tp_size), config.n_routed_experts,
                   config.num_experts_per_tok, _sm_count(device),
                   attention_dot_dtype(dtype, kv.storage_dtype, kv.fp8_rope_dim > 0)[0])


def plan_warmup(shapes: WarmupShapes, chunk: int, max_prompt: int) -> WarmupPlan:
    """The warm-up prompts for chunks of up to `chunk` rows (module docstring), none longer than `max_prompt`."""
    lens, run, prev = [], [], None
    for t in range(1, chunk + 1):
        sig = prefill_signature(t, shapes)
        if run and sig != prev:
            lens += _representatives(run)
            run = []
        run.append(t)
        prev = sig
    lens += _representatives(run)
    if 2 * chunk <= max_prompt:
        lens.append(2 * chunk)  # its second chunk runs after a prefix
    lens = sorted(set(n for n in lens if n <= max_prompt), reverse=True)  # the largest first: the memory peak early
    return WarmupPlan(tuple(lens), chunk)


def _representatives(run: list) -> list:
    """The rows of one run of equal signatures to prefill: its last, 1 if there, and a row count divisible by 16 and
    one not where the run holds both."""
    picks = {run[-1]} | ({1} if run[0] == 1 else set())
    for want in (True, False):
        if not any((n % 16 == 0) == want for n in picks):
            match = [n for n in run if (n % 16 == 0) == want]
            if match:
                picks.add(match[-1])
    return sorted(picks)


def warmup_enabled(server_args, device) -> bool:
    """On unless --skip-server-warmup; on CPU only when SGLANG_SERVER_WARMUP_ON_CPU asks (nothing compiles there);
    never on a disaggregated decode server (its prompts are prefilled by the prefill server)."""
    if server_args.skip_server_warmup or server_args.disaggregation_mode == "decode":
        return False
    return device.type != "cpu" or envs.SGLANG_SERVER_WARMUP_ON_CPU.get()


def run_server_warmup(scheduler, after_step: Optional[Callable] = None) -> Optional[WarmupReport]:
    """Prefill the planned prompts through `scheduler` (one at a time, max_new_tokens 1), then leave its pools and
    prefix cache as they were (empty at start-up). `after_step`: called after every step (the DP round a scheduler
    process closes after each step). None when the warm-up is off."""
    runner = scheduler.runner
    if not warmup_enabled(runner.server_args, runner.device):
        return None
    start = time.perf_counter()
    pool_tokens = scheduler.allocator.total_pages() * scheduler.allocator.page_size
    max_prompt = min(scheduler.context_length, pool_tokens) - 1 - scheduler.num_draft_tokens
    shapes = WarmupShapes.of(scheduler.config, get_parallel_state().attn_tp.world_size, runner.device, runner.dtype,
                             runner.server_args.kv_cache_dtype)
    plan = plan_warmup(shapes, scheduler.chunk_budget, max_prompt)
    generated = scheduler.num_generated_tokens
    forwards = 0
    for i, n in enumerate(plan.prompt_lens):
        vocab = scheduler.config.vocab_size
        req = Req(rid=f"{WARMUP_RID_PREFIX}{i}", origin_input_ids=[(7 + 13 * p) % vocab for p in range(n)],
                  sampling_params=SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
                  use_prefix_cache=False)
        scheduler.add_request(req)
        while not req.finished or scheduler.has_work():
            scheduler.step()
            forwards += 1
            if after_step is not None:
                after_step()
        if req.finished_reason.type == "abort":
            raise RuntimeError(f"the server warm-up's {n}-token prefill failed: {req.finished_reason.message}")
    scheduler.num_generated_tokens = generated  # the metrics count users' tokens only
    report = WarmupReport(forwards, plan.prompt_lens, time.perf_counter() - start)
    logger.info("server warm-up: %d prefill forwards of %d prompts (%s tokens) in %.1f s", report.forwards,
                len(plan.prompt_lens), ", ".join(map(str, plan.prompt_lens)), report.seconds)
    return report
