"""Registers, local-memory stack (spills) and shared memory of the fused MoE kernels' launches, compiled for an sm90
GPU without one (Triton's bundled ptxas and cuobjdump): register pressure can be read on a CPU-only machine, with the
Triton that is installed (3.6 on our H200 image; the numbers in RESULTS.md name the version).

    python benchmark/kernels/moe_registers.py [--tokens 1 8 32] [--tma both] [--sass] [--warps 4 8] [--stages 3 5]
        [--maxnreg 128 96] [--planes]

Each launch of `moe_config` for the token counts (Flash: 256 experts, top-6, bf16 activations, the scaled dot of
dsv4_moe_general's kernels), with the codes read by pointers and through TMA descriptors (MoeLaunch.tma); --planes: the
decode launches of the PTX parity planes instead (MoeLaunch.planes, dsv4_moe_planes' kernels: the engine's on NVIDIA
GPUs from 9 tokens; prefill sizes keep the scaled dot). 255 registers with a stack means the compiler spilled; fewer
registers leave room for more programs per SM (65,536 registers per SM on an H100 / H200). --sass adds the K loop's
instruction mix: instructions per thread and iteration over the weights each thread upcasts is the issue cost per weight
that bounds the decode launches (RESULTS.md "MoE kernels").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from sgl_kernel import dsv4_moe_general as general
from sgl_kernel import dsv4_moe_planes as planes
from sgl_kernel.dsv4_moe import moe_config

# argument types by name (pointer element types; every other runtime argument is an int32 but `limit`)
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8",
            "wts_ptr": "*fp32", "out_ptr": "*fp32"}


def signature(kernel, consts: dict, desc_block) -> dict:
    """Each runtime argument's type as the engine's launches pass them (constexprs named as such)."""
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "w_desc":
            sig[name] = f"tensordesc<u8[{desc_block[0]}, {desc_block[1]}]>" if desc_block else "constexpr"
        else:
            sig[name] = POINTERS.get(name, "fp32" if name == "limit" else "i32")
    if kernel is planes._planes_gate_up_kernel and consts.get("SPLITS", 1) > 1:
        sig["h_ptr"] = "*fp32"  # K splits write their raw fp32 sums; one split the activated bf16 rows
    return sig


def kernels_of(launch) -> tuple:
    """The (gate-up, down) kernels that run `launch`: the parity planes' or the general ones."""
    if launch.planes:
        return planes._planes_gate_up_kernel, planes._planes_down_kernel
    return general._moe_gate_up_kernel, general._moe_down_kernel


def constexprs(block_m: int, launch, tma: bool) -> dict:
    """The constexprs the engine's launch passes (bf16 activations, chunked scale bytes, MXFP4 weights): the planes
    kernels' (dsv4_moe_planes.planes_gate_up / planes_down, PTX and PDL on) or the general kernels' (dsv4_moe_general,
    the scaled dot)."""
    tiles = {"BLOCK_M": block_m, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "PREC": "tf32",
             "SCALE_CHUNKED": True}
    if launch.planes:
        return {**tiles, "SWAP": launch.swap, "PTX": True, "SPLITS": launch.split_k, "PDL": True}
    return {**tiles, "WEIGHT_FP8": False, "A_FMT": "bf16", "TMA": tma}


def compile_sm90(kernel, consts: dict, launch, tma: bool):
    """The launch compiled for sm90, specialized as the JIT specializes it at Flash's sizes: every pointer and int
    argument divisible by 16 (aligned buffers, widths and strides) but TOPK (6). Without these hints the codes load
    byte by byte and the figures are a different kernel's."""
    consts = dict(consts)
    desc = (launch.block_n, launch.block_k // 2) if tma else None
    if not tma and "w_desc" in kernel.arg_names:
        consts["w_desc"] = None
    sig = signature(kernel, consts, desc)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n not in consts and n not in ("TOPK", "limit", "w_desc")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                   **launch.launch_options()})


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *flags, f.name], capture_output=True, text=True, check=True).stdout


def resources(c) -> str:
    line = next(ln for ln in _tool("cuobjdump", c.asm["cubin"], "-res-usage").splitlines() if "REG:" in ln).split()
    return f"{line[0]} {line[1]} shared {c.metadata.shared} B"


_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def loop_mix(c, top: int = 10) -> str:
    """The SASS of the K loop (the longest backward branch's body): instructions per iteration per thread and the
    most frequent opcodes (the e2m1 upcast shows as PRMT / LOP3 / HMUL2, operand staging as LDS / STS)."""
    instrs = [(int(m.group(1), 16), m.group(2), ln) for ln in _tool("cuobjdump", c.asm["cubin"], "-sass").splitlines()
              if (m := _INSTR.match(ln))]
    best = None
    for addr, op, ln in instrs:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", ln) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and (best is None or addr - int(target.group(1), 16) >
                                                           best[1] - best[0]):
            best = (int(target.group(1), 16), addr)
    if best is None:
        return "no loop"
    ops = collections.Counter(op for addr, op, _ in instrs if best[0] <= addr <= best[1])
    return f"K loop {sum(ops.values())} instructions: " + " ".join(f"{o} {n}" for o, n in ops.most_common(top))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tma", choices=["off", "on", "both"], default="both")
    ap.add_argument("--sass", action="store_true", help="also the K loop's instruction mix (cuobjdump -sass)")
    ap.add_argument("--warps", type=int, nargs="+", default=[0], help="num_warps to compile (0: moe_config's)")
    ap.add_argument("--planes", action="store_true", help="the parity planes' launches (PTX conversion) instead")
    ap.add_argument("--stages", type=int, nargs="+", default=[0], help="num_stages to compile (0: moe_config's)")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps to compile (0: none)")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm90")
    for t in args.tokens:
        # --planes: moe_config's planes launches at decode sizes (prefill sizes keep the scaled dot's)
        cfg = moe_config(t * 6, 256, tma=not args.planes, planes=args.planes)
        for name, launch in (("gate_up", cfg.gate_up), ("down", cfg.down)):
            kernel = kernels_of(launch)[name == "down"]
            tmas = [False] if launch.planes else {"off": [False], "on": [True], "both": [False, True]}[args.tma]
            for tma, warps, stages, cap in itertools.product(tmas, args.warps, args.stages, args.maxnreg):
                launch_t = dataclasses.replace(launch, tma=tma, num_warps=warps or launch.num_warps,
                                               num_stages=stages or launch.num_stages, maxnreg=cap or launch.maxnreg)
                c = compile_sm90(kernel, constexprs(cfg.block_m, launch, tma), launch_t, tma)
                print(f"tokens {t:4d} {name:8s} {launch_t}: {resources(c)}", flush=True)
                if args.sass:
                    print(f"      {loop_mix(c)}", flush=True)


if __name__ == "__main__":
    main()
