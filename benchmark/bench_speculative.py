"""Decode speed with and without MTP speculative decoding, on a checkpoint whose draft predicts the target.

    python benchmark/bench_speculative.py [--config benchmark/configs/flash-slice-4l32e.config.json] [--steps 3]
        [--batch 1 16] [--new-tokens 64] [--out result.json]

Builds (once, under --work-dir) a random native checkpoint of the config, then the "predictable" variant of
test/srt/spec_checkpoint.py (attention outputs and expert w2 zeroed, head = shifted embedding, MTP = identity on the
next token's embedding), so the draft's tokens are always accepted: the accept length is steps + 1 and the speed-up
is the best the engine's speculative path can give. Reports decode tokens/s per batch size, both ways.

Every (mode, batch) is warmed up at its own shape (same batch and prompt length, WARMUP_DECODE_STEPS decode steps)
before it is timed, then profiled in a separate pass: GPU-busy fraction, kernel launches and host syncs per decode step
(a speculative step is one draft-verify-extend cycle; n/a on CPU), also in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test", "srt"))


def build_checkpoint(config_path: str, work_dir: str) -> str:
    from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint
    from spec_checkpoint import make_predictable

    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    base = os.path.join(work_dir, "base")
    if not os.path.exists(base):
        make_tiny_checkpoint(base, config, seed=0, dtype="float32" if not torch.cuda.is_available() else "bfloat16")
    return make_predictable(base, os.path.join(work_dir, "predictable"))


def engine_ctx(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["max_position_embeddings"]


def decode_tok_s(engine, batch: int, prompt_len: int, new_tokens: int, warmup_tokens: int) -> tuple:
    vocab = engine.model_runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    # Warm-up at this exact shape (batch, prompt length, decode steps of this mode), so no first-use cost is timed.
    engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": warmup_tokens})
    prefill_only = {**params, "max_new_tokens": 1}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=prefill_only)
    sync()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    sync()
    total = time.perf_counter() - t
    tokens = sum(len(o["output_ids"]) for o in outs)
    accept = outs[0]["meta_info"].get("spec_accept_length")
    return batch * (new_tokens - 1) / max(total - prefill, 1e-9), accept, tokens


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "benchmark", "configs", "flash-slice-4l32e.config.json"))
    ap.add_argument("--work-dir", default="/tmp/sglang-bench-spec")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=6,
                    help="decode steps profiled after the timed run, per (mode, batch) (0: no profile)")
    ap.add_argument("--out")
    return ap.parse_args(argv)


def main() -> None:
    import sglang
    from sglang.bench_one_batch import WARMUP_DECODE_STEPS, profile_decode, tokens_per_step

    args = parse_args()
    path = build_checkpoint(args.config, args.work_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []

    def make_engine(spec: bool):
        kwargs = dict(speculative_algorithm="EAGLE", speculative_num_steps=args.steps) if spec else {}
        return sglang.Engine(model_path=path, device=device, log_level="warning", max_running_requests=max(args.batch),
                             context_length=min(4096, engine_ctx(path)), **kwargs)

    for spec in (False, True):
        engine = make_engine(spec)
        for bs in args.batch:
            tok_s, accept, _ = decode_tok_s(engine, bs, args.prompt_len, args.new_tokens,
                                            warmup_tokens=1 + WARMUP_DECODE_STEPS * tokens_per_step(engine))
            rows.append({"speculative": spec, "batch": bs, "decode_tok_s": tok_s, "accept_length": accept,
                         "profile": None})
        engine.shutdown()
        del engine
    # Profiles only after every timed pass: once the CUDA profiler ran, CUPTI stays attached and slows each launch.
    for spec in (False, True):
        engine = make_engine(spec) if args.profile_steps > 0 else None
        for row in (r for r in rows if r["speculative"] == spec):
            prof = None
            if engine is not None:
                prof = profile_decode(engine, row["batch"], args.prompt_len, args.profile_steps, seed=1)
                row["profile"] = dataclasses.asdict(prof)
            accept = row["accept_length"]
            print(f"speculative={spec!s:5} batch {row['batch']:3d}: decode {row['decode_tok_s']:9.1f} tok/s"
                  + (f", accept length {accept:.2f}" if accept else "") + (f" | {prof.columns()}" if prof else ""))
        if engine is not None:
            engine.shutdown()
            del engine
    if args.out:
        with open(args.out, "w") as f:
            name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
