"""Registers, local-memory stack (spills) and shared memory of the fused MoE kernels' launches, compiled for an sm90
GPU without one (Triton's bundled ptxas and cuobjdump): register pressure can be read on a CPU-only machine, with the
Triton that is installed (3.6 on our H200 image; the numbers in RESULTS.md name the version).

    python benchmark/kernels/moe_registers.py [--tokens 1 8 32] [--tma both]

Each launch of `moe_config` for the token counts (Flash: 256 experts, top-6, bf16 activations, the scaled dot), with
the codes read by pointers and through TMA descriptors (MoeLaunch.tma). 255 registers with a stack means the compiler
spilled; fewer registers leave room for more programs per SM (65,536 registers per SM on an H100 / H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from sgl_kernel import dsv4_moe_mxfp4 as moe

# argument types by name (pointer element types; every other runtime argument is an int32 but `limit`)
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8",
            "wts_ptr": "*fp32", "out_ptr": "*fp32"}


def signature(kernel, consts: dict, desc_block) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "w_desc":
            sig[name] = f"tensordesc<u8[{desc_block[0]}, {desc_block[1]}]>" if desc_block else "constexpr"
        else:
            sig[name] = POINTERS.get(name, "fp32" if name == "limit" else "i32")
    if kernel is moe._moe_gate_up_kernel:
        sig["h_ptr"] = "*bf16"
    return sig


def resources(kernel, consts: dict, launch, tma: bool) -> str:
    consts = dict(consts)
    desc = (launch.block_n, launch.block_k // 2) if tma else None
    if not tma:
        consts["w_desc"] = None
    sig = signature(kernel, consts, desc)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln).split()
    return f"{line[0]} {line[1]} shared {c.metadata.shared} B"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tma", choices=["off", "on", "both"], default="both")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm90")
    common = {"WEIGHT_FP8": False, "SCALE_BCAST": True, "PREC": "tf32", "A_FMT": "bf16"}
    for t in args.tokens:
        cfg = moe.moe_config(t * 6, 256, tma=True)
        for name, kernel, launch, extra in (("gate_up", moe._moe_gate_up_kernel, cfg.gate_up, {"SPLIT_K": 1}),
                                            ("down", moe._moe_down_kernel, cfg.down, {})):
            for tma in {"off": [False], "on": [True], "both": [False, True]}[args.tma]:
                launch_t = dataclasses.replace(launch, tma=tma)
                consts = {**common, **extra, "BLOCK_M": cfg.block_m, "BLOCK_N": launch.block_n,
                          "BLOCK_K": launch.block_k, "TMA": tma}
                print(f"tokens {t:4d} {name:8s} {launch_t}: {resources(kernel, consts, launch_t, tma)}", flush=True)


if __name__ == "__main__":
    main()
