"""Write the random checkpoint of a benchmark config for the GPU benchmark scripts: bf16 with the config's
quantization stripped, or with --quantize the hub's formats (FP8 e4m3 linears with 128x128 ue8m0 scales, MXFP4
routed experts).

    python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base [--quantize]
        [--shard-gb 4 --device cuda]

--shard-gb streams the tensors into shards of about that size (host memory holds one shard: the 48 GB of
benchmark/configs/flash-12l256e.config.json quantized); --device cuda draws and quantizes them on the GPU (other random
values than the CPU's, the same formats).
"""

import argparse
import json

from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("out_dir")
ap.add_argument("--quantize", action="store_true")
ap.add_argument("--shard-gb", type=float, default=None)
ap.add_argument("--device", default="cpu")
args = ap.parse_args()
cfg = json.load(open(args.config))
if not args.quantize:
    for key in ("quantization_config", "expert_dtype"):
        cfg.pop(key, None)
make_tiny_checkpoint(args.out_dir, cfg, seed=0, quantize=args.quantize, dtype="bfloat16", shard_gb=args.shard_gb,
                     device=args.device)
