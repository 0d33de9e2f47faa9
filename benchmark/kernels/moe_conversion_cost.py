"""What the e2m1 conversion costs the MoE's decode kernels: the parity planes' launches timed with the landed PTX and
with cheaper stand-ins of the same shape (same loads, same registers out, wrong values), each variant in its own
process and Triton cache, alternated. If a stand-in with a third of the instructions runs much faster, the
conversion bounds the kernels and a load-time bit layout that converts cheaper pays; if not, the kernels' structure
(operand layouts, latency at few warps) does.

    python3 benchmark/kernels/moe_conversion_cost.py [--tokens 1 8 32] [--rounds 2]

Variants: `landed` (dsv4_mxfp4_planes._PTX: 19 instructions per 8 weights), `relaid` (12: the scale multiplier, one
mask, three shift-and-masks, four bf16x2 multiplies: what a conversion from a load-time layout would cost), `null` (5:
one xor with the scale byte, four masks). Prints gate-up, down and whole-op times (graph replays, us).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

VARIANTS = {
    "relaid": """
{
.reg .b32 m, t;
mad.lo.u32 m, $5, 0x00800080, 0x37003700;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, m;
shl.b32 t, $4, 1;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, m;
shl.b32 t, $4, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, m;
shl.b32 t, $4, 3;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, m;
}
""",
    "null": """
{
.reg .b32 t;
xor.b32 t, $4, $5;
and.b32 $0, t, 0x01C001C0;
and.b32 $1, t, 0x81C081C0;
and.b32 $2, t, 0x01C081C0;
and.b32 $3, t, 0x81C001C0;
}
""",
}


def child(variant: str, tokens: list) -> None:
    import torch
    import triton
    import triton.language as tl

    import sgl_kernel.dsv4_mxfp4_planes as planes
    if variant != "landed":
        planes._PTX = tl.constexpr(VARIANTS[variant])
    from sgl_kernel.dsv4_moe_mxfp4 import dsv4_moe_align, dsv4_moe_mxfp4, moe_config, moe_down, moe_gate_up

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_moe_mxfp4 import random_mxfp4_experts

    e, d, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = random_mxfp4_experts(e, d, i, g)
    out = []
    for t in tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        wts = torch.rand(t, k, device="cuda", generator=g)
        x = (torch.randn(t, d, device="cuda", generator=g) * 0.05).bfloat16()
        cfg = moe_config(t * k, e, planes=True)
        rows, bexp = dsv4_moe_align(ids, e, cfg.block_m)
        h = moe_gate_up(x, rows, bexp, w13, s13, i, k, 10.0, cfg.block_m, cfg.gate_up, False)
        bench = lambda f: min(triton.testing.do_bench_cudagraph(f, rep=100) for _ in range(2)) * 1e3  # noqa: E731
        gu = bench(lambda: moe_gate_up(x, rows, bexp, w13, s13, i, k, 10.0, cfg.block_m, cfg.gate_up, False))
        dn = bench(lambda: moe_down(h, rows, bexp, w2, s2, wts, d, cfg.block_m, cfg.down, False))
        op = bench(lambda: dsv4_moe_mxfp4(x, ids, wts, w13, s13, w2, s2, 10.0, scales_fit_planes=True))
        out.append(f"{t} tok: gate-up {gu:.1f} down {dn:.1f} op {op:.1f}")
    print(f"{variant:7s} " + " | ".join(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["landed", "relaid", "null"])
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.tokens)
    for _ in range(args.rounds):
        for v in args.variants:
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"tc_{v}_"))
            subprocess.run([sys.executable, __file__, "--child", v, "--tokens", *map(str, args.tokens)], env=env,
                           check=True)


if __name__ == "__main__":
    main()
