"""The GEMV MoE chain's launches (sgl_kernel.dsv4_moe_gemv) at Flash widths on a GPU, in one process, against the
same run's copy bandwidth. Per token count: the gate-up's tiles, with its gate and up rows in one loop or two (the
down at the default tile), the down's tiles (the gate-up at the default), then the two stages' best tiles together,
each with the chain's variants (early weights, sum in the down, one loop). Each stage's candidates are timed in two
passes, alternated, as CUDA-graph replays, with the parity planes (the engine's decode path past GEMV_MAX_TOKENS) in
every pass. Token counts past GEMV_MAX_TOKENS show whether the GEMVs would win there too (each pair reads its expert's
codes once more).

    python3 benchmark/kernels/sweep_moe_gemv.py [--tokens 1 2 4 8 16 32] [--tiles 4x512 8x512x2 ...] [--out r.json]
    TRITON_INTERPRET=1 python3 benchmark/kernels/sweep_moe_gemv.py --dry-run   (CPU: tiny widths, wall-clock "times")

Tiles are NxK[xW]: N weight rows x K inputs per program, W warps; a launch is "gate-up tile/down tile [variants]".
A candidate whose output differs from the planes' by more than 1% is reported and not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_moe_mxfp4 import copy_bandwidth, random_mxfp4_experts  # noqa: E402

TILES = ["2x512", "2x1024", "4x256", "4x512", "4x1024", "8x256", "8x512", "8x1024", "16x256", "16x512", "4x512x2",
         "4x1024x2", "8x512x2", "16x512x2"]
VARIANTS = [dict(early_weights=bool(early), sum_in_down=bool(fused), gate_up_one_loop=bool(one))
            for early, fused, one in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1))]


def tile(spec: str) -> tuple[int, int, int]:
    n, k, *w = (int(v) for v in spec.split("x"))
    return n, k, (w[0] if w else 1)


def label(launch) -> str:
    name = lambda t: "x".join(map(str, t if t[2] != 1 else t[:2]))  # noqa: E731
    flags = [f for f, on in (("one-loop", launch.gate_up_one_loop), ("early", launch.early_weights),
                             ("sum", launch.sum_in_down)) if on]
    return " ".join([f"{name(launch.gate_up_tile)}/{name(launch.down_tile)}", *flags])


def main() -> None:
    from sgl_kernel.dsv4_moe_gemv import GemvLaunch, gemv_fits, gemv_launch, gemv_moe
    from sgl_kernel.dsv4_moe import dsv4_moe_mxfp4, mxfp4_experts_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--tiles", nargs="+", default=TILES)
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench_cudagraph's rep per timing")
    ap.add_argument("--dry-run", action="store_true", help="CPU (the interpreter): 8 experts, widths 256, top-2")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    e, d, i, k = (8, 256, 256, 2) if args.dry_run else (256, 4096, 2048, 6)
    g = torch.Generator(device=dev).manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    expert_bytes = w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()
    bw = 1e9 if args.dry_run else copy_bandwidth()
    timer = _wall_us if args.dry_run else lambda fn: triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms) * 1e3
    device = "cpu" if args.dry_run else torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device=dev, generator=g)
        x = (torch.randn(t, d, device=dev, generator=g) * 0.05).bfloat16()
        _, experts = mxfp4_experts_of(x, w13, s13, w2, s2)
        planes = lambda: dsv4_moe_mxfp4(x, ids, wts, w13, s13, w2, s2, 10.0, scales_fit_planes=True)  # noqa: E731
        ref = planes().float()
        floor_us = ids.unique().numel() * expert_bytes / bw * 1e6

        def stage(name: str, launches: list) -> list:
            """Each launch checked against the planes, then all timed in two alternated passes; the launches
            fastest first."""
            timed = {"planes": (planes, {"launch": "planes"}, None)}
            for launch in launches:
                if label(launch) in timed or not gemv_fits(launch, d, i):
                    continue
                fn = lambda launch=launch: gemv_moe(x, ids, wts, *experts, 10.0, i, launch=launch)  # noqa: E731
                row = {"launch": label(launch), "relative_difference_vs_planes":
                       ((fn().float() - ref).norm() / ref.norm()).item()}
                if row["relative_difference_vs_planes"] > 1e-2:
                    print(f"  {row['launch']}: differs from the planes by {row['relative_difference_vs_planes']:.1e}"
                          ", not timed", flush=True)
                    rows.append({"tokens": t, "stage": name, **row})
                    continue
                timed[label(launch)] = (fn, row, launch)
            for _ in range(2):
                for fn, row, _launch in timed.values():
                    row.setdefault("us", []).append(timer(fn))
            for _fn, row, _launch in timed.values():
                row.update(tokens=t, stage=name, best_us=min(row["us"]), floor_us=floor_us,
                           fraction_of_copy_bw=floor_us / min(row["us"]))
                rows.append(row)
            if args.out:  # after every stage: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"device": device, "copy_bw": bw, "rows": rows}, f, indent=1)
            order = sorted(timed.values(), key=lambda v: v[1]["best_us"])
            print(f"tokens {t} {name} (floor {floor_us:.1f} us): " + " | ".join(
                f"{r['launch']} {'/'.join(f'{u:.1f}' for u in r['us'])} ({r['fraction_of_copy_bw']:.2f})"
                for _fn, r, _launch in order), flush=True)
            return [launch for _fn, _row, launch in order if launch is not None]

        tiles = [tile(s) for s in args.tiles]
        base = gemv_launch(t)
        if not gemv_fits(base, d, i):  # the dry run's widths: the first tile that fits both kernels
            base = next(launch for n, kk, w in tiles if gemv_fits(launch := GemvLaunch(n, kk, w), d, i))
        gate_ups = [dataclasses.replace(base, block_n=n, block_k=kk, num_warps=w, down=base.down_tile,
                                        gate_up_one_loop=one) for one in (False, True) for n, kk, w in tiles]
        gate_up = stage("gate-up tiles (one loop or two)", [base] + gate_ups)
        down = stage("down tiles", [base] + [dataclasses.replace(base, down=tl_) for tl_ in tiles])
        both = dataclasses.replace(gate_up[0], down=down[0].down_tile, gate_up_one_loop=False)
        stage("variants", [dataclasses.replace(launch, **flags) for launch in (base, both) for flags in VARIANTS])


def _wall_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


if __name__ == "__main__":
    main()
