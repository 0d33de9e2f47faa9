"""FP8 linears fed by producers that quantize their output (layers/quantization/fp8.Fp8Activation), against bf16, at
DeepSeek-V4 Flash's shapes on a GPU, with the copy bandwidth of the same run.

    python benchmark/bench_fp8_producers.py [--rows 16 4096 8192] [--out result.json]

Each site is a producer and the FP8 linear reading it, timed as three chains:
- bf16: the producer, then the bf16 GEMM on the dequantized weight (what a bf16 checkpoint runs);
- fp8_own_quant: the producer, then the FP8 linear quantizing its input itself (act quant + FP8 GEMM: before);
- fp8_fused: the producer writing the rows quantized, then the FP8 GEMM alone (the engine now, where W8A8 runs).
Sites: attn_norm -> wq_kv_a (RMSNorm of 4,096, wq_a + wkv joined: 1,536 x 4,096); q_norm -> wq_b_indexer (RMSNorm
of 1,024 over strided rows, wq_b + the indexer's wq_b joined: 40,960 x 1,024); inverse RoPE -> wo_a (the attention
output [T, 64, 512], 8 groups of 1,024 x 4,096). Also each GEMM alone (bf16 matmul vs FP8 GEMM of quantized rows:
the prefill target, ">= 1.3x the bf16 matmul of the same shape") and the producers alone. Times are CUDA-graph
replays (the kernels' time; decode replays graphs) and, for prefill rows, eager calls too (the engine's prefill is
eager).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from bench_fp8_linears import copy_bandwidth

HIDDEN, Q_LORA, HEADS, HEAD_DIM, ROPE, GROUPS, O_LORA = 4096, 1024, 64, 512, 64, 8, 1024
INDEXER = 64 * 128


def _linear(n: int, k: int, groups: int = 1):
    from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear

    lin = Fp8BlockLinear(k, groups * n, groups).cuda()
    lin.weight.data.copy_((torch.randn(groups * n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn))
    lin.weight_scale_inv.data.copy_(2.0 ** torch.randint(-12, -4, lin.weight_scale_inv.shape, device="cuda").float())
    return lin


def _bf16_gemm(lin):
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_dequant

    wd = dsv4_fp8_dequant(lin.weight, lin.weight_scale_inv, torch.bfloat16)
    if lin.groups == 1:
        return lambda x: x @ wd.T
    g = lin.groups
    wg = wd.view(g, -1, wd.shape[1]).transpose(1, 2)  # [G, K, N]
    return lambda x: torch.bmm(x.view(x.shape[0], g, -1).transpose(0, 1), wg).transpose(0, 1).flatten(1)


def sites(m: int) -> dict:
    """name -> dict of chains (zero-argument callables) for m rows."""
    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm, dsv4_rms_norm_fp8
    from sgl_kernel.dsv4_rope import dsv4_rope, dsv4_rope_fp8
    from sglang.srt.layers.quantization.fp8 import Fp8Activation
    from sglang.srt.layers.rotary import RotaryEmbedding

    out = {}
    # attn_norm -> wq_kv_a; q_norm (over the joined output's strided q_a rows) -> wq_b_indexer
    for name, width, n, src_width in (("wq_kv_a", HIDDEN, 1536, HIDDEN), ("wq_b_indexer", Q_LORA,
                                                                         HEADS * HEAD_DIM + INDEXER, 1536)):
        lin = _linear(n, width)
        bf16 = _bf16_gemm(lin)
        x = torch.randn(m, src_width, device="cuda", dtype=torch.bfloat16)[:, :width]
        w = torch.randn(width, device="cuda")
        path = lin.w8a8_input_layout(m, x.dtype, x.device)
        y = dsv4_rms_norm(x, w, 1e-6)
        _, q, s = dsv4_rms_norm_fp8(x, w, 1e-6, cublas_layout=path == "cublas_w8a8")
        act = Fp8Activation(q, s, m, x.dtype, path)
        out[name] = {
            "path": path,
            "bf16": lambda x=x, w=w, bf16=bf16: bf16(dsv4_rms_norm(x, w, 1e-6)),
            "fp8_own_quant": lambda x=x, w=w, lin=lin: lin(dsv4_rms_norm(x, w, 1e-6)),
            "fp8_fused": lambda x=x, w=w, lin=lin, p=path: lin(Fp8Activation(
                *dsv4_rms_norm_fp8(x, w, 1e-6, cublas_layout=p == "cublas_w8a8")[1:], x.shape[0], x.dtype, p)),
            "gemm_bf16": lambda y=y, bf16=bf16: bf16(y),
            "gemm_fp8": lambda act=act, lin=lin: lin(act),
            "producer": lambda x=x, w=w: dsv4_rms_norm(x, w, 1e-6),
            "producer_fp8": lambda x=x, w=w, p=path: dsv4_rms_norm_fp8(x, w, 1e-6, cublas_layout=p == "cublas_w8a8"),
        }
    # inverse RoPE -> wo_a
    lin = _linear(O_LORA, HEADS * HEAD_DIM // GROUPS, GROUPS)
    bf16 = _bf16_gemm(lin)
    o = torch.randn(m, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 60000, (m,), device="cuda")
    inv = RotaryEmbedding(ROPE, 10000.0, None).inv_freq.cuda()
    path = lin.w8a8_input_layout(m, o.dtype, o.device)
    q, s = dsv4_rope_fp8(o, pos, inv, True, cublas_layout=path == "cublas_w8a8")
    act = Fp8Activation(q, s, m, o.dtype, path)
    y = dsv4_rope(o, pos, inv, True).flatten(1)
    out["wo_a"] = {
        "path": path,
        "bf16": lambda: bf16(dsv4_rope(o, pos, inv, True).flatten(1)),
        "fp8_own_quant": lambda: lin(dsv4_rope(o, pos, inv, True).flatten(1)),
        "fp8_fused": lambda: lin(Fp8Activation(*dsv4_rope_fp8(o, pos, inv, True, cublas_layout=path == "cublas_w8a8"),
                                               m, o.dtype, path)),
        "gemm_bf16": lambda: bf16(y),
        "gemm_fp8": lambda: lin(act),
        "producer": lambda: dsv4_rope(o, pos, inv, True),
        "producer_fp8": lambda: dsv4_rope_fp8(o, pos, inv, True, cublas_layout=path == "cublas_w8a8"),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 4096, 8192])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {"copy_bandwidth_gbs": bw / 1e9, "rows": []}
    for m in args.rows:
        for name, chains in sites(m).items():
            path = chains.pop("path")
            row = {"site": name, "rows": m, "path": path}
            for chain, fn in chains.items():
                fn()  # compile / initialise outside the graph
                torch.cuda.synchronize()
                row[f"{chain}_us"] = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
                if m > 64 and chain in ("bf16", "fp8_own_quant", "fp8_fused"):
                    row[f"{chain}_eager_us"] = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
            row["fused_vs_bf16"] = row["bf16_us"] / row["fp8_fused_us"]
            row["own_quant_vs_bf16"] = row["bf16_us"] / row["fp8_own_quant_us"]
            row["gemm_fp8_vs_bf16"] = row["gemm_bf16_us"] / row["gemm_fp8_us"]
            results["rows"].append(row)
            eager = (f"; eager bf16 {row['bf16_eager_us']:.1f} own {row['fp8_own_quant_eager_us']:.1f} fused "
                     f"{row['fp8_fused_eager_us']:.1f}" if m > 64 else "")
            print(f"{name:13s} rows {m:5d} {path}: bf16 {row['bf16_us']:.1f} us, FP8 own quant "
                  f"{row['fp8_own_quant_us']:.1f}, FP8 fused {row['fp8_fused_us']:.1f} ({row['fused_vs_bf16']:.2f}x "
                  f"bf16, was {row['own_quant_vs_bf16']:.2f}x); GEMM alone bf16 {row['gemm_bf16_us']:.1f} FP8 "
                  f"{row['gemm_fp8_us']:.1f} ({row['gemm_fp8_vs_bf16']:.2f}x); producer {row['producer_us']:.1f} -> "
                  f"{row['producer_fp8_us']:.1f}{eager}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
