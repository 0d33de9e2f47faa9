"""Decode speed with and without a JSON-schema grammar (constrained decoding), offline through sglang.Engine.

Each (batch, mode) is warmed up at its own shape, then timed twice: a run of `--new` tokens and a run of 1 token (the
prefill and the first token); decode tok/s = batch x (new - 1) / (difference). The schema is an array of at least
1,000 enum strings, so no output completes early and every step is constrained.

    python benchmark/bench_grammar.py --model-path tiny-deepseek-v4 --batch 1 32            (CPU)
    python benchmark/bench_grammar.py --model-path /tmp/w/base --dtype bfloat16 --batch 1 32 (GPU)
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = json.dumps({"type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "minItems": 1000})


def timed(engine, batch: int, new: int, constrained: bool) -> float:
    params = {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "seed": 1}
    if constrained:
        params["json_schema"] = SCHEMA
    ids = [[100 + b, 200 + b, 300 + b, 400 + b] * 8 for b in range(batch)]
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=[dict(params) for _ in range(batch)])
    seconds = time.perf_counter() - start
    assert all(len(o["output_ids"]) == new for o in outs), [len(o["output_ids"]) for o in outs]
    if constrained and new > 8:  # the constraint held: a JSON array of the enum strings, cut by the length limit
        ok = all(o["text"].startswith('["') and set(o["text"]) <= set('[]",alphbetgmd') for o in outs)
        assert ok, outs[0]["text"]
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="tiny-deepseek-v4")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=None, help="append one JSON line per (batch, mode)")
    args = ap.parse_args()

    import sglang

    engine = sglang.Engine(model_path=args.model_path, dtype=args.dtype, log_level="warning",
                           max_running_requests=max(args.batch))
    rows = []
    for batch in args.batch:
        for constrained in (False, True):
            timed(engine, batch, args.new, constrained)  # warm-up at this shape (graphs, grammar compile)
            full = timed(engine, batch, args.new, constrained)
            first = timed(engine, batch, 1, constrained)
            row = {"batch": batch, "grammar": "json_schema" if constrained else "none",
                   "decode_tok_s": batch * (args.new - 1) / max(1e-9, full - first),
                   "ms_per_step": 1000 * (full - first) / (args.new - 1)}
            rows.append(row)
            print(json.dumps(row))
    for batch in args.batch:
        plain, gram = (next(r for r in rows if r["batch"] == batch and r["grammar"] == g)
                       for g in ("none", "json_schema"))
        print(f"batch {batch}: {plain['decode_tok_s']:.1f} -> {gram['decode_tok_s']:.1f} tok/s with the grammar "
              f"({gram['decode_tok_s'] / plain['decode_tok_s']:.2f}x)")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "model": args.model_path}) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
