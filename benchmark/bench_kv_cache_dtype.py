"""FP8 against bf16 KV cache on a GPU: teacher-forced agreement of the two engines, with the bf16 noise floor beside.

    python benchmark/bench_kv_cache_dtype.py --model-path /tmp/w/base [--tokens 4000] [--out result.json]

`--kv-cache-dtype fp8_e4m3` stores each main KV entry (window and compressed) as DeepSeek-V4's reference simulates it
in training: the nope dims in e4m3 with a ue8m0 scale per 64, the rope dims in bf16; the index keys go FP8 with it.
Here --tokens seeded random tokens run through an engine with each cache, as forwards of 64 tokens (so almost every
key a position attends to comes back from the cache: one forward would attend to its fresh keys) and as one forward;
the logits of every position give the top-1 agreement and the mean |logprob diff| of the next tokens. The noise floor
is the bf16-cache engine against itself run as forwards of 256 tokens (other GEMM shapes, other bf16 rounding). Use
more tokens than the CSA's index top-k times its ratio (Flash: 512 x 4 = 2,048) so that the indexer selects.
Speed and pool capacity of the two caches: `scripts/gpu_kv_dtype.sh` (bench_one_batch with each).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_fp8_linears import engine_logits, logprob_agreement


def _row(label: str, la: torch.Tensor, lb: torch.Tensor, ids: list) -> dict:
    row = {"label": label, "tokens": len(ids) - 1, **logprob_agreement(la, lb, ids)}
    print(f"{label}: top-1 agreement {row['top1_agreement']:.4f}, mean |logprob diff| "
          f"{row['mean_abs_logprob_diff']:.2e} (max {row['max_abs_logprob_diff']:.2e})", flush=True)
    return row


def agreement(model_path: str, tokens: int, device: str = "cuda") -> list:
    """Each engine's logits against the exact engine's (fp32 compute, fp32 cache), all as forwards of 64 tokens, and
    the two caches against each other at bf16 compute."""
    base = {"device": device, "context_length": tokens + 64, "chunk": 64}
    runs = {"exact": {"dtype": "float32", "kv_cache_dtype": "auto"},
            "bf16, bf16 KV": {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
            "bf16, fp8 KV": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
            "fp32, fp8 KV": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
            "bf16, bf16 KV, forwards of 256": {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "chunk": 256}}
    logits = {}
    for name, kw in runs.items():
        logits[name], ids, _ = engine_logits(model_path, tokens, **{**base, **kw})
    rows = [_row(f"{name} vs exact", logits[name], logits["exact"], ids) for name in runs if name != "exact"]
    rows.append(_row("fp8 vs bf16 KV (bf16 compute)", logits["bf16, fp8 KV"], logits["bf16, bf16 KV"], ids))
    rows.append(_row("bf16 noise floor: bf16 KV, forwards of 64 vs 256", logits["bf16, bf16 KV"],
                     logits["bf16, bf16 KV, forwards of 256"], ids))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (e.g. --model-path tiny-deepseek-v4)")
    ap.add_argument("--out")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = {"device": name, "agreement": agreement(args.model_path, args.tokens, args.device)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
