"""Decode speed with and without MTP speculative decoding, on a checkpoint whose draft predicts the target.

    python benchmark/bench_speculative.py [--config benchmark/configs/flash-slice-4l32e.config.json] [--steps 3]
        [--batch 1 16] [--new-tokens 64] [--quantize] [--out result.json]
    python benchmark/bench_speculative.py --model-path benchmark/tiny_model/checkpoint/bf16 \
        --gsm8k-data benchmark/tiny_model/data/gsm8k_test.jsonl [--batch 1 16]

Writes (once, under --work-dir) the "predictable" random checkpoint of the config (test/srt/spec_checkpoint.py:
attention outputs and expert w2 zeroed, head = shifted embedding, MTP = identity on the next token's embedding) with
scripts/make_slice_checkpoint.py's writer, so the draft's tokens are always accepted: the accept length is steps + 1
and the speed-up is the best the engine's speculative path can give. Plain bf16 (the config's quantization stripped),
or with --quantize the hub's formats (FP8 block linears, the MTP layer's too, and MXFP4 routed experts), drawn and
quantized on the GPU where there is one (benchmark/configs/flash-12l256e.config.json: 45 GB, in 4 GB shards).

--model-path takes a trained checkpoint as it is instead (its own MTP layer drafts), and --gsm8k-data the gsm8k
script's 5-shot prompts from a GSM8K-format file in place of random tokens, so a learned draft sees text it can
predict (the accept length is then the model's, not steps + 1).

Per batch size: decode tokens/s plain and speculative, the speed-up, the accept length, GPU ms per plain step and per
speculative cycle (draft steps + verify + draft extend), the cycle's cost in plain steps, the GPU-bound limit of the
speed-up (accept length x plain GPU ms / cycle GPU ms: what the speed-up would be if only GPU time counted), and
launches and kernels per step and per cycle.

Every (mode, batch) is warmed up at its own shape (same batch and prompt length, WARMUP_DECODE_STEPS decode steps)
before it is timed, then profiled in a separate pass: GPU-busy fraction, kernel launches and host syncs per decode step
(a speculative step is one draft-verify-extend cycle; n/a on CPU), also in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "test", "srt"), os.path.join(ROOT, "scripts")]
SHARD_GB = 4  # host memory holds one shard while a benchmark-sized checkpoint streams to disk


def build_checkpoint(config_path: str, work_dir: str, quantize: bool = False) -> str:
    """The predictable checkpoint of the config under `work_dir`, written once (into a sibling directory renamed into
    place, so an interrupted write is never reused)."""
    from make_slice_checkpoint import write_slice_checkpoint
    from spec_checkpoint import predictable_edit

    stem = os.path.basename(config_path).split(".")[0]
    path = os.path.join(work_dir, f"{stem}-predictable{'-fp8-mxfp4' if quantize else ''}")
    if os.path.isdir(path):
        return path
    gpu = torch.cuda.is_available()
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier write
    write_slice_checkpoint(config_path, partial, quantize, shard_gb=SHARD_GB if gpu else None,
                           device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                           edit=predictable_edit)
    os.rename(partial, path)
    return path


def engine_ctx(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["max_position_embeddings"]


def gsm8k_prompts(path: str, count: int) -> list:
    """The gsm8k script's 5-shot prompts for the first `count` questions of a GSM8K-format file."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "gsm8k"))
    import bench_sglang

    lines = bench_sglang.load_lines(path)
    if len(lines) < 5 + count:
        raise ValueError(f"--gsm8k-data {path} holds {len(lines)} lines; {5 + count} are needed (5 shots)")
    return bench_sglang.build_prompts(lines, 5, count)[0]


def decode_tok_s(engine, batch: int, prompt_len: int, new_tokens: int, warmup_tokens: int,
                 texts: Optional[list] = None) -> tuple:
    """Decode tokens/s of one batch (prefill time subtracted), its mean accept length and tokens generated. The
    prompts: `texts[:batch]` where given, else `batch` random prompts of `prompt_len` tokens."""
    if texts is not None:
        prompts = {"prompt": texts[:batch]}
    else:
        vocab = engine.model_runner.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = {"input_ids": [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]}
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    # Warm-up at this exact shape (batch, prompt length, decode steps of this mode), so no first-use cost is timed,
    # then the prefill-only request once: it finds the prompts cached, a prefill shape of its own (a chunk after a
    # prefix) whose first use would otherwise be timed and subtracted from the decode.
    engine.generate(**prompts, sampling_params={**params, "max_new_tokens": warmup_tokens})
    prefill_only = {**params, "max_new_tokens": 1}
    engine.generate(**prompts, sampling_params=prefill_only)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    engine.generate(**prompts, sampling_params=prefill_only)
    sync()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    outs = engine.generate(**prompts, sampling_params=params)
    sync()
    total = time.perf_counter() - t
    tokens = sum(len(o["output_ids"]) for o in outs)
    accepts = [o["meta_info"].get("spec_accept_length") for o in outs]
    accept = sum(accepts) / len(accepts) if None not in accepts else None
    return batch * (new_tokens - 1) / max(total - prefill, 1e-9), accept, tokens


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "benchmark", "configs", "flash-slice-4l32e.config.json"))
    ap.add_argument("--model-path", help="a trained checkpoint as it is (its MTP layer drafts) instead of the "
                    "predictable checkpoint of --config")
    ap.add_argument("--gsm8k-data", help="GSM8K-format jsonl: timed prompts are the gsm8k script's 5-shot prompts")
    ap.add_argument("--work-dir", default="/tmp/sglang-bench-spec")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=6,
                    help="decode steps profiled after the timed run, per (mode, batch) (0: no profile)")
    ap.add_argument("--quantize", action="store_true",
                    help="the checkpoint in the hub's formats (FP8 linears, MXFP4 experts) instead of bf16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.model_path and args.quantize:
        ap.error("--quantize writes the predictable checkpoint of --config; a --model-path is used as it is stored")
    return args


@dataclasses.dataclass
class SpeedUp:
    """One batch size, plain decode against speculative cycles (GPU fields None without a GPU profile)."""

    batch: int
    plain_tok_s: float
    speculative_tok_s: float
    speed_up: float
    accept_length: Optional[float]
    plain_gpu_ms: Optional[float] = None  # per plain decode step
    cycle_gpu_ms: Optional[float] = None  # per speculative cycle (draft steps, verify, draft extend)
    cycle_cost: Optional[float] = None  # cycle GPU ms / plain step GPU ms
    gpu_bound_limit: Optional[float] = None  # accept length x plain GPU ms / cycle GPU ms
    plain_launches: Optional[float] = None  # per step
    cycle_launches: Optional[float] = None
    plain_kernels: Optional[float] = None
    cycle_kernels: Optional[float] = None

    def line(self) -> str:
        def fmt(value: Optional[float], spec: str, unit: str = "") -> str:
            return "n/a" if value is None else format(value, spec) + unit

        return (f"batch {self.batch:3d}: plain {self.plain_tok_s:9.1f} tok/s | speculative "
                f"{self.speculative_tok_s:9.1f} tok/s | speed-up {self.speed_up:5.2f}x | accept "
                f"{fmt(self.accept_length, '.2f')} | GPU ms plain step {fmt(self.plain_gpu_ms, '.3f')}, cycle "
                f"{fmt(self.cycle_gpu_ms, '.3f')} = {fmt(self.cycle_cost, '.2f')} plain steps | GPU-bound limit "
                f"{fmt(self.gpu_bound_limit, '.2f', 'x')} | launches {fmt(self.plain_launches, '.0f')} / "
                f"{fmt(self.cycle_launches, '.0f')}, kernels {fmt(self.plain_kernels, '.0f')} / "
                f"{fmt(self.cycle_kernels, '.0f')} (step / cycle)")


def speed_up(plain: dict, spec: dict) -> SpeedUp:
    """The comparison of one batch size's plain and speculative rows (each with its profile, or None)."""
    out = SpeedUp(plain["batch"], plain["decode_tok_s"], spec["decode_tok_s"],
                  spec["decode_tok_s"] / plain["decode_tok_s"], spec["accept_length"])
    p, c = plain["profile"] or {}, spec["profile"] or {}
    out.plain_gpu_ms, out.cycle_gpu_ms = p.get("gpu_ms_per_step"), c.get("gpu_ms_per_step")
    out.plain_launches, out.cycle_launches = p.get("launches_per_step"), c.get("launches_per_step")
    out.plain_kernels, out.cycle_kernels = p.get("kernels_per_step"), c.get("kernels_per_step")
    if out.plain_gpu_ms and out.cycle_gpu_ms:
        out.cycle_cost = out.cycle_gpu_ms / out.plain_gpu_ms
        if out.accept_length is not None:
            out.gpu_bound_limit = out.accept_length / out.cycle_cost
    return out


def main() -> None:
    import sglang
    from sglang.bench_one_batch import WARMUP_DECODE_STEPS, profile_decode, tokens_per_step

    args = parse_args()
    path = args.model_path or build_checkpoint(args.config, args.work_dir, args.quantize)
    texts = gsm8k_prompts(args.gsm8k_data, max(args.batch)) if args.gsm8k_data else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []

    def make_engine(spec: bool):
        kwargs = dict(speculative_algorithm="EAGLE", speculative_num_steps=args.steps) if spec else {}
        return sglang.Engine(model_path=path, device=device, log_level="warning", max_running_requests=max(args.batch),
                             context_length=min(4096, engine_ctx(path)), cuda_graph_bs=sorted(set(args.batch)),
                             **kwargs)

    def timed(engine, spec: bool) -> None:
        for bs in args.batch:
            tok_s, accept, _ = decode_tok_s(engine, bs, args.prompt_len, args.new_tokens,
                                            warmup_tokens=1 + WARMUP_DECODE_STEPS * tokens_per_step(engine),
                                            texts=texts)
            rows.append({"speculative": spec, "batch": bs, "decode_tok_s": tok_s, "accept_length": accept,
                         "profile": None})

    profiles = {}  # (speculative, batch) -> StepProfile

    def profiled(engine, spec: bool) -> None:
        for row in (r for r in rows if r["speculative"] == spec):
            prof = profile_decode(engine, row["batch"], args.prompt_len, args.profile_steps, seed=1)
            row["profile"], profiles[spec, row["batch"]] = dataclasses.asdict(prof), prof

    # Engines one at a time (two copies of a 45 GB checkpoint do not fit one GPU): plain timed; speculative timed, then
    # profiled; plain profiled. Every profile comes after every timed pass: once the CUDA profiler ran, CUPTI stays
    # attached and slows each launch.
    plan = [(False, (timed,)), (True, (timed, profiled) if args.profile_steps > 0 else (timed,))]
    for spec, passes in plan + ([(False, (profiled,))] if args.profile_steps > 0 else []):
        engine = make_engine(spec)
        for run in passes:
            run(engine, spec)
        engine.shutdown()
        del engine
        gc.collect()  # the engine's memory back before the next one loads
        if device == "cuda":
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: r["speculative"])  # plain rows first, each mode in --batch order
    for row in rows:
        prof, accept = profiles.get((row["speculative"], row["batch"])), row["accept_length"]
        print(f"speculative={row['speculative']!s:5} batch {row['batch']:3d}: decode {row['decode_tok_s']:9.1f} tok/s"
              + (f", accept length {accept:.2f}" if accept else "") + (f" | {prof.columns()}" if prof else ""))
    summary = [speed_up(*(next(r for r in rows if r["batch"] == bs and r["speculative"] == spec)
                          for spec in (False, True))) for bs in args.batch]
    print(f"speculative decoding, {args.steps} draft steps, top-1, {args.steps + 1} tokens verified"
          f"{' (FP8 linears, MXFP4 experts)' if args.quantize else ''}{' on ' + path if args.model_path else ''}"
          f"{', gsm8k prompts' if texts else ''}:")
    for s in summary:
        print(s.line())
    if args.out:
        with open(args.out, "w") as f:
            name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            json.dump({"device": name, "config": args.config, "model_path": args.model_path,
                       "gsm8k_data": args.gsm8k_data, "quantized": args.quantize, "steps": args.steps,
                       "rows": rows, "speed_up": [dataclasses.asdict(s) for s in summary]}, f, indent=1)


if __name__ == "__main__":
    main()
