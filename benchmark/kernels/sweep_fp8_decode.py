"""Launch configurations of the FP8 block GEMM (sgl_kernel.dsv4_fp8_gemm) at decode rows, on a GPU: per Flash
FP8 linear of a decode step and 1, 8, 32, 128 rows, the fastest configuration against today's rule, as a fraction of
the same run's copy bandwidth, and the winners as the Python table the kernel takes (FP8_GEMM_TUNED).

    python benchmark/kernels/sweep_fp8_decode.py [--rows 1 8 32 128] [--shapes wo_a wo_b] [--jobs 12] [--out r.json]
    TRITON_INTERPRET=1 python benchmark/kernels/sweep_fp8_decode.py --dry-run   (CPU: tiny shapes, wall-clock "times")

Above 64 rows only the shapes the engine runs through this kernel in CUDA graphs (wo_a; --all-paths: all).
The GEMM alone, of rows already quantized (the engine's RMSNorm and inverse RoPE hand them over quantized), W8A8.
Timed as CUDA-graph replays of 16+ launches cycling over copies of the weight that together pass twice the L2, so
each launch reads its weight from HBM as in a decode step (one weight replayed alone stays in L2: 6-42 MB of 50).
The grid, pruned in two stages per (shape, rows):
  1. BLOCK_M (by rows) x BLOCK_N 32/64/128 x K splits for 0 (none)/1/2/4/8 programs per SM x TMA weight copies
     off/on (sm90+), at the rule's warps and stages;
  2. num_warps 2/4/8 x num_stages 3/4/6 at stage 1's best.
BLOCK_K stays the scale block, 128. (Compiled for sm90, the pointer-load tiles keep one weight tile in shared memory
whatever num_stages says, their 64-bit address tensors taking 170-255 registers; the TMA tiles are pipelined over
num_stages: hence TMA in stage 1, beside the tiles it changes.) Then the rule's configuration and the winner,
alternated 3 rounds, give the gain; a winner listed in the table gains at least --min-gain. Compiles run first in a
pool of processes (Triton's disk cache serves the timing process). Stage 2 records whether each configuration's bits
equal stage 1's best (same tile and splits: only warps and stages differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

from sgl_kernel.dsv4_fp8_gemm import (
    Fp8GemmConfig, Fp8GemmTuned, _default_config, _launch, _splits, _tma_supported, dsv4_fp8_act_quant)

# The six FP8 linears of a flash-12l256e decode layer: name, N per group, K, groups
SHAPES = [("wq_kv_a", 1536, 4096, 1), ("wq_b_indexer", 40960, 1024, 1), ("wo_a", 1024, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("shared_w13", 4096, 4096, 1), ("shared_w2", 4096, 2048, 1)]
DRY_SHAPES = [("tiny", 80, 1000, 2), ("tiny_wide", 200, 384, 1)]
ROWS = [1, 8, 32, 128]
BLOCK_N = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (3, 4, 6)
PROGRAMS_PER_SM = (0, 1, 2, 4, 8)


# row tiles per rows (the MMA's minimum 16 up to the rows; the rule's configuration is always timed too)
BLOCK_M = {1: (16,), 8: (16,), 32: (16, 32), 64: (32, 64), 128: (64, 128)}


def stage1(rows: int, tma: bool) -> list:
    """BLOCK_M x BLOCK_N x programs per SM x TMA (where `tma`), at the rule's warps and stages for the row tile."""
    out = []
    for bm in BLOCK_M.get(rows, (16, _default_config(rows, 1).block_m)):
        warps, stages = (8, 3) if bm == 128 else (4, 4)
        out += [Fp8GemmConfig(bm, bn, warps, stages, p, t) for bn in BLOCK_N for p in PROGRAMS_PER_SM
                for t in ((False, True) if tma else (False,))]
    return out


def stage2(best: Fp8GemmConfig) -> list:
    return [dataclasses.replace(best, num_warps=w, num_stages=s) for w in WARPS for s in STAGES]


def label(c: Fp8GemmConfig) -> str:
    return (f"M{c.block_m} N{c.block_n} w{c.num_warps} s{c.num_stages} p{c.programs_per_sm}"
            + (" tma" if c.tma else ""))


def table_source(winners: list, header: str = "") -> str:
    """The winners [(Fp8GemmTuned, note)] as the FP8_GEMM_TUNED assignment to paste into dsv4_fp8_gemm.py."""
    lines = [f"FP8_GEMM_TUNED = ({'  # ' + header if header else ''}"]
    for e, note in winners:
        c = e.config
        lines.append(f"    Fp8GemmTuned({e.n}, {e.k}, {e.groups}, {e.rows}, Fp8GemmConfig({c.block_m}, {c.block_n}, "
                     f"{c.num_warps}, {c.num_stages}, {c.programs_per_sm}, {c.tma})),{'  # ' + note if note else ''}")
    return "\n".join(lines + [")"])


_WEIGHTS: dict = {}


def weights(n: int, k: int, groups: int, device: str, copies: int = 1) -> tuple:
    """([copies of a random e4m3 weight [G * N, K]], its multipliers), made once per process and shape."""
    key = (n, k, groups, device)
    if key not in _WEIGHTS or len(_WEIGHTS[key][0]) < copies:
        g = torch.Generator(device=device).manual_seed(n + k)
        w = (torch.randn(groups * n, k, device=device, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.full((-(-groups * n // 128), -(-k // 128)), 2.0 ** -10, device=device)
        _WEIGHTS[key] = ([w] + [w.clone() for _ in range(copies - 1)], ws)
    return _WEIGHTS[key]


def quantized_rows(rows: int, k: int, groups: int, device: str) -> tuple:
    x = torch.randn(rows, groups * k, device=device, generator=torch.Generator(device=device).manual_seed(rows))
    return dsv4_fp8_act_quant(x.bfloat16() if device == "cuda" else x, groups)


def compile_job(job: tuple) -> str:
    """Pool worker: one launch of (shape, rows, config), compiling it into Triton's disk cache; '' or the error."""
    (n, k, groups), rows, config = job
    try:
        w, ws = weights(n, k, groups, "cuda")
        a, a_s = quantized_rows(rows, k, groups, "cuda")
        _launch(a, a_s, w[0], ws, groups, torch.bfloat16, config=config)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - out of shared memory or registers: reported, not timed
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def precompile(jobs: list, pool) -> dict:
    """Compile every (shape, rows, config) in the pool's processes; returns {job: error} for those that failed."""
    return {job: err for job, err in zip(jobs, pool.map(compile_job, jobs, chunksize=4)) if err} if pool else {}


def replay_us(calls: list, rounds: int, graphs: bool) -> float:
    """Median time per call of `calls` run in order: CUDA-graph replays on a GPU, wall clock in a dry run."""
    if not graphs:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    for c in calls:
        c()  # compiled (from the disk cache), split counters allocated: nothing left to do during capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


class Shape:
    """One linear at one row count: its configurations' times, each over launches on weight copies past the L2."""

    def __init__(self, name: str, n: int, k: int, groups: int, rows: int, device: str, rounds: int) -> None:
        self.name, self.n, self.k, self.groups, self.rows, self.rounds = name, n, k, groups, rows, rounds
        self.graphs = device == "cuda"
        weight_bytes = groups * n * k
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if self.graphs else 1
        copies = max(1, math.ceil(2 * l2 / weight_bytes)) if self.graphs else 1
        self.ws_list, self.ws = weights(n, k, groups, device, copies)
        self.a, self.a_s = quantized_rows(rows, k, groups, device)
        self.calls = max(16, copies) if self.graphs else 2
        self.bytes = weight_bytes + self.ws.numel() * 4 + self.a.numel() + self.a_s.numel() * 4 + rows * groups * n * 2
        self.tried: dict = {}  # config -> its JSON row
        self.rule = _default_config(rows, 1)
        self.best: dict = {}  # stage -> its best config

    def run(self, config: Fp8GemmConfig, copy: int = 0) -> torch.Tensor:
        return _launch(self.a, self.a_s, self.ws_list[copy % len(self.ws_list)], self.ws, self.groups,
                       torch.bfloat16, config=config)

    def time(self, config: Fp8GemmConfig) -> float:
        calls = [lambda i=i: self.run(config, i) for i in range(self.calls)]
        return replay_us(calls, self.rounds, self.graphs)

    def distinct(self, configs: list) -> list:
        """The configurations that launch differently: programs per SM that give the same K splits launch alike."""
        seen, out = set(), []
        for c in configs:
            tiles = triton.cdiv(self.n, c.block_n) * triton.cdiv(self.rows, c.block_m) * self.groups
            kb = triton.cdiv(self.k, 128)
            splits = triton.cdiv(kb, triton.cdiv(kb, _splits(tiles, kb, self.a.device, c.programs_per_sm)))
            key = dataclasses.replace(c, programs_per_sm=splits)  # as _launch computes them
            if key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def time_all(self, configs: list, failed: dict, ref=None) -> Fp8GemmConfig:
        """Times the configurations not yet timed (those that compiled); the fastest of `configs`. With `ref`, whether
        each one's output equals it bit for bit."""
        for c in configs:
            if c in self.tried or ((self.n, self.k, self.groups), self.rows, c) in failed:
                continue
            out = self.run(c)
            self.tried[c] = {"config": dataclasses.asdict(c), "us": self.time(c),
                             "same_bits_as_stage1_best": None if ref is None else bool(torch.equal(out, ref))}
        return min((c for c in configs if c in self.tried), key=lambda c: self.tried[c]["us"])


def engine_path(n: int, k: int, groups: int, rows: int, device: str) -> str:
    if device != "cuda":
        return "w8a8"
    from sglang.srt.layers.quantization.fp8 import fp8_path

    return fp8_path(rows, n, k, groups, torch.bfloat16, torch.device(device), graph=True)


def compare(s: Shape, best: Fp8GemmConfig, copy_gbps: float, device: str) -> dict:
    """The rule's configuration and the winner, 3 alternated rounds each (drift in clocks or neighbours hits both)."""
    rounds = {s.rule: [], best: []}
    for _ in range(3):
        for c in rounds:
            rounds[c].append(s.time(c))
    rule_us, best_us = statistics.median(rounds[s.rule]), statistics.median(rounds[best])
    frac = lambda us: s.bytes / (us * 1e-6) / 1e9 / copy_gbps  # noqa: E731
    return {"name": s.name, "n": s.n, "k": s.k, "groups": s.groups, "rows": s.rows,
            "engine_path": engine_path(s.n, s.k, s.groups, s.rows, device), "bytes": s.bytes,
            "rule": dataclasses.asdict(s.rule), "rule_us": rule_us, "rule_frac_copy": frac(rule_us),
            "best": dataclasses.asdict(best), "best_us": best_us, "best_frac_copy": frac(best_us),
            "gain": rule_us / best_us,
            "bits_differ_from_stage1_best": [label(c) for c, t in s.tried.items()
                                             if t["same_bits_as_stage1_best"] is False],
            "tried": list(s.tried.values())}


def main() -> None:
    global WARPS, STAGES
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--shapes", nargs="+", default=None, help="names of SHAPES to sweep (default all)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--all-paths", action="store_true",
                    help="above 64 rows also the shapes the engine runs through cuBLAS or dequantize + GEMM")
    ap.add_argument("--rounds", type=int, default=10, help="graph replays per timing (median)")
    ap.add_argument("--min-gain", type=float, default=1.03, help="table entries only for winners this much faster")
    ap.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, 1 and 8 rows")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    device = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else [s for s in SHAPES if args.shapes is None or s[0] in args.shapes]
    rows_list = [r for r in args.rows if r <= 8] if args.dry_run else args.rows
    copy_gbps = 1.0
    if args.dry_run:
        WARPS, STAGES = (4,), (4,)  # the interpreter ignores them: one each keeps the dry run short
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps()
        log(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    tma = _tma_supported(torch.device(device))
    workers = 0 if args.dry_run else args.jobs  # the interpreter compiles nothing
    pool = None
    if workers:
        import multiprocessing

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    key = lambda s: (s.n, s.k, s.groups)  # noqa: E731

    found = [Shape(name, n, k, g, r, device, args.rounds) for name, n, k, g in shapes for r in rows_list
             if r <= 64 or args.all_paths or engine_path(n, k, g, r, device) == "w8a8"]
    first = {s: s.distinct([s.rule] + stage1(s.rows, tma and s.k % 16 == 0)) for s in found}
    jobs = [(key(s), s.rows, c) for s in found for c in first[s]] if workers else []
    failed = precompile(jobs, pool)
    log(f"stage 1: {len(jobs)} launches compiled ({len(failed)} failed"
        + (f", e.g. {next(iter(failed.values()))}" if failed else "") + f") in {workers} processes")
    for s in found:
        s.best[1] = s.time_all(first[s], failed)
        log(f"{s.name} [{s.n} x {s.k}] x {s.groups} at {s.rows} rows: stage 1 best {label(s.best[1])} "
            f"{s.tried[s.best[1]]['us']:.1f} us, rule {label(s.rule)} {s.tried[s.rule]['us']:.1f} us")
    jobs = [(key(s), s.rows, c) for s in found for c in stage2(s.best[1])] if workers else []
    failed.update(precompile(jobs, pool))
    if pool:
        pool.shutdown()
    log(f"stage 2: {len(jobs)} launches compiled")
    results, winners = [], []
    for s in found:
        best = s.time_all(stage2(s.best[1]), failed, ref=s.run(s.best[1]))
        row = compare(s, best, copy_gbps, device)
        results.append(row)
        differ = row["bits_differ_from_stage1_best"]
        log(f"{s.name:13s} {s.rows:3d} rows [{row['engine_path']}]: rule {label(s.rule)} {row['rule_us']:7.1f} us "
            f"({row['rule_frac_copy']:.2f} of copy) -> {label(best)} {row['best_us']:7.1f} us "
            f"({row['best_frac_copy']:.2f}), {row['gain']:.2f}x"
            + (f"; bits differ at {len(differ)} warps/stages" if differ else ""))
        if row["gain"] >= args.min_gain and best != s.rule:
            winners.append((Fp8GemmTuned(s.n, s.k, s.groups, s.rows, best),
                            f"{s.name}: {row['gain']:.2f}x, {row['best_frac_copy']:.2f}"))
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu dry run"
    table = table_source(winners, f"sweep_fp8_decode.py, {device_name}: gain, fraction of copy bandwidth")
    print(table)
    if failed:
        print(f"{len(failed)} launches did not compile or run, e.g. {next(iter(failed.values()))}")
    log("done")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "copy_gbps": copy_gbps, "results": results, "table": table,
                       "failed": [[label(c), list(shape), rows, err] for (shape, rows, c), err in failed.items()]},
                      f, indent=1)


if __name__ == "__main__":
    main()
