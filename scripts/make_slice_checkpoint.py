"""Write the random checkpoint of a benchmark config for the GPU benchmark scripts: bf16 with the config's
quantization stripped, or with --quantize the hub's formats (FP8 e4m3 linears with 128x128 ue8m0 scales, MXFP4
routed experts).

    python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base [--quantize]
"""

import json
import sys

from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

config_path, out_dir = sys.argv[1], sys.argv[2]
quantize = "--quantize" in sys.argv[3:]
cfg = json.load(open(config_path))
if not quantize:
    for key in ("quantization_config", "expert_dtype"):
        cfg.pop(key, None)
make_tiny_checkpoint(out_dir, cfg, seed=0, quantize=quantize, dtype="bfloat16")
