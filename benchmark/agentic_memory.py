"""Agentic-workload memory regression for the lightning indexer's prefill logits (the MI355X OOM failure mode).

A conversation grows by `--step` tokens per request to at least `--requests * --step` tokens; every request
prefills its last chunk (`--chunk` rows, or the whole context when shorter) through the backend's real indexer path,
whose logits are [rows, context/4] fp32. After every request we record torch.cuda.memory_reserved(). With the pooled
workspace the curve is flat after warm-up (one block); with pooling off (the benchmark switch) every new, larger
logits tensor strands another segment in the caching allocator and the curve climbs.

    python benchmark/agentic_memory.py --index fp4 --out fp4.json     # and --index fp8, --no-pool
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.configs.hub_configs import FLASH
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.mem_cache.deepseek_v4_allocator import DeepSeekV4TokenAllocator
from sglang.srt.mem_cache.deepseek_v4_pool import DeepSeekV4TokenToKVPool, PoolShape
from sglang.srt.mem_cache.kv_formats import make_index_key_format, make_kv_format
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def one_csa_layer_config() -> DeepseekV4Config:
    """Flash's attention/indexer widths (64 x 128 indexer, top-512, window 128) with a single CSA layer."""
    raw = {**FLASH, "num_hidden_layers": 1, "compress_ratios": [4, 0], "num_hash_layers": 0}
    return DeepseekV4Config.from_dict(raw)


def build(args, device):
    config = one_csa_layer_config()
    page = 256
    max_ctx = args.requests * args.step + args.step + page
    num_pages = max_ctx // page + 2
    shape = PoolShape(page_size=page, num_pages=num_pages, num_swa_slots=max_ctx + 1, max_num_reqs=1)
    kv_fmt = make_kv_format("fp8_e4m3", config.head_dim, config.qk_rope_head_dim, torch.bfloat16)
    idx_fmt = make_index_key_format(args.index, config.index_head_dim, torch.bfloat16)
    rtp = ReqToTokenPool(1, max_ctx, device)
    allocator = DeepSeekV4TokenAllocator(rtp, num_pages, page, shape.num_swa_slots, device)
    pool = DeepSeekV4TokenToKVPool(config, 1, shape, kv_fmt, idx_fmt, index_keys_rotated=True, device=device)
    if args.backend == "triton":
        from sglang.srt.layers.attention.dsv4.triton_backend import TritonAttnBackend as Backend
    else:
        from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend as Backend
    backend = Backend(config, pool, allocator, page)
    backend.logits_workspace.pooled = not args.no_pool
    indexer = SimpleNamespace(layer_id=0, ratio=4, index_topk=config.index_topk, rotate=hadamard_rotate)
    return config, pool, allocator, rtp, backend, indexer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", choices=("fp4", "fp8"), default="fp4")
    ap.add_argument("--backend", choices=("triton", "torch"), default="triton")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--step", type=int, default=328, help="tokens added per request")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill rows per forward")
    ap.add_argument("--no-pool", action="store_true", help="allocate logits per call (the failure mode)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, pool, allocator, rtp, backend, indexer = build(args, device)
    alloc = allocator.alloc_req()
    g = torch.Generator(device=device).manual_seed(0)
    n_i, d_i = config.index_n_heads, config.index_head_dim
    records = []
    start = time.perf_counter()
    for i in range(1, args.requests + 1):
        n = i * args.step
        new_full = allocator.extend(alloc, n)
        # The new tokens' index keys (one per 4 tokens) get random values, as the compressor would write.
        first_new_entry, last_entry = (n - args.step) // 4, n // 4
        if last_entry > first_new_entry:
            w = torch.arange(first_new_entry, last_entry, device=device)
            full = rtp.req_to_token[alloc.req_pool_idx, w * 4].long()
            slots = full // 256 * 64 + w % 64
            keys = torch.randn(len(w), d_i, generator=g, device=device, dtype=torch.float32)
            pool.set_index_k(0, slots, keys)
        rows = min(args.chunk, n)
        forward_batch = ForwardBatch.build(ForwardMode.EXTEND, [0] * rows, [alloc.req_pool_idx], [n - rows], [rows],
                                           rtp.req_to_token[alloc.req_pool_idx, n - rows:n].long(), device)
        forward_batch.req_to_token_pool, forward_batch.token_to_kv_pool = rtp, pool
        forward_batch.token_allocator, forward_batch.attn_backend = allocator, backend
        backend.init_forward_metadata(forward_batch)
        q = torch.randn(rows, n_i, d_i, generator=g, device=device, dtype=torch.bfloat16)
        weights = torch.randn(rows, n_i, generator=g, device=device, dtype=torch.float32) / 64
        top = backend.forward_indexer(indexer, q, weights, forward_batch)
        allocator.release_window(alloc, n - 127)
        del forward_batch, q, weights
        if device == "cuda":
            torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
        records.append({"request": i, "context": n, "rows": rows, "width": n // 4, "reserved_bytes": reserved,
                        "valid_topk": int((top[-1] >= 0).sum())})
        del top, new_full
    result = {"index": args.index, "backend": args.backend, "pooled": not args.no_pool,
              "budget_MB": backend.logits_workspace.budget_bytes >> 20,
              "block_allocations": backend.logits_workspace.num_allocations,
              "seconds": time.perf_counter() - start, "records": records}
    r0 = records[min(4, len(records) - 1)]["reserved_bytes"]
    print(f"{args.index} pooled={not args.no_pool}: reserved after warm-up {r0 / 2**20:.0f} MiB, "
          f"at the end {records[-1]['reserved_bytes'] / 2**20:.0f} MiB (context {records[-1]['context']}), "
          f"{result['seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
