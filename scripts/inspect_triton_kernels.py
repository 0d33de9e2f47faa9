"""Print register use, spills and the dot lowering (wgmma / mma / FMA) of every compiled variant of the DeepSeek-V4
Triton kernels after running the kernel benchmarks' shapes once; dump each variant's TTGIR into a folder.

    python scripts/inspect_triton_kernels.py OUT_DIR
"""

import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "kernels"))
from bench_dsv4_indexer import _logits_args  # noqa: E402
from bench_dsv4_sparse_attention import _args as attention_args  # noqa: E402

import sgl_kernel.dsv4_index_logits as il  # noqa: E402
import sgl_kernel.dsv4_sparse_attention as sa  # noqa: E402


def report(fn, name: str, out_dir: str) -> None:
    for i, (cache, *_rest) in enumerate(fn.device_caches.values()):
        for j, kernel in enumerate(cache.values()):
            ttgir = kernel.asm.get("ttgir", "")
            dots = {k: len(re.findall(k, ttgir)) for k in ("warp_group_dot", "tt.dot ", "ttng.tc_gen5_mma")}
            fma = len(re.findall(r"tt\.dot .*#blocked", ttgir))
            print(f"{name}[{i}.{j}] regs={kernel.n_regs} spills={kernel.n_spills} shared={kernel.metadata.shared} "
                  f"dots={dots} fma_dots={fma}")
            with open(os.path.join(out_dir, f"{name}_{i}_{j}.ttgir"), "w") as f:
                f.write(ttgir)


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    args, _ = attention_args("csa", 8, 65536, True, "cuda")
    sa.dsv4_sparse_attention(**args)
    sa.dsv4_sparse_attention(**args, launch_config=dict(BH=64, BN=64, DV_SPLIT=2, num_warps=8, num_stages=1))
    report(sa._dsv4_sparse_attention_kernel, "sparse_attention", out_dir)
    for kind in ("fp8", "fp4"):
        il.dsv4_index_logits(**_logits_args(kind, 8, 32768, False, "cuda"))
    report(il._dsv4_index_logits_kernel, "index_logits", out_dir)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
