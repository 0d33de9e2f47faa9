"""Benchmark of the attention front's norms and RoPE (dsv4_qk_norm_rope) on DeepSeek-V4-Flash rows, against the path
it replaces and the torch path, with the launches each makes per call.

    python benchmark/kernels/bench_dsv4_attn_front.py            # GPU: times, launches, copy bandwidth
    python benchmark/kernels/bench_dsv4_attn_front.py --count     # launches only (runs on a CPU, interpreted)

Cases, T = 1, 8, 32, 128 rows: the query [T, 64, 512] as split from the joined wq_b + indexer wq_b output (rows
64 * 512 + 64 * 128 apart), unweighted per-head norm, rope 64; the K=V vector [T, 512] as split from the joined
wq_a + wkv output, kv_norm's weight. Paths: "fused" one dsv4_qk_norm_rope launch; "two kernels" dsv4_rms_norm then
dsv4_rope (the GPU path before); "torch" the CPU path's torch code on the GPU. bytes_moved = rows read + rows
written (bf16) + the weight; `baseline_us` = the two-kernel path.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sgl_kernel.dsv4_qk_norm_rope import dsv4_qk_norm_rope
from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm
from sgl_kernel.dsv4_rope import dsv4_rope
from sglang.srt.configs.deepseek_v4 import YarnScaling
from sglang.srt.layers.rotary import RotaryEmbedding, apply_rotary

try:
    from .common import BenchRow, copy_bandwidth_gbps, time_cuda_us
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import BenchRow, copy_bandwidth_gbps, time_cuda_us

H, DH, ROPE, INDEX_WIDTH, Q_LORA = 64, 512, 64, 64 * 128, 1024
EPS = 1e-6
ROWS = (1, 8, 32, 128)
# aten ops that launch nothing (views, metadata, allocations)
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "split", "split_with_sizes",
              "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "alias", "detach", "empty", "empty_like",
              "empty_strided", "new_empty", "lift_fresh", "_to_copy_noop"}


class _AtenCounter(TorchDispatchMode):
    """The aten ops run inside, those that launch a kernel (every op but views and allocations)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Launches:
    torch_ops: int
    triton: int
    detail: str

    @property
    def total(self) -> int:
        return self.torch_ops + self.triton


def count_launches(fn: Callable[[], object]) -> Launches:
    """Kernels one fn() call launches: torch's (TorchDispatchMode) plus Triton's (JITFunction / the interpreter's
    run patched; the dispatch mode is off inside a Triton run, whose launch takes raw pointers)."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    triton_runs = collections.Counter()
    patched = []
    for cls in (jit.JITFunction, getattr(interp, "InterpretedFunction", None)):
        if cls is None or "run" not in vars(cls):
            continue
        real = vars(cls)["run"]

        def run(self, *args, _real=real, **kwargs):
            triton_runs[getattr(self, "__name__", None) or self.fn.__name__] += 1
            with _disable_current_modes():  # the interpreter's own tensor copies are not launches
                return _real(self, *args, **kwargs)
        setattr(cls, "run", run)
        patched.append((cls, real))
    try:
        with _AtenCounter() as counter:
            fn()
    finally:
        for cls, real in patched:
            setattr(cls, "run", real)
    detail = ", ".join(f"{k} {v}" for k, v in (counter.ops + triton_runs).items())
    return Launches(sum(counter.ops.values()), sum(triton_runs.values()), detail)


def _torch_path(x, weight, positions, rot):
    """The CPU path's torch code (norm.rms_normalize / RMSNorm, then rotary.apply_rotary), run where x lives."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    y = (y if weight is None else weight.float() * y).to(x.dtype)
    return apply_rotary(y, *rot.cos_sin(positions))


@dataclass
class Case:
    name: str
    x: torch.Tensor
    weight: object
    positions: torch.Tensor

    def paths(self, rot) -> dict:
        x, w, p = self.x, self.weight, self.positions
        return {"fused": lambda: dsv4_qk_norm_rope(x, w, EPS, p, rot.inv_freq),
                "two kernels": lambda: dsv4_rope(dsv4_rms_norm(x, w, EPS), p, rot.inv_freq),
                "torch": lambda: _torch_path(x, w, p, rot)}


def cases(t: int, device: str) -> list:
    g = torch.Generator().manual_seed(t)
    joined_b = torch.randn(t, H * DH + INDEX_WIDTH, generator=g).to(device, torch.bfloat16)
    joined_a = torch.randn(t, Q_LORA + DH, generator=g).to(device, torch.bfloat16)
    weight = torch.randn(DH, generator=g).to(device)
    positions = torch.randint(0, 1 << 16, (t,), generator=g).to(device)
    return [Case(f"q T={t}", joined_b[:, :H * DH].view(t, H, DH), None, positions),
            Case(f"kv T={t}", joined_a[:, Q_LORA:], weight, positions)]


def rotary(device: str) -> RotaryEmbedding:
    yarn = YarnScaling(factor=16.0, original_max_position_embeddings=65536)
    return RotaryEmbedding(ROPE, 160000.0, yarn).to(device)


def bench() -> list:
    rot = rotary("cuda")
    rows = []
    for t in ROWS:
        for case in cases(t, "cuda"):
            paths = case.paths(rot)
            launches = {name: count_launches(fn).total for name, fn in paths.items()}
            us = {name: time_cuda_us(fn) for name, fn in paths.items()}
            same = torch.equal(paths["fused"](), paths["two kernels"]())
            moved = 2 * case.x.numel() * case.x.element_size() + (0 if case.weight is None else 4 * DH)
            rows.append(BenchRow(kernel="dsv4_qk_norm_rope", case=case.name, time_us=us["fused"], bytes_moved=moved,
                                 baseline_us=us["two kernels"],
                                 note=f"torch {us['torch']:.1f} us; launches fused {launches['fused']}, two kernels "
                                      f"{launches['two kernels']}, torch {launches['torch']}; bit-equal to the two "
                                      f"kernels: {same}"))
    return rows


def print_counts(device: str) -> None:
    rot = rotary(device)
    for t in (1, 8):
        for case in cases(t, device):
            for name, fn in case.paths(rot).items():
                n = count_launches(fn)
                print(f"{case.name:9s} {name:12s} {n.total:3d} launches: {n.detail}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", action="store_true", help="launches per call only (CPU: the Triton interpreter)")
    args = ap.parse_args()
    if args.count or not torch.cuda.is_available():
        print_counts("cuda" if torch.cuda.is_available() else "cpu")
        return
    copy = copy_bandwidth_gbps()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s (read + write)")
    for r in bench():
        print(f"{r.case:9s} fused {r.time_us:6.2f} us {r.gbps():6.0f} GB/s ({r.gbps() / copy:5.1%} of copy)  "
              f"two kernels {r.baseline_us:6.2f} us  {r.note}")


if __name__ == "__main__":
    main()
