"""The fused MXFP4 MoE (sgl_kernel.dsv4_moe.dsv4_moe_mxfp4) at DeepSeek-V4 Flash shapes on a GPU, against the
bytes-read floor and the bf16 grouped-GEMM experts, all measured in one run.

    python benchmark/bench_moe_mxfp4.py [--experts 256] [--top-k 6] [--tokens 1 8 32 128 256 4096] [--profile]
        [--config-from sweep.json] [--planes | --gemv] [--row-major-scales] [--no-pdl] [--out r.json]

Per token count: router choices drawn uniformly (top-k distinct of E), the fused op's time replayed from a CUDA graph
(triton.testing.do_bench_cudagraph: the engine's decode replays graphs; eager timing at 1 token measures the host's
~20 launches, not the GPU), the floor = bytes of the FP4 experts actually touched (distinct experts x (codes + scale
bytes)) / same-run copy bandwidth, their ratio (the decode target: >= 0.6 of copy bandwidth at <= 32 tokens), and
the engine's bf16 path (`RoutedExperts`, torch._grouped_mm) on the dequantized weights for comparison.
--config-from takes each token count's launches from a sweep's JSON (benchmark/kernels/sweep_moe_mxfp4.py): the row
count per block with the lowest gate-up + down time, each kernel's best launch at it (rows of launches the kernels
no longer have, from older sweeps, passed over); otherwise `moe_config`'s.
--gemv times what the engine runs: 1-8 tokens as CUDA-core GEMVs (dsv4_moe_gemv), more through the planes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200) * 1e-3)


def random_mxfp4_experts(e: int, d: int, i: int, g: torch.Generator, chunk: bool = True) -> tuple:
    """Random packed MXFP4 experts on g's device: (w13, w13_scale, w2, w2_scale), exponent bytes 120..125; the scale
    bytes chunked as the engine keeps them (dsv4_mxfp4_scales) unless `chunk` is False (the checkpoint's rows)."""
    from sgl_kernel.dsv4_mxfp4_scales import chunked

    def packed(n, kk):
        codes = torch.randint(0, 256, (e, n, kk // 2), device=g.device, generator=g, dtype=torch.int32).to(torch.uint8)
        scale = torch.randint(120, 126, (e, n, kk // 32), device=g.device, generator=g, dtype=torch.int32)
        return codes, chunked(scale.to(torch.uint8)) if chunk else scale.to(torch.uint8)

    return (*packed(2 * i, d), *packed(d, i))


def kernel_table(fn, steps: int = 20) -> str:
    """GPU kernels of `fn` (warm) per call: torch.profiler's table, device time and launch counts."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)


def load_sweep(path: str) -> list:
    """The rows of a sweep's JSON (--config-from), or a clear error naming the flag."""
    try:
        with open(path) as f:
            rows = json.load(f).get("rows")
    except (OSError, ValueError, AttributeError) as exc:
        raise SystemExit(f"--config-from {path}: not a readable sweep JSON ({exc})") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"tokens", "kernel", "block_m"} <= r.keys()
                                             for r in rows):
        raise SystemExit(f"--config-from {path}: expected sweep_moe_mxfp4.py's JSON, a \"rows\" list of rows with "
                         f"tokens, kernel and block_m")
    return rows


# A sweep row's fields that are not its launch's
SWEEP_ROW_FIELDS = {"tokens", "kernel", "block_m", "ms", "floor_ms", "fraction_of_copy_bw", "relative_error_vs_default",
                    "failed"}
# Switches that older sweeps wrote for launch variants since dropped, at the value that is today's kernel (any other
# switch, e.g. fma, group_dot, prefetch or swap_ab, at False)
KEPT_SWITCHES = {"scale_bcast": True}


def swept_launch(row: dict):
    """The MoeLaunch a sweep row timed, or None where the kernels no longer have it: rows of older sweeps with a
    dropped variant switched on (the per-byte scale loads, scale_bcast False; fma, group_dot, prefetch, swap_ab) or
    K splits of the general kernels (split_k > 1 without planes). A launch built from the other fields would be a
    different kernel than the one timed."""
    from sgl_kernel.dsv4_moe import MoeLaunch

    fields = {f.name for f in dataclasses.fields(MoeLaunch)}
    if any(value != KEPT_SWITCHES.get(key, False) for key, value in row.items()
           if key not in fields and key not in SWEEP_ROW_FIELDS):
        return None
    try:
        return MoeLaunch(**{name: row[name] for name in fields if name in row})
    except ValueError:  # MoeLaunch refuses split_k > 1 without planes
        return None


def swept_config(rows: list, tokens: int):
    """The sweep's best MoeConfig for `tokens` (None if it has no rows for it): per rows-per-block, each kernel's
    fastest launch (of those the kernels still have: swept_launch); the block size whose two launches sum lowest."""
    from sgl_kernel.dsv4_moe import MoeConfig

    best = {}
    for r in rows:
        if r["tokens"] == tokens and "ms" in r and (launch := swept_launch(r)) is not None:
            key = (r["block_m"], r["kernel"])
            if key not in best or r["ms"] < best[key][0]:
                best[key] = (r["ms"], launch)
    sizes = [b for b in {bm for bm, _ in best} if (b, "gate_up") in best and (b, "down") in best]
    if not sizes:
        return None
    bm = min(sizes, key=lambda b: best[(b, "gate_up")][0] + best[(b, "down")][0])
    return MoeConfig(bm, best[(bm, "gate_up")][1], best[(bm, "down")][1])


def main() -> None:
    from sgl_kernel.dsv4_moe_gemv import GEMV_MAX_TOKENS
    from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4, moe_config, planes_supported, tma_supported
    from sgl_kernel.dsv4_moe_ref import dequant_mxfp4_ref
    from sglang.srt.layers.moe.experts import RoutedExperts

    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 256, 4096])
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's kernel table per token count")
    ap.add_argument("--config-from", help="a sweep's JSON: each token count's best launches from it")
    ap.add_argument("--planes", action="store_true", help="the engine's case: scales checked at load, so decode "
                    "takes the parity planes (dsv4_moe_planes) where the GPU has them")
    ap.add_argument("--gemv", action="store_true", help="the engine's default: 1-8 tokens as CUDA-core GEMVs "
                    "(dsv4_moe_gemv), more as --planes")
    ap.add_argument("--row-major-scales", action="store_true", help="scale bytes in the checkpoint's row-major layout "
                    "instead of the engine's chunked storage")
    ap.add_argument("--no-pdl", action="store_true", help="the decode chain without programmatic dependent launches "
                    "(MoeConfig.pdl; dsv4_pdl)")
    ap.add_argument("--out")
    args = ap.parse_args()
    swept = load_sweep(args.config_from) if args.config_from else []
    e, d, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g, chunk=not args.row_major_scales)
    expert_bytes = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    bf16 = RoutedExperts(e, d, i, 10.0).cuda().bfloat16()
    with torch.no_grad():
        w13f = torch.stack([dequant_mxfp4_ref(w13[x], s13[x].reshape(2 * i, -1)) for x in range(e)]).bfloat16()
        bf16.w1.copy_(w13f[:, :i])
        bf16.w3.copy_(w13f[:, i:])
        del w13f
        bf16.w2.copy_(torch.stack([dequant_mxfp4_ref(w2[x], s2[x].reshape(d, -1)) for x in range(e)]).bfloat16())
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; one expert {expert_bytes / 1e6:.2f} MB packed")
    rows = []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        default = moe_config(t * k, e, tma=tma_supported(x.device))
        cfg = swept_config(swept, t) or moe_config(t * k, e, tma=tma_supported(x.device),
                                                   planes=args.planes and planes_supported(x.device, x.dtype))
        if args.gemv:
            fit = planes_supported(x.device, x.dtype)
            fused = lambda: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0,  # noqa: E731
                                           scales_fit_planes=fit, gemv=True)
            cfg = "gemv" if t <= GEMV_MAX_TOKENS else moe_config(t * k, e, tma=tma_supported(x.device), planes=fit)
        else:
            cfg = dataclasses.replace(cfg, pdl=not args.no_pdl)
            fused = lambda: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=cfg)  # noqa: E731
        ref = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=default).float()
        err = ((fused().float() - ref).norm() / ref.norm()).item()  # vs the default launches
        ms = triton.testing.do_bench_cudagraph(fused, rep=200)
        ms_bf16 = triton.testing.do_bench_cudagraph(lambda: bf16(x, ids, weights), rep=200)
        touched = ids.unique().numel()
        floor_ms = touched * expert_bytes / bw * 1e3
        row = {"tokens": t, "experts_touched": touched, "fused_mxfp4_ms": ms, "bf16_grouped_ms": ms_bf16,
               "floor_ms": floor_ms, "fraction_of_copy_bw": floor_ms / ms, "speedup_vs_bf16": ms_bf16 / ms,
               "config": str(cfg), "relative_difference_vs_default_launches": err}
        if args.profile:
            print(kernel_table(fused), flush=True)
        rows.append(row)
        print(f"tokens {t:5d}: {touched:3d} experts touched | fused MXFP4 {ms * 1e3:9.1f} us "
              f"({row['fraction_of_copy_bw']:.2f} of copy bw; floor {floor_ms * 1e3:.1f} us) | bf16 grouped "
              f"{ms_bf16 * 1e3:9.1f} us ({row['speedup_vs_bf16']:.2f}x) | {cfg} (differs from the default launches by "
              f"{err:.1e})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
