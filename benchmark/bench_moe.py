"""Routed-expert MoE: the grouped-GEMM path (torch._grouped_mm, no host sync) against the expert loop, on a GPU.

    python benchmark/bench_moe.py     # Flash-slice widths: 32 experts, hidden 4096, intermediate 2048, top-6, bf16
"""

from __future__ import annotations

import time

import torch

import sglang.srt.layers.moe.experts as experts


def wall_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 32, 4096, 2048, 6
    moe = experts.RoutedExperts(num_experts, hidden, inter, 10.0).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in (moe.w1, moe.w3, moe.w2):
            p.normal_(0, 0.02)
    grouped_ok = experts.grouped_mm_supported
    for tokens in (1, 16, 512):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(num_experts, device="cuda")[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, device="cuda")
        with torch.no_grad():
            assert grouped_ok(x), "grouped GEMM not available on this GPU"
            g = moe(x, ids, w)
            t_g = wall_ms(lambda: moe(x, ids, w))
            experts.grouped_mm_supported = lambda _: False
            loop = moe(x, ids, w)
            t_l = wall_ms(lambda: moe(x, ids, w))
            experts.grouped_mm_supported = grouped_ok
        rel = ((g.float() - loop.float()).norm() / loop.float().norm()).item()
        print(f"tokens {tokens:4d}: grouped vs loop relative error {rel:.2e}; "
              f"wall ms grouped {t_g:.2f}, loop {t_l:.2f}")


if __name__ == "__main__":
    main()
