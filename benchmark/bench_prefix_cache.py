"""Multi-turn sessions with and without the prefix cache: time to the first token of each turn and the prompt-token
hit rate, through the offline engine (CPU or GPU).

    python benchmark/bench_prefix_cache.py [--model-path tiny-deepseek-v4] [--device cpu] [--sessions 4]
        [--turns 4] [--system-tokens 300] [--turn-tokens 150] [--page-size N] [--out result.json]

Each session starts with a shared system prompt plus its own first message; every turn resends the whole conversation
plus --turn-tokens new tokens and generates one token (what TTFT measures). Sessions are interleaved turn by turn, as
concurrent agents would be. The same token sequences run with the cache and with --disable-radix-cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class SessionsRun:
    """What run_sessions measured."""

    ttft: list  # seconds to the first (only) token of each turn, in order
    cached_tokens: int
    prompt_tokens: int


def run_sessions(eng, sessions: int, turns: int, system_tokens: int, turn_tokens: int) -> SessionsRun:
    """Interleaved multi-turn sessions on an engine: each starts with a shared system prompt plus its own message;
    every turn resends the whole conversation plus turn_tokens new tokens and generates one token (what TTFT
    measures). The same token sequences on every engine (a fixed seed)."""
    g = torch.Generator().manual_seed(0)
    vocab = eng.model_runner.model_config.vocab_size

    def tokens(n):
        return torch.randint(1000, min(vocab, 100000), (n,), generator=g).tolist()

    system = tokens(system_tokens)
    history = [system + tokens(turn_tokens) for _ in range(sessions)]
    run = SessionsRun([], 0, 0)
    sp = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    for _ in range(turns):
        for h in history:
            start = time.perf_counter()
            out = eng.generate(input_ids=h, sampling_params=sp)
            run.ttft.append(time.perf_counter() - start)
            run.cached_tokens += out["meta_info"]["cached_tokens"]
            run.prompt_tokens += len(h)
            h += out["output_ids"] + tokens(turn_tokens)
    return run


def run(args, cache: bool) -> dict:
    import sglang

    eng = sglang.Engine(model_path=args.model_path, device=args.device, log_level="warning",
                        disable_radix_cache=not cache, max_total_tokens=args.max_total_tokens,
                        page_size=args.page_size)
    try:
        r = run_sessions(eng, args.sessions, args.turns, args.system_tokens, args.turn_tokens)
    finally:
        eng.shutdown()
    return {"cache": cache, "ttft_median_s": statistics.median(r.ttft), "ttft_mean_s": statistics.mean(r.ttft),
            "ttft_last_turn_mean_s": statistics.mean(r.ttft[-args.sessions:]), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "hit_rate": r.cached_tokens / r.prompt_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="tiny-deepseek-v4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--turn-tokens", type=int, default=150)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--page-size", type=int, help="default: the engine's (256 for DeepSeek-V4)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [run(args, cache) for cache in (True, False)]
    for r in rows:
        print(f"cache {'on ' if r['cache'] else 'off'}: TTFT median {r['ttft_median_s'] * 1e3:8.1f} ms, mean "
              f"{r['ttft_mean_s'] * 1e3:8.1f} ms, last turn {r['ttft_last_turn_mean_s'] * 1e3:8.1f} ms; prompt-token "
              f"hit rate {r['hit_rate']:.3f} ({r['cached_tokens']} of {r['prompt_tokens']})", flush=True)
    print(f"speed-up of the median TTFT: {rows[1]['ttft_median_s'] / rows[0]['ttft_median_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
