"""Write the bf16 random checkpoint of a benchmark config (quantization stripped) for the GPU benchmark scripts.

    python3 scripts/make_slice_checkpoint.py benchmark/configs/flash-slice-4l32e.config.json /tmp/w/base
"""

import json
import sys

from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

config_path, out_dir = sys.argv[1], sys.argv[2]
cfg = json.load(open(config_path))
for key in ("quantization_config", "expert_dtype"):
    cfg.pop(key, None)
make_tiny_checkpoint(out_dir, cfg, seed=0, dtype="bfloat16")
