"""Write a deterministic random DeepSeek-V4 checkpoint in the native hub format.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--config cfg.json] [--quantize] [--num-shards 3]
        [--dtype bfloat16|float32] [--seed 0] [--vocab-size 129280]

Without --config the tiny config of docs/dsv4-configs.md 2.1 is used.
"""

from __future__ import annotations

import argparse
import json

from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--config", help="native (or HF-form) config.json to follow; default: the tiny config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", action="store_true", help="FP8 linears + packed FP4 experts, as on the hub")
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--vocab-size", type=int, help="override vocab_size (129280 fits the real tokenizer)")
    args = ap.parse_args()
    config = dict(TINY_CONFIG)
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    if args.vocab_size:
        config["vocab_size"] = args.vocab_size
    make_tiny_checkpoint(args.out_dir, config, seed=args.seed, quantize=args.quantize,
                         num_shards=args.num_shards, dtype=args.dtype)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
