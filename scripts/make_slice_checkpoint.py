"""Write the random checkpoint of a benchmark config for the GPU benchmark scripts: bf16 with the config's
quantization stripped, or with --quantize the hub's formats (FP8 e4m3 linears with 128x128 ue8m0 scales, MXFP4
routed experts).

    python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base [--quantize]
        [--shard-gb 4 --device cuda]

--shard-gb streams the tensors into shards of about that size (host memory holds one shard: the 48 GB of
benchmark/configs/flash-12l256e.config.json quantized); --device cuda draws and quantizes them on the GPU (other random
values than the CPU's, the same formats). An existing out_dir is kept (the draw is seeded): the checkpoint is written
beside it and renamed into place, so a directory there is always whole, and a second call does not fill the disk
with another copy. Benchmarks that need edited weights (benchmark/bench_speculative.py) call
`write_slice_checkpoint` with an `edit`.
"""

import argparse
import json
import os
import shutil
from typing import Optional

from sglang.srt.model_loader.tiny_checkpoint import WeightEdit, make_tiny_checkpoint


def write_slice_checkpoint(config_path: str, out_dir: str, quantize: bool = False, shard_gb: Optional[float] = None,
                           device: str = "cpu", dtype: str = "bfloat16", edit: Optional[WeightEdit] = None) -> str:
    """The checkpoint of the config at `config_path` in `out_dir` (this script's command line as a function)."""
    with open(config_path) as f:
        cfg = json.load(f)
    if not quantize:
        for key in ("quantization_config", "expert_dtype"):
            cfg.pop(key, None)
    return make_tiny_checkpoint(out_dir, cfg, seed=0, quantize=quantize, dtype=dtype, shard_gb=shard_gb,
                                device=device, edit=edit)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out_dir")
    ap.add_argument("--quantize", action="store_true")
    ap.add_argument("--shard-gb", type=float, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if os.path.isdir(args.out_dir):  # only ever a whole checkpoint: written beside, then renamed into place
        print(f"{args.out_dir} exists: kept (delete it to write it again)")
    else:
        partial = args.out_dir.rstrip("/") + ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier write (a full disk, a killed call)
        write_slice_checkpoint(args.config, partial, args.quantize, args.shard_gb, args.device)
        os.rename(partial, args.out_dir)
