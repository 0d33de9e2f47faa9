"""Pool sizing and the bytes-per-token report (DESIGN section 4, arch section 9.5).

Per context token a request grows by one compressed entry per `m` tokens in every ratio-m layer and one
indexer key per 4 tokens in every CSA layer ("growth", the published 3,514 B Flash / 5,031 B Pro in FP8+FP4).
Window KV is held only for live windows: it costs `--swa-full-tokens-ratio` x its per-token bytes in the
sizing. Staging rings are fixed per request slot.

    python -m sglang.srt.mem_cache.pool_sizing flash|pro|CONFIG_JSON [--kv-cache-dtype fp8_e4m3] [--index fp4]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.mem_cache.deepseek_v4_pool import PoolShape, ring_size
from sglang.srt.mem_cache.host_tier import HostTierShape


@dataclass(frozen=True)
class PoolBytes:
    pool: str
    layers: int
    entry_bytes: int
    entries_per_token: float  # per context token (window: per live window token)

    @property
    def per_token(self) -> float:
        return self.layers * self.entry_bytes * self.entries_per_token


@dataclass(frozen=True)
class BytesPerToken:
    compressed: tuple  # PoolBytes rows that grow with the context
    window: PoolBytes

    @property
    def growth(self) -> float:
        return sum(r.per_token for r in self.compressed)

    def format(self) -> str:
        lines = [f"{'pool':<22}{'layers':>7}{'entry B':>9}{'entries/token':>15}{'B/token':>11}"]
        for r in (*self.compressed, self.window):
            lines.append(f"{r.pool:<22}{r.layers:>7}{r.entry_bytes:>9}{r.entries_per_token:>15.5g}"
                         f"{r.per_token:>11.2f}")
        lines.append(f"{'growth per token':<22}{'':>31}{self.growth:>11.2f}")
        return "\n".join(lines)


def bytes_per_token(config: DeepseekV4Config, kv_entry_bytes: int, index_entry_bytes: int,
                    num_window_layers: int) -> BytesPerToken:
    rows = []
    for ratio in config.distinct_ratios:
        layers = sum(1 for i in range(config.num_hidden_layers) if config.compress_ratio(i) == ratio)
        rows.append(PoolBytes(f"c{ratio} kv", layers, kv_entry_bytes, 1 / ratio))
    if config.csa_layers:
        rows.append(PoolBytes("c4 indexer keys", len(config.csa_layers), index_entry_bytes, 1 / 4))
    return BytesPerToken(tuple(rows), PoolBytes("window kv (live)", num_window_layers, kv_entry_bytes, 1.0))


def state_bytes_per_request(config: DeepseekV4Config, num_draft_tokens: int = 0) -> int:
    """fp32 (content, gate) staging rows of every compressor of one request slot."""
    total = 0
    for i in range(config.num_hidden_layers):
        ratio = config.compress_ratio(i)
        if ratio == 0:
            continue
        overlap = config.is_csa(i)
        width = (2 if overlap else 1) * config.head_dim
        total += ring_size(ratio, overlap, num_draft_tokens) * 2 * width * 4
        if overlap:
            total += ring_size(ratio, True, num_draft_tokens) * 2 * 2 * config.index_head_dim * 4
    return total


def prefix_state_bytes(config: DeepseekV4Config, max_running_requests: int, num_state_slots: int) -> int:
    """The prefix cache's fp32 (content, gate) CSA staging rows: per request slot the m rows before a page boundary in
    two halves (page parity), and `num_state_slots` saved copies (slot 0 reserved), for every CSA compressor."""
    if num_state_slots == 0:
        return 0
    rows = (max_running_requests + 1) * 2 + num_state_slots + 1
    total = 0
    for i in config.csa_layers:
        ratio = config.compress_ratio(i)
        total += rows * ratio * 2 * (2 * config.head_dim + 2 * config.index_head_dim) * 4
    return total


@dataclass(frozen=True)
class PoolPlan:
    shape: PoolShape
    max_total_tokens: int
    context_length: int
    per_token: BytesPerToken
    state_bytes: int
    total_bytes: int
    host: Optional[HostTierShape] = None  # the prefix cache's host tier (--enable-hierarchical-cache)

    def format(self) -> str:
        s = self.shape
        host = [] if self.host is None else [
            f"host tier {self.host.nbytes / 2**30:.2f} GiB: {self.host.num_pages} pages "
            f"({self.host.num_pages * s.page_size} tokens), {self.host.num_ends} prefix ends"]
        return "\n".join([
            "DeepSeek-V4 memory pool",
            self.per_token.format(),
            f"page size {s.page_size}, pages {s.num_pages - 1}, full tokens {self.max_total_tokens}, "
            f"window slots {s.num_swa_slots - 1}, request slots {s.max_num_reqs}",
            f"staging state {self.state_bytes / 2**20:.1f} MiB (prefix-cache state slots {s.num_state_slots}), "
            f"pools total {self.total_bytes / 2**20:.1f} MiB",
            f"max context {min(self.context_length, self.max_total_tokens)} tokens; at {s.max_num_reqs} "
            f"concurrent requests {self.max_total_tokens // max(1, s.max_num_reqs)} tokens each",
            *host,
        ])


# Windows a running request may hold with the prefix cache on: its own, and the cached tail of the prefix it started
# on, which stays locked until its own window has slid past it.
CACHED_WINDOWS_PER_REQUEST = 2


def plan_pools(config: DeepseekV4Config, *, page_size: int, max_running_requests: int, context_length: int,
               chunked_prefill_size: int, swa_full_tokens_ratio: float, budget_bytes: int, kv_entry_bytes: int,
               index_entry_bytes: int, num_window_layers: int, max_total_tokens: int | None = None,
               num_draft_tokens: int = 0, prefix_cache: bool = False) -> PoolPlan:
    """Split `budget_bytes` between the pools; raises ValueError when not even one full context fits. `prefix_cache`:
    two saved staging states per request slot (one per cached prefix end; the cache evicts the rest)."""
    per_token = bytes_per_token(config, kv_entry_bytes, index_entry_bytes, num_window_layers)
    num_state_slots = 2 * max_running_requests if prefix_cache else 0
    state = ((max_running_requests + 1) * state_bytes_per_request(config, num_draft_tokens)
             + prefix_state_bytes(config, max_running_requests, num_state_slots))
    req_to_token = (max_running_requests + 1) * context_length * 4
    # Each full slot also costs its full_to_swa entry (8 B); live windows cost swa_ratio of the window bytes.
    cost = per_token.growth + 8 + swa_full_tokens_ratio * per_token.window.per_token
    tokens = int((budget_bytes - state - req_to_token) / cost)
    tokens = min(tokens, max_running_requests * context_length)
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    tokens = tokens // page_size * page_size
    if tokens < page_size:
        raise ValueError(f"memory budget {budget_bytes / 2**20:.0f} MiB holds no full page of {page_size} tokens "
                         f"after {(state + req_to_token) / 2**20:.0f} MiB of fixed state; lower "
                         f"--max-running-requests or raise --mem-fraction-static / --max-total-tokens")
    chunk = chunked_prefill_size if chunked_prefill_size > 0 else context_length
    # Live windows of every request, plus its draft rows when speculating, plus one prefill chunk; with the prefix
    # cache a request started on a cached prefix also reads that prefix's window tail (locked while it does).
    windows = CACHED_WINDOWS_PER_REQUEST if prefix_cache else 1
    min_window = max_running_requests * (windows * config.sliding_window + num_draft_tokens) + chunk
    swa_slots = max(int(tokens * swa_full_tokens_ratio), min_window)
    shape = PoolShape(page_size=page_size, num_pages=tokens // page_size + 1, num_swa_slots=swa_slots + 1,
                      max_num_reqs=max_running_requests, num_draft_tokens=num_draft_tokens,
                      num_state_slots=num_state_slots)
    total = (tokens * (per_token.growth + 8) + swa_slots * per_token.window.per_token + state + req_to_token)
    return PoolPlan(shape=shape, max_total_tokens=tokens, context_length=context_length, per_token=per_token,
                    state_bytes=state, total_bytes=int(total))


def end_bytes(config: DeepseekV4Config, per_token: BytesPerToken) -> int:
    """Bytes of one cached prefix end: the window tail (window KV of `window` positions, every layer) and the saved
    CSA staging rows (fp32 content and gate of m rows, every CSA compressor)."""
    state = sum(config.compress_ratio(i) * 2 * (2 * config.head_dim + 2 * config.index_head_dim) * 4
                for i in config.csa_layers)
    return int(config.sliding_window * per_token.window.per_token) + state


def plan_host_tier(config: DeepseekV4Config, plan: PoolPlan, hicache_ratio: float,
                   hicache_size_gb: float = 0) -> HostTierShape:
    """The host tier's slots: `hicache_ratio` x the device pool's pages and prefix ends, or (hicache_size_gb > 0,
    which wins) as many of both, in that proportion, as the size holds."""
    page = int(plan.shape.page_size * plan.per_token.growth)
    end = end_bytes(config, plan.per_token)
    pages, ends = plan.shape.num_pages - 1, plan.shape.num_state_slots
    scale = hicache_size_gb * 2**30 / (pages * page + ends * end) if hicache_size_gb > 0 else hicache_ratio
    num_pages, num_ends = int(pages * scale), int(ends * scale)
    if num_pages < 1 or num_ends < 1:
        given = f"--hicache-size {hicache_size_gb:g}" if hicache_size_gb > 0 else f"--hicache-ratio {hicache_ratio:g}"
        raise ValueError(f"the host tier ({given}) holds no page ({page} B) and prefix end ({end} B); give it more")
    return HostTierShape(num_pages, num_ends, num_pages * page + num_ends * end)


def pool_budget_bytes(device_type: str, free: int, total: int, mem_fraction_static: float, reserved: int = 0) -> int:
    """Bytes the pools may take, from the device's free and total memory after the weights are loaded: on a GPU the
    free memory less the (1 - mem_fraction_static) reserve of the total; on CPU that fraction of the free memory.
    `reserved`: taken out first (CUDA-graph memory)."""
    budget = free - (1 - mem_fraction_static) * total if device_type == "cuda" else free * mem_fraction_static
    return int(budget) - reserved


def plan_pools_for_args(config: DeepseekV4Config, args, budget_bytes: int, dtype, with_draft: bool,
                        probe: bool = False) -> tuple:
    """The engine's pool plan for its server args (the planner, check_capacity, calls the same): (PoolPlan, KV entry
    format, index-key format, index-key kind). `probe`: one request and two pages (CUDA-graph measurement)."""
    from sglang.srt.mem_cache.kv_formats import index_key_kind, make_index_key_format, make_kv_format

    kv_format = make_kv_format(args.kv_cache_dtype, config.head_dim, config.qk_rope_head_dim, dtype)
    index_kind = index_key_kind(args.kv_cache_dtype, args.enable_deepseek_v4_fp4_indexer)
    index_format = make_index_key_format(index_kind, config.index_head_dim, dtype)
    num_layers = config.num_hidden_layers + (config.num_nextn_predict_layers if with_draft else 0)
    plan = plan_pools(
        config, page_size=args.page_size, max_running_requests=1 if probe else args.max_running_requests,
        context_length=args.context_length, chunked_prefill_size=args.chunked_prefill_size,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio, budget_bytes=budget_bytes,
        kv_entry_bytes=kv_format.bytes_per_entry, index_entry_bytes=index_format.bytes_per_entry,
        num_window_layers=num_layers, max_total_tokens=2 * args.page_size if probe else args.max_total_tokens,
        num_draft_tokens=args.speculative_num_draft_tokens or 0,
        prefix_cache=not args.disable_radix_cache and not probe)
    if getattr(args, "enable_hierarchical_cache", False) and plan.shape.num_state_slots:
        plan = dataclasses.replace(plan, host=plan_host_tier(config, plan, args.hicache_ratio, args.hicache_size))
    return plan, kv_format, index_format, index_kind


def main() -> None:
    from sglang.srt.configs.hub_configs import FLASH, PRO
    from sglang.srt.mem_cache.kv_formats import make_index_key_format, make_kv_format

    import torch

    ap = argparse.ArgumentParser(description="bytes per token of the DeepSeek-V4 pools for a config.json")
    ap.add_argument("config", help="flash, pro, or a config.json path")
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "bfloat16", "float32"))
    ap.add_argument("--index", default="fp4", choices=("fp4", "fp8", "bfloat16", "float32"))
    args = ap.parse_args()
    presets = {"flash": FLASH, "pro": PRO}
    config = (DeepseekV4Config.from_dict(presets[args.config]) if args.config in presets
              else DeepseekV4Config.from_json_file(args.config))
    kv = make_kv_format(args.kv_cache_dtype, config.head_dim, config.qk_rope_head_dim, torch.bfloat16)
    index_kind = args.index if args.index in ("fp4", "fp8") else "auto"
    index_dtype = torch.float32 if args.index == "float32" else torch.bfloat16
    idx = make_index_key_format(index_kind, config.index_head_dim, index_dtype)
    n_window = config.num_hidden_layers + config.num_nextn_predict_layers
    print(bytes_per_token(config, kv.bytes_per_entry, idx.bytes_per_entry, n_window).format())


if __name__ == "__main__":
    main()
