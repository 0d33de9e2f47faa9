"""Every path of an FP8 linear at Flash's six FP8 shapes and 1-4,096 rows, on a GPU: which is fastest for each
(shape, rows)? `fp8_path` (layers/quantization/fp8.py) encodes the answer (benchmark/RESULTS.md, 2026-12-03).

    python benchmark/kernels/sweep_fp8_linears.py [--rows 1 16 32 64] [--skip-parts] [--out r.json]

Timed from CUDA graph replays (triton.testing.do_bench_cudagraph), so host launch time is out: bf16 on the
dequantized weight, Triton W8A8, Triton W8A16 and W8A8 with TMA weight copies (up to 256 rows), cuBLAS's W8A8
(where the device has the recipe), torch's dequantization + bf16 and the one-pass dsv4_fp8_dequant + bf16. Then
cuBLAS's W8A8 at 4,096 rows split into its activation quantization and its _scaled_mm, 5 alternated eager rounds
each (its run-to-run spread).

    python benchmark/kernels/sweep_fp8_linears.py --compare [--rows 1 8 32]

--compare: the split-K reduction at decode rows, per shape and row count (W8A8 and W8A16 of the same quantized
rows): the one launch whose last split per tile reduces against the two-launch path it replaced (the GEMM storing the
splits' fp32 partials, then a kernel adding them in split order), bit-equal checked; CUDA-graph replay time (what a
decode step pays, launch and tail included) and the kernels' own time (CUPTI), with the weight bytes per us as a
fraction of the same run's copy bandwidth.
"""
import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_fp8_gemm import _launch, dsv4_fp8_act_quant, dsv4_fp8_block_gemm, dsv4_fp8_dequant
from sglang.srt.layers.quantization.fp8 import cublas_blockwise_ok, cublas_w8a8, dequantize_weight, fp8_linear

SHAPES = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1), ("wo_a", 1024, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("indexer.wq_b", 8192, 1024, 1),
          ("wq_kv_a", 1536, 4096, 1)]  # wq_a and wkv joined after loading: the engine's shape
MS = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def mm(x, wd, groups):
    if groups == 1:
        return x @ wd.T
    m = x.shape[0]
    n, k = wd.shape[0] // groups, wd.shape[1]
    return torch.bmm(x.view(m, groups, k).transpose(0, 1), wd.view(groups, n, k).transpose(1, 2)).transpose(0, 1)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, numel, SPLITS, BLOCK: tl.constexpr):
    """The two-launch path's second kernel: out = the splits' fp32 partials [SPLITS, numel] added in split order."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def two_launches(a, a_scale, w, ws, groups):
    part = _launch(a, a_scale, w, ws, groups, torch.bfloat16, last_reduces=False)
    if part.dim() == 2:  # one split: nothing to add
        return part
    out = torch.empty(part.shape[1:], dtype=torch.bfloat16, device=part.device)
    _sum_partials_kernel[(triton.cdiv(out.numel(), 1024),)](part, out, out.numel(), part.shape[0], BLOCK=1024,
                                                             num_warps=4)
    return out


def compare(rows: list, shapes: list) -> list:
    """The in-kernel split-K reduction against GEMM + sum (module docstring)."""
    from common import copy_bandwidth_gbps, time_cuda_us

    copy = copy_bandwidth_gbps()
    print(f"copy bandwidth {copy:.0f} GB/s (read + write)")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, n, k, groups in shapes:
        w = (torch.randn(groups * n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.full((groups * n // 128, k // 128), 2.0 ** -10, device="cuda")
        for m in rows:
            x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
            for kind, (a, sa) in (("w8a8", dsv4_fp8_act_quant(x, groups)), ("w8a16", (x, None))):
                one = lambda: _launch(a, sa, w, ws, groups, torch.bfloat16)  # noqa: E731
                two = lambda: two_launches(a, sa, w, ws, groups)  # noqa: E731
                equal = torch.equal(one(), two())
                part = _launch(a, sa, w, ws, groups, torch.bfloat16, last_reduces=False)
                splits = part.shape[0] if part.dim() == 3 else 1
                row = {"name": name, "m": m, "kind": kind, "splits": splits, "bit_equal": equal,
                       "one_graph_us": triton.testing.do_bench_cudagraph(one, rep=30) * 1e3,
                       "two_graph_us": triton.testing.do_bench_cudagraph(two, rep=30) * 1e3,
                       "one_kernel_us": time_cuda_us(one), "two_kernel_us": time_cuda_us(two)}
                weight_bytes = w.numel() + ws.numel() * 4
                frac = weight_bytes / (row["one_graph_us"] * 1e-6) / 1e9 / copy
                out.append(row)
                print(f"{name:12s} M {m:3d} {kind:5s} splits {splits:2d} bit-equal {equal}: graph one "
                      f"{row['one_graph_us']:6.1f} us vs GEMM + sum {row['two_graph_us']:6.1f} us | kernels one "
                      f"{row['one_kernel_us']:6.1f} vs {row['two_kernel_us']:6.1f} us | one launch at "
                      f"{frac:.2f} of copy bandwidth", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=None, help=f"default {MS}; with --compare 1 8 32")
    ap.add_argument("--compare", action="store_true", help="split-K: one launch vs GEMM + sum (module docstring)")
    ap.add_argument("--skip-parts", action="store_true", help="no cuBLAS W8A8 parts at 4,096 rows")
    ap.add_argument("--shapes", nargs="+", default=[name for name, *_ in SHAPES], help="names of SHAPES to time")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.compare:
        found = compare(args.rows or [1, 8, 32], [shape for shape in SHAPES if shape[0] in args.shapes])
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "compare": found}, f, indent=1)
        return
    args.rows = args.rows or MS
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k, groups in [shape for shape in SHAPES if shape[0] in args.shapes]:
        w = (torch.randn(groups * n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.full((groups * n // 128, k // 128), 2.0 ** -10, device="cuda")
        wb = dsv4_fp8_dequant(w, ws)
        assert torch.equal(wb, dequantize_weight(w, ws, torch.bfloat16))
        cub_ok = cublas_blockwise_ok(torch.device("cuda"), n, k)
        for m in args.rows:
            x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
            paths = {"bf16": lambda: mm(x, wb, groups),
                     "triton_w8a8": lambda: dsv4_fp8_block_gemm(x, w, ws, groups),
                     "torch_dequant_bf16": lambda: mm(x, dequantize_weight(w, ws, torch.bfloat16), groups),
                     "triton_dequant_bf16": lambda: fp8_linear(x, w, ws, groups, path="dequant")}  # the engine's
            if m <= 256:
                paths["triton_w8a16"] = lambda: dsv4_fp8_block_gemm(x, w, ws, groups, quantize_act=False)
                paths["triton_w8a8_tma"] = lambda: dsv4_fp8_block_gemm(x, w, ws, groups, tma=True)
            if cub_ok:
                paths["cublas_w8a8"] = lambda: cublas_w8a8(x, w, ws, groups)
            row = {"name": name, "m": m, "n": groups * n, "k": k, "groups": groups}
            for p, fn in paths.items():
                row[p + "_us"] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            best = min(paths, key=lambda p: row[p + "_us"])
            row["best"] = best
            rows.append(row)
            print(f"{name:12s} M {m:5d}: " + " | ".join(f"{p} {row[p + '_us']:8.1f}" for p in paths)
                  + f" | best {best} ({row['bf16_us'] / row[best + '_us']:.2f}x bf16)", flush=True)

    parts = {}
    if not args.skip_parts:
        print("cuBLAS W8A8 parts, 5 alternated rounds (eager do_bench, us)")
    part_shapes = [("wkv", 512, 4096, 1), ("wo_a", 1024, 4096, 8), ("wq_a", 1024, 4096, 1)]
    for name, n, k, groups in [] if args.skip_parts else part_shapes:
        w = (torch.randn(groups * n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.full((groups * n // 128, k // 128), 2.0 ** -10, device="cuda")
        x = torch.randn(4096, groups * k, device="cuda", dtype=torch.bfloat16)
        a, sa = dsv4_fp8_act_quant(x, groups, cublas_layout=True)
        kb, nb = k // 128, n // 128
        fns = {"whole": lambda: cublas_w8a8(x, w, ws, groups),
               "act_quant": lambda: dsv4_fp8_act_quant(x, groups, cublas_layout=True),
               "scaled_mm": lambda: [torch._scaled_mm(a[:, i * k:(i + 1) * k], w[i * n:(i + 1) * n].t(),
                                                      scale_a=sa[:, i * kb:(i + 1) * kb],
                                                      scale_b=ws[i * nb:(i + 1) * nb].t(), out_dtype=torch.bfloat16)
                                     for i in range(groups)]}
        for r in range(5):
            for p, fn in fns.items():
                parts.setdefault(f"{name} {p}", []).append(triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3)
    for key, ts in parts.items():
        print(f"{key:20s} median {statistics.median(ts):8.1f} rounds " + " ".join(f"{t:.1f}" for t in ts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "cublas_parts": parts}, f, indent=1)


if __name__ == "__main__":
    main()
