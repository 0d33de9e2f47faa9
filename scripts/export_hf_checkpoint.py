"""Export a native DeepSeek-V4 checkpoint in HF transformers' saved form (dequantized), for the oracle.

    python scripts/export_hf_checkpoint.py NATIVE_DIR OUT_DIR [--dtype float32|bfloat16] [--num-shards N]
"""

from __future__ import annotations

import argparse

import torch

from sglang.srt.model_loader.hf_export import export_hf_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("native_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args()
    export_hf_checkpoint(args.native_dir, args.out_dir, dtype=getattr(torch, args.dtype), num_shards=args.num_shards)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
