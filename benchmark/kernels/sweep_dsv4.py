"""Launch-config sweep of the DeepSeek-V4 attention kernels on the GPU (the data behind each `_launch_config`).

For every candidate tiling: check it against the torch reference on one case, then time it (CUDA profiler GPU time)
on decode shapes of DeepSeek-V4-Flash (`--only attention-prefill`: the attention on 8,192-row prefill
chunks). Also measures, in the same run, the two ceilings the kernels are judged
against: the device copy bandwidth and the bf16 matrix-multiply rate (the sparse attention is compute-bound at
H = 64, D = 512: 4 H D = 131 kflop per 584-byte FP8 key row, about the H200's ridge point).

    python benchmark/kernels/sweep_dsv4.py [--out sweep.json] [--only attention,indexer,topk]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsv4_indexer import ROW_BYTES, _logits_args  # noqa: E402
from bench_dsv4_sparse_attention import _args as attention_args  # noqa: E402
from common import copy_bandwidth_gbps, matmul_tflops, time_cuda_us  # noqa: E402

from sgl_kernel.dsv4_index_logits import dsv4_index_logits, dsv4_index_logits_ref  # noqa: E402
import sgl_kernel.dsv4_sparse_attention as sa_mod  # noqa: E402
from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention, dsv4_sparse_attention_ref  # noqa: E402
from sgl_kernel.dsv4_topk import dsv4_topk_slots, dsv4_topk_slots_ref  # noqa: E402

H, D = 64, 512


ATTN_CONFIGS = [dict(BH=64, BN=bn, DV_SPLIT=dv, LOADER=ld, num_warps=w, num_stages=s) for bn, dv, ld, w, s in (
    (32, 2, 1, 4, 1), (16, 2, 1, 4, 1), (16, 2, 1, 8, 1), (32, 2, 1, 8, 1), (32, 2, 1, 8, 2), (32, 2, 1, 4, 2),
    (64, 2, 1, 8, 2))]
ATTN_CASES = [("csa", 1, 65536), ("csa", 8, 65536), ("csa", 32, 65536), ("csa", 128, 65536), ("hca", 8, 1 << 20),
              ("hca", 128, 65536)]
# Prefill: one 8,192-token chunk's rows (each its own top-k list; HCA rows share their request's entries), with the
# cache in bf16 (the engine's default) and FP8, and the tilings with more value columns a program or more stages that
# the decode cases' register pressure ruled out.
ATTN_PREFILL_CASES = [("csa", 8192, 8192), ("hca", 8192, 8192)]
ATTN_PREFILL_CONFIGS = ATTN_CONFIGS + [dict(BH=64, BN=bn, DV_SPLIT=dv, LOADER=1, num_warps=w, num_stages=s)
                                       for bn, dv, w, s in ((64, 2, 4, 1), (64, 2, 8, 1), (32, 1, 8, 1), (16, 1, 8, 1),
                                                            (32, 2, 4, 3))]


def sweep_attention(tflops: float, prefill: bool = False, fp8: bool = True) -> list:
    """Each tiling checked against the reference on one small case, then timed on the decode cases (or the prefill
    ones) with an FP8 (or bf16) cache."""
    rows = []
    check, _ = attention_args("csa", 8, 65536, fp8, "cuda")
    ref = dsv4_sparse_attention_ref(**check).float()
    cases = [(c, *attention_args(*c, fp8, "cuda")) for c in (ATTN_PREFILL_CASES if prefill else ATTN_CASES)]
    for cfg in ATTN_PREFILL_CONFIGS if prefill else ATTN_CONFIGS:
        try:
            err = 0.0
            for splits in (1, 4):
                out = dsv4_sparse_attention(**check, num_splits=splits, launch_config=cfg).float()
                err = max(err, (out - ref).abs().max().item())
            row = dict(config=cfg, kv="fp8" if fp8 else "bf16", max_abs_err=err, cases={})
            for (layer, bs, ctx), args, keys in cases:
                out = torch.empty_like(args["q"])
                us = time_cuda_us(lambda: dsv4_sparse_attention(**args, out=out, launch_config=cfg))
                tf = 4.0 * bs * H * D * keys / (us * 1e-6) / 1e12
                row["cases"][f"{layer} bs={bs} ctx={ctx}"] = dict(us=us, tflops=tf, frac_mm=tf / tflops)
            rows.append(row)
            kernels = list(next(iter(sa_mod._dsv4_sparse_attention_kernel.device_caches.values()))[0].values())
            row["regs_spills"] = [(k.n_regs, k.n_spills) for k in kernels[-2:]]
            if os.environ.get("SWEEP_TTGIR"):
                with open(os.environ["SWEEP_TTGIR"], "a") as f:
                    f.write(f"// ===== {cfg}\n" + kernels[-1].asm.get("ttgir", ""))
            print("attention", row["kv"], cfg, "regs/spills", row["regs_spills"], f"err={err:.3g}",
                  " ".join(f"{k}:{v['us']:.1f}us/{v['frac_mm']:.2f}" for k, v in row["cases"].items()), flush=True)
        except Exception:  # a tiling that does not compile on this GPU: record and go on
            rows.append(dict(config=cfg, error=traceback.format_exc(limit=2)))
            print("attention", cfg, "FAILED", traceback.format_exc(limit=2), flush=True)
    return rows


IDX_DECODE = [dict(BLOCK_T=1, BLOCK_E=be, E_BLOCKS=eb, FP4_GATHER=g, num_warps=w, num_stages=s)
              for be, eb, g, w, s in ((64, 8, False, 4, 3), (64, 8, True, 4, 3), (64, 4, True, 4, 2),
                                      (128, 4, False, 8, 2), (128, 4, True, 8, 2), (128, 2, True, 8, 3),
                                      (32, 16, True, 4, 3), (64, 1, True, 4, 1), (128, 1, True, 8, 1),
                                      (64, 2, False, 4, 2))]
IDX_PREFILL = [dict(BLOCK_T=bt, BLOCK_E=be, E_BLOCKS=eb, FP4_GATHER=g, num_warps=w, num_stages=s)
               for bt, be, eb, g, w, s in ((2, 64, 8, False, 8, 3), (2, 64, 8, True, 8, 3), (4, 64, 8, True, 8, 3),
                                           (4, 64, 4, True, 8, 2), (2, 128, 4, True, 8, 2), (4, 128, 4, True, 8, 2),
                                           (8, 64, 4, True, 8, 2))]


def indexer_case(kind: str, rows: int, width: int, prefill: bool) -> dict:
    args = _logits_args(kind, rows, width, prefill, "cuda")
    lists = args["cand_slots"].shape[0]
    args["bytes"] = lists * width * ROW_BYTES[kind] + args["q"].numel() * 2 + rows * width * 4
    args["flops"] = 2.0 * rows * width * 64 * 128
    return args


def sweep_indexer(copy_gbps: float, tflops: float) -> list:
    rows = []
    for kind in ("fp8", "fp4"):
        for mode, configs, shapes in (("decode", IDX_DECODE, ((1, 262144), (8, 32768), (64, 262144))),
                                      ("prefill", IDX_PREFILL, ((2048, 16896),))):
            cases = [((t, e), indexer_case(kind, t, e, mode == "prefill")) for t, e in shapes]
            chk = indexer_case(kind, 8 if mode == "decode" else 256, 4096, mode == "prefill")
            chk_args = {k: v for k, v in chk.items() if k not in ("out", "bytes", "flops")}
            ref = dsv4_index_logits_ref(out=torch.empty_like(chk["out"]), **chk_args)
            for cfg in configs:
                try:
                    got = dsv4_index_logits(out=torch.empty_like(chk["out"]), launch_config=cfg, **chk_args)
                    fin = torch.isfinite(ref)
                    assert torch.equal(fin, torch.isfinite(got)), "-inf pattern differs"
                    err = ((got[fin] - ref[fin]).abs() / (ref[fin].abs() + 1)).max().item() if fin.any() else 0.0
                    row = dict(kind=kind, mode=mode, config=cfg, max_rel_err=err, cases={})
                    for (t, e), case in cases:
                        args = {k: v for k, v in case.items() if k not in ("bytes", "flops")}
                        us = time_cuda_us(lambda: dsv4_index_logits(launch_config=cfg, **args))
                        row["cases"][f"T={t} E={e}"] = dict(
                            us=us, frac_copy=case["bytes"] / (us * 1e-6) / 1e9 / copy_gbps,
                            frac_mm=case["flops"] / (us * 1e-6) / 1e12 / tflops)
                    rows.append(row)
                    print("indexer", kind, mode, cfg, f"err={err:.3g}",
                          " ".join(f"{k}:{v['us']:.1f}us/bw{v['frac_copy']:.2f}/mm{v['frac_mm']:.2f}"
                                   for k, v in row["cases"].items()),
                          flush=True)
                except Exception:
                    rows.append(dict(kind=kind, mode=mode, config=cfg, error=traceback.format_exc(limit=2)))
                    print("indexer", kind, mode, cfg, "FAILED", traceback.format_exc(limit=2), flush=True)
    return rows


def sweep_topk() -> list:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, e in ((1, 262144), (64, 262144), (1, 65536)):
        logits = torch.randn(t, e, device="cuda", generator=g)
        cand = torch.randperm(e, device="cuda", generator=g)[None, :].expand(t, e).contiguous()
        for k in (512, 1024):
            ref = dsv4_topk_slots_ref(logits, cand, None, k).sort(dim=1).values
            for cpk in (4, 8, 16):
                cfg = dict(CHUNK_PER_K=cpk)
                try:
                    ok = torch.equal(dsv4_topk_slots(logits, cand, None, k, launch_config=cfg).sort(dim=1).values,
                                     ref)
                    us = time_cuda_us(lambda: dsv4_topk_slots(logits, cand, None, k, launch_config=cfg))
                    rows.append(dict(T=t, E=e, k=k, config=cfg, same_as_torch=ok, us=us))
                    print(f"topk T={t} E={e} k={k} {cfg} same={ok} {us:.1f} us", flush=True)
                except Exception:
                    rows.append(dict(T=t, E=e, k=k, config=cfg, error=traceback.format_exc(limit=2)))
                    print("topk", cfg, "FAILED", traceback.format_exc(limit=2), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_dsv4.json")
    ap.add_argument("--only", default="attention,indexer,topk",
                    help="comma-separated: attention, indexer, topk, attention-prefill (8,192-row chunks, bf16 and "
                         "FP8 caches; not in the default)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    copy = copy_bandwidth_gbps()
    tflops = matmul_tflops()
    print(f"copy bandwidth {copy:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_GBps=copy, matmul_tflops=tflops)
    if "topk" in only:
        res["topk"] = sweep_topk()
    if "attention" in only:
        res["attention"] = sweep_attention(tflops)
    if "attention-prefill" in only:
        res["attention_prefill"] = sweep_attention(tflops, prefill=True, fp8=False) + sweep_attention(
            tflops, prefill=True, fp8=True)
    if "indexer" in only:
        res["indexer"] = sweep_indexer(copy, tflops)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
