"""A/B timing of dsv4_sparse_attention between two revisions: whichever `sgl_kernel` is first on PYTHONPATH runs
the FP8 and bf16 caches at decode and prefill row counts (H 64, D 512, the Flash shapes of
bench_dsv4_sparse_attention), one line per case; run it under each revision in turn, alternating, in one call.

    PYTHONPATH=/tmp/old:$PYTHONPATH python benchmark/kernels/sparse_attention_ab.py old   # the other revision
    python benchmark/kernels/sparse_attention_ab.py new                                   # this checkout

JSON rows go to $OUT/sa_ab_TAG.json (default /tmp).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsv4_sparse_attention import _args  # noqa: E402
from common import time_cuda_us  # noqa: E402

import sgl_kernel.dsv4_sparse_attention as sa  # noqa: E402

CASES = (("csa", 1, 65536), ("hca", 1, 65536), ("csa", 32, 65536), ("hca", 32, 65536), ("csa", 128, 65536),
         ("csa", 1024, 4096), ("hca", 1024, 65536), ("csa", 4096, 65536))


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "this"
    rows = []
    for layer, batch, ctx in CASES:
        for fp8 in (True, False):
            args, _ = _args(layer, batch, ctx, fp8, "cuda")
            out = torch.empty_like(args["q"])
            us = time_cuda_us(lambda: sa.dsv4_sparse_attention(**args, out=out))
            rows.append(dict(tag=tag, layer=layer, rows=batch, ctx=ctx, fp8=fp8, us=us))
            print(f"{tag:4s} {layer} rows {batch:5d} ctx {ctx:7d} {'fp8 ' if fp8 else 'bf16'} {us:9.1f} us", flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"sa_ab_{tag}.json"), "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
