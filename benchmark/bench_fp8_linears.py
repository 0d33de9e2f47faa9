"""FP8 block-scaled linears on a GPU: kernel speed against the bf16 matmul and copy bandwidth measured in the same run,
and end-to-end agreement of the FP8 engine with the dequantized (bf16) one on a quantized checkpoint.

    python benchmark/bench_fp8_linears.py [--model-path /tmp/w/q] [--tokens 1000] [--out result.json]

Kernels: DeepSeek-V4 Flash's FP8 linears (wq_a, wq_b, wkv, grouped wo_a, wo_b, indexer wq_b) at M = 1, 32 (decode),
256, 1024 (large decode batches, short chunks) and 4096, 8192 (prefill) rows: bf16 `torch.matmul` on the dequantized
weight, sgl_kernel's W8A8 (activation quant + FP8 GEMM), W8A16, cuBLAS's blockwise-scaled W8A8 (torch._scaled_mm,
above 64 rows, where the device has it) and the engine's path (layers/quantization/fp8.py `fp8_path`: W8A8 up to 64
rows, then cuBLAS W8A8, the grouped W8A8 or dequantize + matmul by shape). Decode rows (M <= 64) are timed from CUDA
graph replays (triton.testing.do_bench_cudagraph: the engine replays decode graphs, and eager timing of a one-row GEMM
measures the host's launch), the others eagerly (triton.testing.do_bench). Decode rows are reported as the fraction
of copy bandwidth the FP8 weight bytes reach (W8A8, the engine's decode path, and W8A16), the others as TFLOP/s and
the speed-up over bf16.
End to end (--model-path, a checkpoint written by `scripts/make_slice_checkpoint.py ... --quantize`): one prefill of
--tokens random tokens through each engine, logits of every position; top-1 agreement and mean |logprob diff| of the
next tokens (teacher forced): FP8 vs dequantized in bf16 (also as forwards of 64 rows, the decode kernels) and in
fp32, and the bf16 noise floor of the same comparison (the dequantized engine against itself with other GEMM shapes).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

# (name, N per group, K, groups) of Flash's FP8 linears (hidden 4096, q_lora 1024, 64 heads x 512, 8 o-groups x 1024,
# indexer 64 heads x 128)
SHAPES = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1), ("wo_a", 1024, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("indexer.wq_b", 8192, 1024, 1),
          ("wq_kv_a", 1536, 4096, 1)]  # wq_a and wkv joined after loading (layers/fused_linear.py): the engine's


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200)
    return 2 * src.numel() / (ms * 1e-3)


def timed(fn, m: int) -> float:
    """ms per call: replayed from a CUDA graph for decode rows (as the engine runs them), eager for prefill rows."""
    if m <= 64:
        return triton.testing.do_bench_cudagraph(fn, rep=100)
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def kernel_rows() -> list:
    from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_block_gemm
    from sgl_kernel.dsv4_fp8_gemm_ref import dequant_weight_ref
    from sglang.srt.layers.quantization.fp8 import cublas_blockwise_ok, cublas_w8a8, fp8_linear, fp8_path

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for name, n, k, groups in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(groups * n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.full((triton.cdiv(groups * n, 128), triton.cdiv(k, 128)), 2.0 ** -10, device="cuda")
        wb = dequant_weight_ref(w, ws).bfloat16().view(groups, n, k)
        for m in (1, 32, 256, 1024, 4096, 8192):
            x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
            xg = x.view(m, groups, k).transpose(0, 1)  # [G, M, K]
            bf16 = (lambda: torch.matmul(x, wb[0].T)) if groups == 1 else (lambda: torch.bmm(xg, wb.transpose(1, 2)))
            t_bf16 = timed(bf16, m)
            t_w8a8 = timed(lambda: dsv4_fp8_block_gemm(x, w, ws, groups), m)
            t_w8a16 = timed(lambda: dsv4_fp8_block_gemm(x, w, ws, groups, quantize_act=False), m)
            t_engine = timed(lambda: fp8_linear(x, w, ws, groups), m)
            flops = 2 * m * groups * n * k
            cublas = {}
            if m > 64 and cublas_blockwise_ok(x.device, n, k):  # the engine's prefill path where cuBLAS has it
                t_cublas = triton.testing.do_bench(lambda: cublas_w8a8(x, w, ws, groups), warmup=25, rep=100)
                ref = dsv4_fp8_block_gemm(x, w, ws, groups).float()
                got = cublas_w8a8(x, w, ws, groups).float()
                cublas = {"cublas_w8a8_ms": t_cublas, "cublas_speedup_vs_bf16": t_bf16 / t_cublas,
                          "cublas_tflops": flops / t_cublas / 1e9,
                          "cublas_vs_triton_w8a8_rel_err": ((got - ref).norm() / ref.norm()).item()}
            row = {"name": name, "m": m, "n": groups * n, "k": k, "groups": groups, "bf16_ms": t_bf16,
                   "w8a8_ms": t_w8a8, "w8a16_ms": t_w8a16, "engine_ms": t_engine,
                   "engine_speedup_vs_bf16": t_bf16 / t_engine,
                   "engine_path": fp8_path(m, n, k, groups, x.dtype, x.device, graph=m <= 64),  # graphs: m <= 64
                   "w8a8_tflops": flops / t_w8a8 / 1e9,
                   "bf16_tflops": flops / t_bf16 / 1e9, "speedup_vs_bf16": t_bf16 / t_w8a8,
                   "w8a8_weight_bw_fraction": w.numel() / (t_w8a8 * 1e-3) / bw,
                   "w8a16_weight_bw_fraction": w.numel() / (t_w8a16 * 1e-3) / bw, "graph_replay": m <= 64, **cublas}
            rows.append(row)
            print(f"{name:13s} M {m:5d} N {groups * n:6d} K {k:5d}: bf16 {t_bf16 * 1e3:8.1f} us "
                  f"({row['bf16_tflops']:6.1f} TF/s) | W8A8 {t_w8a8 * 1e3:8.1f} us ({row['w8a8_tflops']:6.1f} TF/s, "
                  f"{row['speedup_vs_bf16']:.2f}x, weight bytes at {row['w8a8_weight_bw_fraction']:.2f} of copy bw) | "
                  f"W8A16 {t_w8a16 * 1e3:8.1f} us ({row['w8a16_weight_bw_fraction']:.2f} of copy bw) | "
                  f"engine path ({row['engine_path']}) {t_engine * 1e3:8.1f} us "
                  f"({row['engine_speedup_vs_bf16']:.2f}x)" + (
                      f" | cuBLAS W8A8 {cublas['cublas_w8a8_ms'] * 1e3:8.1f} us ({cublas['cublas_tflops']:6.1f} TF/s, "
                      f"{cublas['cublas_speedup_vs_bf16']:.2f}x, vs Triton W8A8 "
                      f"{cublas['cublas_vs_triton_w8a8_rel_err']:.1e})" if cublas else ""), flush=True)
    return rows


def all_logits(engine, ids: list, chunk: int = 0) -> torch.Tensor:
    """Logits [T, V] of EXTEND forwards over `ids` (one, or one per `chunk` tokens) of a fresh request, freed after."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    runner = engine.model_runner
    alloc = runner.token_allocator.alloc_req()
    out = []
    try:
        step = chunk or len(ids)
        for start in range(0, len(ids), step):
            part = ids[start:start + step]
            slots = runner.token_allocator.extend_batch([alloc], [start + len(part)])
            fb = ForwardBatch.build(ForwardMode.EXTEND, part, [alloc.req_pool_idx], [start], [len(part)], slots,
                                    runner.device, return_all_logits=True)
            out.append(runner.forward(fb).all_logits.float())
        return torch.cat(out)
    finally:
        runner.token_allocator.free_req(alloc)


def engine_logits(model_path: str, tokens: int, **kw) -> tuple:
    """(logits [T, V] of one forward over `tokens` + 1 seeded random ids minus the last, the ids, weight GB)."""
    import sglang

    args = dict(model_path=model_path, log_level="warning", max_running_requests=4, context_length=8192,
                chunked_prefill_size=8192, disable_cuda_graph=True)
    chunk = kw.pop("chunk", 0)
    eng = sglang.Engine(**{**args, **kw})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, eng.model_runner.model_config.vocab_size, (tokens + 1,), generator=g).tolist()
    logits = all_logits(eng, ids[:-1], chunk)
    gb = eng.model_runner.weight_bytes / 1e9
    eng.shutdown()
    return logits, ids, gb


def compare(model_path: str, tokens: int, a: dict, b: dict, label: str) -> dict:
    """Top-1 agreement and |logprob diff| of the next tokens (teacher forced) between engines `a` and `b`."""
    la, ids, gb_a = engine_logits(model_path, tokens, **a)
    lb, _, gb_b = engine_logits(model_path, tokens, **b)
    out = {"label": label, "a": a, "b": b, "tokens": tokens, "weight_gb_a": gb_a, "weight_gb_b": gb_b,
           **logprob_agreement(la, lb, ids)}
    print(f"{label} ({tokens} teacher-forced tokens): top-1 agreement {out['top1_agreement']:.4f}, mean |logprob "
          f"diff| {out['mean_abs_logprob_diff']:.2e} (max {out['max_abs_logprob_diff']:.2e}); weights "
          f"{gb_a:.2f} vs {gb_b:.2f} GB", flush=True)
    return out


def logprob_agreement(la: torch.Tensor, lb: torch.Tensor, ids: list) -> dict:
    """Top-1 agreement of logits `la` and `lb` [T, V] and the mean / max |logprob diff| of the next tokens ids[1:]."""
    target = torch.tensor(ids[1:], device=la.device)[:, None]
    diff = (torch.log_softmax(la, -1).gather(1, target) - torch.log_softmax(lb, -1).gather(1, target)).abs()
    return {"top1_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "mean_abs_logprob_diff": diff.mean().item(), "max_abs_logprob_diff": diff.max().item()}


def end_to_end(model_path: str, tokens: int) -> list:
    """FP8 vs dequantized in bf16 (one forward: the prefill kernels; forwards of 64 rows: the decode / verify
    kernels, W8A8) and in fp32, and the bf16 noise floor: the dequantized engine against itself with the prompt run as
    forwards of 256 tokens (other GEMM shapes, so other bf16 rounding)."""
    return [compare(model_path, tokens, {"quantization": "fp8"}, {"quantization": "none"}, "fp8 vs dequantized, bf16"),
            compare(model_path, tokens, {"quantization": "fp8", "chunk": 64}, {"quantization": "none", "chunk": 64},
                    "fp8 vs dequantized, bf16, forwards of 64 rows (W8A8)"),
            compare(model_path, tokens, {"quantization": "fp8", "dtype": "float32"},
                    {"quantization": "none", "dtype": "float32"}, "fp8 vs dequantized, fp32"),
            compare(model_path, tokens, {"quantization": "none"}, {"quantization": "none", "chunk": 256},
                    "bf16 noise floor: dequantized, one forward vs forwards of 256 tokens")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name()}
    if not args.skip_kernels:
        out["kernels"] = kernel_rows()
        prefill = [r["speedup_vs_bf16"] for r in out["kernels"] if r["m"] >= 4096]
        print(f"prefill shapes: W8A8 / bf16 speed-up median {statistics.median(prefill):.2f}x")
        engine = [r["engine_speedup_vs_bf16"] for r in out["kernels"] if r["m"] >= 4096]
        print(f"prefill shapes: engine path / bf16 speed-up median {statistics.median(engine):.2f}x, "
              f"min {min(engine):.2f}x")
    if args.model_path:
        out["end_to_end"] = end_to_end(args.model_path, args.tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
